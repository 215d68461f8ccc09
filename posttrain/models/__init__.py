"""Models: loading from ids/paths/objects (``loading``), PEFT helpers (``peft_utils``), offline tiny models
(``tiny``), the chunked forward pass and token log-probs (``forward``), completion scoring of rollouts
(``completion_scoring``) with the shared-prompt layout (``prefix_sharing``), and reference policies (``reference``)."""
