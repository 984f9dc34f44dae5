#!/usr/bin/env bash
# dualedit against EasyEdit's MEND on the machine that has the GPU: one command, one JSON
# (scripts/gpu/versus.py; issue #51).
#
#   scripts/gpu/versus.sh [OUT_JSON] [versus.py options]     # default OUT_JSON: $OUT/gpu-versus.json
#
# Carried: the binary (scripts/gpu/build.sh; xz it to fit) and .easyedit/easyedit-env.tar.xz
# (scripts/gpu/easyedit_env.sh; not .easyedit/image-site, the CPU stand-in for the image).
# Environment as scripts/gpu/check.sh: DEVICE, SUB, DUALEDIT_BIN, PYTHON, WORK.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$here"
python="${PYTHON:-python3}"
out="${1:-${OUT:-.}/gpu-versus.json}"
[ $# -gt 0 ] && shift
torch_lib="$("$python" -c 'import os, torch; print(os.path.join(torch.__path__[0], "lib"))')" \
  || { echo "[gpu/versus] error: $python cannot import torch (set PYTHON)" >&2; exit 1; }
export LD_LIBRARY_PATH="$torch_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONUNBUFFERED=1
exec "$python" scripts/gpu/versus.py --python "$python" --out "$out" --work "${WORK:-/tmp/dualedit-gpu-versus}" "$@"
