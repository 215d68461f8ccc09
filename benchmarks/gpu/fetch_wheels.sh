#!/usr/bin/env bash
# Download, on a machine with PyPI access, the wheels that the lent GPU machine lacks for the trainer sections
# (`datasets`) and for the optional TRL side-by-side (`trl`). They are for Linux x86_64 / CPython 3.12 and go into one
# folder to `carry`.
#
# The GPU image already has torch, transformers, accelerate, peft, safetensors, pandas, pyarrow, xxhash, pytest,
# psutil, rich, matplotlib, fsspec, huggingface-hub, and more (/work/.library/device/KINDS.md, "Python packages already
# there"). Missing for datasets 5.2 + trl 1.16: datasets, trl, dill, multiprocess (~1.8 MiB in all).
#
# --with-pyarrow also fetches pyarrow 24.0.0 (46.6 MiB). It is the oldest pyarrow that datasets 5.2 accepts. Use it
# when the image's pyarrow is older than 24: the report's `env` section prints the version. The carry limit is
# 64 MiB per call, and it includes the working tree (~5.4 MiB), so with pyarrow the total is about 54 MiB.
#
# Usage: bash benchmarks/gpu/fetch_wheels.sh [--with-pyarrow] [DIR]   (default DIR: benchmarks/gpu/wheels, git-ignored)
set -euo pipefail
EXTRA=()
if [ "${1:-}" = "--with-pyarrow" ]; then
  EXTRA=("pyarrow==24.0.0")
  shift
fi
DIR="${1:-$(dirname "$0")/wheels}"
mkdir -p "$DIR"
PIP="${PIP:-python3 -m pip}"
$PIP download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$DIR" \
  "datasets==5.2.0" "trl==1.16.0" "dill>=0.3.0,<0.4.2" "multiprocess<0.70.20" "${EXTRA[@]}"
total=$(du -cb "$DIR"/*.whl | tail -1 | cut -f1)
echo "wheels in $DIR: $((total / 1048576)) MiB (carry limit: 64 MiB per call, working tree included)"
if [ "$total" -gt $((58 * 1048576)) ]; then
  echo "over what one call can carry next to the working tree: carry pyarrow-*.whl in one call and the rest in the" \
    "next (see benchmarks/gpu/README.md)" >&2
  exit 2
fi
