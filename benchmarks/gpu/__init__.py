"""GPU verification: one script that proves posttrain's CUDA paths on a lent GPU machine (issue 42).

Entry point: ``python -m benchmarks.gpu.run --out DIR`` (see README.md here). The same sections run on a tiny model
on CPU with ``--dry-run`` (or when CUDA is absent), which the test suite does so the script cannot rot.
"""
