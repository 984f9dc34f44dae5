#!/usr/bin/env bash
# Snapshot `dualedit plan --json` for every preset in configs/ x every test-fixture model x
# every placement (plus a split-device variant and the multimodal views for the VL models),
# so a refactor can show that no plan changed:
#
#   scripts/plan_snapshot.sh BIN OUTDIR        # write OUTDIR/<config>__<model>__<variant>.json
#   diff -r BEFORE AFTER                       # identical trees = identical plans
#
# Every config x model pair is planned once with the defaults; a failing plan is recorded too
# (its stderr and exit code), so a change in which combinations fail shows up as well. The
# pairs that plan are then planned under each placement (device names are not checked for
# existence by `plan`, so cuda:1 works on a machine without GPUs).
set -uo pipefail
bin="${1:?usage: plan_snapshot.sh BIN OUTDIR}"
out="${2:?usage: plan_snapshot.sh BIN OUTDIR}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mkdir -p "$out"
n=0
for cfg in "$here"/configs/*.json; do
  for model in "$here"/tests/fixtures/*/; do
    [ -f "$model/config.json" ] || continue
    m="$(basename "$model")"
    variants=("default::"
              "replica::--device cuda:0 --sub-device cuda:1 --placement replica"
              "balanced::--device cuda:0 --sub-device cuda:1 --placement balanced"
              "compare::--device cuda:0 --sub-device cuda:1"
              "auto::--device cuda:0 --sub-device cuda:1 --placement auto --max-memory cuda:0=16GiB,cuda:1=16GiB"
              "optcpu::--device cuda:0 --sub-device cuda:1 --placement balanced --optimizer-device cpu"
              "bf16::--dtype bf16 --max-length 64")
    if [ -f "$model/preprocessor_config.json" ]; then
      variants+=("vqa::--image-size 448x448 --ds vqa"
                 "vqa-balanced::--image-size 448x448 --ds vqa --device cuda:0 --sub-device cuda:1 --placement balanced")
    fi
    for v in "${variants[@]}"; do
      name="${v%%::*}"; args="${v#*::}"
      f="$out/$(basename "$cfg" .json)__${m}__${name}"
      # shellcheck disable=SC2086
      "$bin" plan --json --model "$model" --config "$cfg" $args >"$f.json" 2>"$f.err"
      rc=$?
      echo $rc >"$f.rc"
      # Log lines carry timestamps; keep only the error text.
      sed -i -E 's/^[0-9T:.Z-]+ +//' "$f.err"
      n=$((n + 1))
      [ "$name" = default ] && [ "$rc" != 0 ] && break
    done
  done
done
echo "$n plans written to $out"
