#!/usr/bin/env bash
# Build the dualedit binary for a machine whose PyTorch is not the 2.13 tch 0.26 expects
# (2.11.0+cu130 on the GPU machines used so far), here, to be carried there.
#
#   scripts/gpu/build.sh                     # torch 2.11.0, binary in target/gpu-2.11.0/dualedit
#   TORCH_VERSION=2.12.0 scripts/gpu/build.sh
#
# Environment (all optional):
#   TORCH_VERSION     the PyTorch of the target machine (default 2.11.0)
#   GPU_BUILD_DIR     work folder (default target/gpu-$TORCH_VERSION, ignored by git)
#   TORCH_WHEEL_DIR   where the torch wheel is downloaded/looked for (default $GPU_BUILD_DIR/wheel)
#   DEVICE_TORCH_LIB  torch/lib on the target machine, put in the binary's RUNPATH after the
#                     local one (default: the GPU image's /opt/torch/.venv/.../torch/lib);
#                     scripts/gpu/check.sh also sets LD_LIBRARY_PATH from `import torch` there
#
# Steps: (1) download the torch wheel (no dependencies: only its lib/ and include/ are used;
# the CUDA libraries libtorch_cuda needs at link time come from the project venv's nvidia/
# folder, which must be the same CUDA major), (2) copy torch-sys from the cargo registry,
# (3) neutralise the wrappers of operators this torch lacks (patch_torch_sys.py: found by the
# compiler, not by a list), (4) `cargo rustc` with LIBTORCH pointing at the wheel,
# LIBTORCH_BYPASS_VERSION_CHECK=1 and a `[patch.crates-io]` override given by `--config`
# (Cargo.toml is not edited; Cargo.lock is restored afterwards), in a target dir of its own,
# seeded from target/release so only torch-sys, tch and dualedit compile.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$here"
torch_version="${TORCH_VERSION:-2.11.0}"
work="${GPU_BUILD_DIR:-$here/target/gpu-$torch_version}"
wheel_dir="${TORCH_WHEEL_DIR:-$work/wheel}"
device_torch_lib="${DEVICE_TORCH_LIB:-/opt/torch/.venv/lib/python3.12/site-packages/torch/lib}"
venv="$here/.venv"
log() { echo "[gpu/build] $*" >&2; }
die() { echo "[gpu/build] error: $*" >&2; exit 1; }

[ -x "$venv/bin/python" ] || ./x env >/dev/null   # the project venv (torch 2.13, its CUDA libs)
python="$venv/bin/python"
eval "$(./x env)"
mkdir -p "$work" "$wheel_dir"

# (1) The wheel: only torch/lib and torch/include are unpacked.
wheel="$(ls "$wheel_dir"/torch-"$torch_version"-*.whl 2>/dev/null | head -n1 || true)"
if [ -z "$wheel" ]; then
  log "downloading torch==$torch_version (no dependencies) into $wheel_dir"
  "$python" -m pip download --quiet --no-deps --only-binary=:all: "torch==$torch_version" -d "$wheel_dir" \
    || die "could not download torch==$torch_version (set TORCH_WHEEL_DIR to a folder holding its wheel)"
  wheel="$(ls "$wheel_dir"/torch-"$torch_version"-*.whl | head -n1)"
fi
site="$work/site"
if [ ! -f "$site/.unpacked-$(basename "$wheel")" ]; then
  log "unpacking $(basename "$wheel") (lib/, include/)"
  rm -rf "$site" && mkdir -p "$site"
  unzip -q -o "$wheel" 'torch/lib/*' 'torch/include/*' 'torch/version.py' -d "$site"
  touch "$site/.unpacked-$(basename "$wheel")"
fi
libtorch="$site/torch"
wheel_cuda="$(sed -n "s/^cuda[^=]*= *'\([0-9]*\)\..*/\1/p" "$libtorch/version.py")"
venv_cuda="$("$python" -c 'import torch; print((torch.version.cuda or "").split(".")[0])')"
site_packages="$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
if [ -n "$wheel_cuda" ]; then
  [ "$wheel_cuda" = "$venv_cuda" ] || die "torch $torch_version is built for CUDA $wheel_cuda, the project venv's torch for CUDA $venv_cuda: its CUDA libraries cannot stand in at link time"
  # libtorch_cuda's RUNPATH ($ORIGIN/../../nvidia/...) then finds the CUDA libraries at link
  # time, and dualedit's build.rs finds the CUDA runtime headers (csrc/memcap.cpp) beside torch/.
  ln -sfn "$site_packages/nvidia" "$site/nvidia"
fi

# (2) torch-sys, as the lock file pins it.
registry_src="$(cargo metadata --format-version 1 --locked 2>/dev/null | "$python" -c '
import json, sys
m = json.load(sys.stdin)
print(next(p["manifest_path"] for p in m["packages"] if p["name"] == "torch-sys" and p["source"]))')" \
  || die "could not locate torch-sys in the cargo registry (cargo metadata failed)"
registry_src="$(dirname "$registry_src")"
torch_sys="$work/torch-sys"
stamp="$torch_sys/.patched-for-$(basename "$wheel")"
if [ ! -f "$stamp" ]; then
  log "copying $registry_src"
  rm -rf "$torch_sys" && cp -r "$registry_src" "$torch_sys"
  # (3) Neutralise the wrappers this libtorch cannot compile.
  log "compiling torch_api_generated.cpp against torch $torch_version to find what it lacks (a few minutes)"
  "$python" scripts/gpu/patch_torch_sys.py --torch-sys "$torch_sys" --libtorch "$libtorch" --list "$work/neutralised-wrappers.txt"
  touch "$stamp"
fi
log "$(wc -l < "$work/neutralised-wrappers.txt") wrappers neutralised (list: $work/neutralised-wrappers.txt)"

# (4) Build. Seed the target dir once, so the crates that do not depend on libtorch are reused.
target_dir="$work/target"
if [ ! -d "$target_dir/release" ] && [ -d target/release ]; then
  log "seeding $target_dir from target/release"
  mkdir -p "$target_dir" && cp -a target/release "$target_dir/release"
fi
cp Cargo.lock "$work/Cargo.lock.orig"
trap 'cp "$work/Cargo.lock.orig" "$here/Cargo.lock"' EXIT
log "building (LIBTORCH=$libtorch, RUNPATH += $device_torch_lib)"
env -u LIBTORCH_USE_PYTORCH \
  LIBTORCH="$libtorch" LIBTORCH_BYPASS_VERSION_CHECK=1 LIBTORCH_CXX11_ABI=1 \
  cargo rustc --release --bin dualedit --target-dir "$target_dir" \
    --config "patch.crates-io.torch-sys.path=\"$torch_sys\"" \
    -- -C "link-arg=-Wl,-rpath,$device_torch_lib"
cp "$target_dir/release/dualedit" "$work/dualedit"
{
  echo "torch=$torch_version"
  echo "wheel=$(basename "$wheel")"
  echo "neutralised=$(tr '\n' ' ' < "$work/neutralised-wrappers.txt")"
  echo "runpath=$(readelf -d "$work/dualedit" | sed -n 's/.*runpath: \[\(.*\)\]/\1/p')"
  echo "commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
} > "$work/BUILD-INFO"
# Smoke test here: the binary runs on this machine's CPU against the torch it was built for.
"$work/dualedit" --version >/dev/null || die "the built binary does not start: $work/dualedit"
log "done: $work/dualedit ($(du -h "$work/dualedit" | cut -f1)); $work/BUILD-INFO"
