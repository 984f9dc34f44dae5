#!/usr/bin/env bash
# dualedit against EasyEdit's MEND on the machine that has the GPU: one command, one JSON
# (scripts/gpu/versus.py; issue #51). scripts/gpu/check.sh's wrapper (the same environment:
# DEVICE, SUB, DUALEDIT_BIN, PYTHON, WORK) running versus.py.
#
#   scripts/gpu/versus.sh [OUT_JSON] [versus.py options]     # default OUT_JSON: $OUT/gpu-versus.json
#
# Carried: the binary (scripts/gpu/build.sh; xz it to fit) and .easyedit/easyedit-env.tar.xz
# (scripts/gpu/easyedit_env.sh; not .easyedit/image-site, the CPU stand-in for the image).
exec env GPU_SCRIPT=versus.py "$(dirname "${BASH_SOURCE[0]}")/check.sh" "$@"
