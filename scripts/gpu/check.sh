#!/usr/bin/env bash
# The GPU check on the machine that has the GPU: one command, one JSON (scripts/gpu/check.py;
# GPU_SCRIPT=versus.py runs the side-by-side with EasyEdit instead: scripts/gpu/versus.sh).
#
#   scripts/gpu/check.sh [OUT_JSON] [check.py options]     # default OUT_JSON: $OUT/gpu-check.json or ./gpu-check.json
#
# Environment: DEVICE (default cuda:0), SUB (default cpu), DUALEDIT_BIN (default
# target/gpu-2.11.0/dualedit, what scripts/gpu/build.sh leaves), PYTHON (default python3:
# the one with that machine's torch and transformers), WORK (scratch, default
# /tmp/dualedit-gpu-check: the random models are large, keep them out of $OUT).
# The binary finds that machine's libtorch through LD_LIBRARY_PATH, set here from
# `import torch` (its RUNPATH also names the GPU image's /opt/torch/.venv torch/lib).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$here"
python="${PYTHON:-python3}"
script="${GPU_SCRIPT:-check.py}"
name="${script%.py}"
out="${1:-${OUT:-.}/gpu-$name.json}"
[ $# -gt 0 ] && shift
torch_lib="$("$python" -c 'import os, torch; print(os.path.join(torch.__path__[0], "lib"))')" \
  || { echo "[gpu/check] error: $python cannot import torch (set PYTHON)" >&2; exit 1; }
export LD_LIBRARY_PATH="$torch_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONUNBUFFERED=1
exec "$python" "scripts/gpu/$script" --python "$python" --out "$out" --work "${WORK:-/tmp/dualedit-gpu-$name}" "$@"
