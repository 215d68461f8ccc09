#!/usr/bin/env bash
# Download, on a machine with PyPI access, the wheels the GPU machine lacks for the trainer sections (`datasets`) and
# the optional TRL side-by-side (`trl`), for Linux x86_64 / CPython 3.12, into one folder to `carry`.
#
# The GPU machine already has torch, transformers, accelerate, peft, safetensors and their dependencies (numpy,
# huggingface_hub, fsspec, filelock, pyyaml, tqdm, packaging, jinja2, psutil). What is missing for
# datasets 5.2 + trl 1.16 (and pytest, for the gpu-marked tests) is listed below; pyarrow is pinned to 24.0.0, the oldest release datasets 5.2 accepts and
# ~8 MiB smaller than the newest, so the whole folder stays under the 64 MiB carry limit (~61 MiB).
#
# Usage: bash benchmarks/gpu/fetch_wheels.sh [DIR]      (default DIR: benchmarks/gpu/wheels, git-ignored)
set -euo pipefail
DIR="${1:-$(dirname "$0")/wheels}"
mkdir -p "$DIR"
PIP="${PIP:-python -m pip}"
$PIP download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64 \
  -d "$DIR" \
  "datasets==5.2.0" "trl==1.16.0" "pyarrow==24.0.0" "pandas" "python-dateutil" "six" \
  "dill>=0.3.0,<0.4.2" "multiprocess<0.70.20" "xxhash" \
  "pytest" "pluggy" "iniconfig" "pygments" "tzdata"
total=$(du -cb "$DIR"/*.whl | tail -1 | cut -f1)
echo "wheels in $DIR: $((total / 1048576)) MiB (carry limit: 64 MiB)"
if [ "$total" -gt $((64 * 1048576)) ]; then
  echo "over the carry limit: carry pyarrow-*.whl in one call and the rest in the next (see README.md)" >&2
  exit 2
fi
