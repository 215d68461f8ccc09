"""posttrain's benchmark suite: step time, generation share, tokens/s and peak RSS per trainer, and a side-by-side
comparison with Hugging Face TRL (run in its own venv, ``benchmarks/.venv-trl``). See benchmarks/README.md.

Kept import-free: the TRL venv imports this package too (for ``benchmarks.common`` and ``benchmarks.workloads``).
"""
