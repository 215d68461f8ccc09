"""Reliability helpers behind ``BaseTrainer``: crash-safe checkpoints, the numerics guard and up-front checks.

- ``checkpointing`` — write each checkpoint into ``tmp-checkpoint-N`` and rename it to ``checkpoint-N`` only when
  complete; find the newest *complete* checkpoint; rotate without ever deleting the newest one.
- ``numerics`` — detect a NaN/inf loss or gradient norm, report the step and the batch, stop or skip the step.
- ``validation`` — generic checks run before the first step (output_dir writable, non-empty data, batch sizes,
  tokenizer pad token, the checkpoint to resume from).
"""
