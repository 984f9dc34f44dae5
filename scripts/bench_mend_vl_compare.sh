#!/usr/bin/env bash
# Interleaved A/B of dualedit's MEND step and edit (benches/mend_vl.rs --timings) against
# the same computation as EasyEdit's (scripts/bench_mend_vl_easyedit.py), both on one
# thread pinned to one core, alternating: dualedit, EasyEdit, dualedit, EasyEdit, ...
# (ROUNDS pairs per configuration), with the load average before each run.
# Like for like: dualedit's `train_microbatch` and `edit` start from the images' pixel
# values, as the Python side's (which is given them); `train_from_files` /
# `edit_from_file` also read and preprocess the PNGs, as training and `dualedit edit` do.
#
#   scripts/bench_mend_vl_compare.sh [ROUNDS] [CONFIG...]
#
# CONFIG: model:side:dtype:runs:warmup (default: small:448:f32:3:1 small:448:bf16:3:1
# tiny:224:f32:10:3 tiny:224:bf16:10:3). Needs the release bench built
# (`cargo build --release --bench mend_vl`) and transformers on PYTHONPATH (PYENV_TF,
# default /work/pyenv/tf-5.23.0). CORE picks the core (default 1).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
rounds="${1:-2}"
[ $# -gt 0 ] && shift
configs=("$@")
[ ${#configs[@]} -eq 0 ] && configs=(small:448:f32:3:1 small:448:bf16:3:1 tiny:224:f32:10:3 tiny:224:bf16:10:3)
bench="$(ls -t "$here"/target/release/deps/mend_vl-* 2>/dev/null | grep -v '\.d$' | head -1 || true)"
[ -x "$bench" ] || { echo "no bench binary: run cargo build --release --bench mend_vl" >&2; exit 1; }
core="${CORE:-1}"
py_path="${PYENV_TF:-/work/pyenv/tf-5.23.0}:/work/pyenv/common"
eval "$("$here/x" env)"
for c in "${configs[@]}"; do
  IFS=: read -r model side dtype runs warmup <<<"$c"
  for r in $(seq 1 "$rounds"); do
    echo "== $c round $r dualedit load $(cut -d' ' -f1-3 /proc/loadavg)"
    DUALEDIT_BENCH_MODEL=$model DUALEDIT_BENCH_SIDE=$side DUALEDIT_BENCH_DTYPE=$dtype DUALEDIT_BENCH_RUNS=$runs DUALEDIT_BENCH_WARMUP=$warmup \
      taskset -c "$core" "$bench" --timings | grep -E "median"
    echo "== $c round $r easyedit load $(cut -d' ' -f1-3 /proc/loadavg)"
    PYTHONPATH="$py_path" taskset -c "$core" "$here/.venv/bin/python" "$here/scripts/bench_mend_vl_easyedit.py" \
      --model "$model" --side "$side" --dtype "$dtype" --runs "$runs" --warmup "$warmup" 2>/dev/null | grep -E "median"
  done
done
echo "== end load $(cut -d' ' -f1-3 /proc/loadavg)"
