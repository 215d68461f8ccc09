"""The offline demo: SFT then GRPO on a generated arithmetic task, with a before/after table and a report."""
