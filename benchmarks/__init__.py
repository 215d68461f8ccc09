"""posttrain's benchmark suite: step time, generation share, tokens/s and peak RSS per trainer, and a side-by-side
comparison with Hugging Face TRL (run in its own venv, ``benchmarks/.venv-trl``). See benchmarks/README.md.

Kept import-free: the TRL venv imports this package too (for ``benchmarks.common`` and ``benchmarks.workloads``).
"""

import os as _os

# RSS of the bare interpreter (only the standard library loaded): the zero of "peak RSS above the interpreter",
# which counts the libraries' import footprint as a user sees it. Read before anything heavy is imported.
try:
    with open("/proc/self/statm") as _f:
        INTERPRETER_RSS_BYTES = int(_f.read().split()[1]) * _os.sysconf("SC_PAGE_SIZE")
except OSError:  # not Linux: no reading, the field is left out of the records
    INTERPRETER_RSS_BYTES = None
