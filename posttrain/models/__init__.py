"""Model helpers: offline tiny models, loading from ids/paths/objects, PEFT and reference policies."""
