"""Checks /workdir/stats.py; exit status 0 when every case passes."""

import sys

sys.path.insert(0, "/workdir")
import stats  # noqa: E402

cases = [([1, 2, 3], 2), ([5], 5), ([-1, 1], 0), ([0.5, 1.5], 1.0)]
failed = [(values, stats.mean(values), want) for values, want in cases if abs(stats.mean(values) - want) > 1e-9]
for values, got, want in failed:
    print(f"mean({values}) = {got}, want {want}")
sys.exit(1 if failed else 0)
