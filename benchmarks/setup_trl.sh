#!/usr/bin/env bash
# Create benchmarks/.venv-trl: a separate virtual environment with Hugging Face TRL, used only by
# `python -m benchmarks compare` (benchmarks/trl_runner.py runs inside it). TRL is never a dependency of posttrain.
#
# The TRL venv gets the same torch / transformers / accelerate / datasets / tokenizers versions as posttrain's venv
# (read from it when it exists), so a comparison measures the trainers, not the libraries underneath.
# torch is installed FIRST and pinned: an unpinned torch would pull a multi-GB CUDA build.
#
#   bash benchmarks/setup_trl.sh                 # TRL 1.16.0 (falls back to the newest TRL pip can resolve)
#   TRL_VERSION=1.13.0 bash benchmarks/setup_trl.sh
#   PYTHON=python3.11 MAIN_VENV=.venv bash benchmarks/setup_trl.sh
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
VENV="${TRL_VENV:-$HERE/.venv-trl}"
MAIN_VENV="${MAIN_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3.11}"
TRL_VERSION="${TRL_VERSION:-1.16.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0+cpu}"

if ! command -v "$PYTHON" >/dev/null 2>&1; then
    PYTHON=python3
fi

# Versions of the shared stack, taken from posttrain's venv so both sides run the same kernels.
pins=()
if [ -x "$MAIN_VENV/bin/python" ]; then
    while IFS= read -r line; do
        [ -n "$line" ] && pins+=("$line")
    done < <("$MAIN_VENV/bin/python" - <<'EOF'
from importlib.metadata import PackageNotFoundError, version

for name in ("transformers", "accelerate", "datasets", "tokenizers", "safetensors", "huggingface_hub", "peft"):
    try:
        print(f"{name}=={version(name)}")
    except PackageNotFoundError:
        pass
EOF
)
    # Keep the local label (2.13.0+cpu): it matches only the CPU wheel, never the CUDA build of the same release.
    TORCH_VERSION="$("$MAIN_VENV/bin/python" -c 'import torch; print(torch.__version__)')"
fi

echo "creating $VENV with $PYTHON (torch==$TORCH_VERSION, trl==$TRL_VERSION, ${pins[*]:-unpinned stack})"
"$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check --quiet)

# 1. torch first, the CPU build: "2.13.0+cpu" matches only a CPU wheel (on this project's machines pip's find-links
#    holds it). Elsewhere point pip at PyTorch's CPU wheel index first (PIP_EXTRA_INDEX_URL=... bash setup_trl.sh).
"${PIP[@]}" "torch==$TORCH_VERSION"

# 2. TRL with the shared stack pinned; if that TRL release refuses those versions, take the newest one that accepts them.
if ! "${PIP[@]}" "torch==$TORCH_VERSION" "${pins[@]}" "trl==$TRL_VERSION"; then
    echo "trl==$TRL_VERSION does not resolve with ${pins[*]}; installing the newest compatible TRL" >&2
    "${PIP[@]}" "torch==$TORCH_VERSION" "${pins[@]}" trl
fi

# 3. Pillow for the VLM workload and the vlm/ fidelity scenarios (PIL images in the dataset; the tiny VLMs' image
#    processors are the PIL ones). Not torchvision: PyPI's build does not import beside the pinned CPU torch.
"${PIP[@]}" pillow

# peft comes with the pins (as in posttrain's venv): the LoRA workload (DPO without a reference copy) needs it.
"$VENV/bin/python" - <<'EOF'
import peft, PIL, torch, transformers, trl

print(f"TRL venv ready: trl {trl.__version__}, transformers {transformers.__version__}, torch {torch.__version__}")
EOF
