#!/usr/bin/env bash
# EasyEdit, made ready here to travel to a GPU machine that has no package registry (#51).
#
#   scripts/gpu/easyedit_env.sh [--src GIT_DIR] [--out DIR] [--test-site]
#
# Writes DIR (default .easyedit, ignored by git) holding one archive, easyedit-env.tar.xz,
# that unpacks (tar -xJf) into
#   EasyEdit/easyeditor, EasyEdit/hparams/{,TRAINING/}MEND the public repository at $COMMIT
#   EasyEdit/EASYEDIT-INFO                                 commit, source, what was carried
#   site/                                                  what `import easyeditor` needs that
#                                                          the GPU machines' image lacks
#   smollm2/                                               the real model's config and tokenizer
#                                                          (data/real/model, when built)
# and checks that `import easyeditor` works from the unpacked copy with the network cut
# (unshare -n, where it can) against this machine's torch and transformers.
#
# --test-site also installs, into DIR/image-site (never carried), the GPU image's packages
# that `import easyeditor` needs (transformers 5.17 as there, pandas, peft, timm, opencv, ...)
# for this machine's Python: the CPU dry run of scripts/gpu/versus.py (tests/slow/gpu_versus.rs)
# imports EasyEdit against them as the GPU machine would, and so does the import check here.
#
# GIT_DIR: a clone (or bare mirror) of github.com/zjunlp/EasyEdit holding $COMMIT (default
# $EASYEDIT_SRC, else a mirror under /work/.mirror, else a fresh clone from GitHub).
#
# Which packages: the modules `import easyeditor` loads at $COMMIT, found by importing it,
# minus those the GPU image already holds (/work/.library/device/KINDS.md's list: torch,
# transformers, numpy, pandas, peft, timm, opencv, sentence-transformers, ...). Versions are
# EasyEdit's requirements.txt pins where it has them. All are pure Python except
# pydantic-core, carried for CPython 3.12 (the GPU image) and 3.11 (here) side by side.
# PyAV is not carried: a 35 MB binary (over what a call may carry beside this repository)
# that EasyEdit imports at module level for video decoding only; site/av is a stand-in whose
# every use raises, so a run that reached video would fail loudly, not silently.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$here"
COMMIT=14cea8245f06715684592ab55184939b99d70784   # EasyEdit main, 2026-07-14
src="${EASYEDIT_SRC:-}"
out="$here/.easyedit"
test_site=0
while [ $# -gt 0 ]; do
  case "$1" in
    --src) src="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --test-site) test_site=1; shift ;;
    *) echo "easyedit_env: unknown argument $1" >&2; exit 2 ;;
  esac
done
log() { echo "[gpu/easyedit_env] $*" >&2; }
die() { echo "[gpu/easyedit_env] error: $*" >&2; exit 1; }
python="$here/.venv/bin/python"
[ -x "$python" ] || die "no project venv ($python): run ./x env first"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
if [ -z "$src" ] && [ -d /work/.mirror/zjunlp+EasyEdit/repo ]; then src=/work/.mirror/zjunlp+EasyEdit/repo; fi
if [ -z "$src" ]; then
  log "cloning github.com/zjunlp/EasyEdit"
  git clone --quiet --filter=blob:none --no-checkout https://github.com/zjunlp/EasyEdit "$work/clone" || die "could not clone EasyEdit (give --src)"
  src="$work/clone"
fi
git -C "$src" cat-file -e "$COMMIT^{commit}" 2>/dev/null || die "$src does not hold EasyEdit commit $COMMIT"

stage="$work/stage"
mkdir -p "$stage/EasyEdit" "$stage/site"
git -C "$src" archive "$COMMIT" easyeditor hparams/TRAINING/MEND hparams/MEND requirements.txt LICENSE | tar -x -C "$stage/EasyEdit"

# Pure-Python wheels (no dependencies resolved: the list is the import's closure), pinned as
# EasyEdit's requirements.txt pins them where it does.
pins="higher==0.2.1 omegaconf==2.3.0 antlr4-python3-runtime==4.9.3 hydra-core==1.3.2 iopath==0.1.10
datasets==4.8.5 dill==0.4.0 multiprocess==0.70.18 qwen_vl_utils==0.0.10 zhipuai==2.1.5.20250415
pydantic==2.12.5 typing-inspection==0.4.2 annotated-types==0.7.0 cachetools==6.2.4 pyjwt==2.10.1
nltk==3.6.5 openai==2.8.1 distro==1.9.0 jiter==0.12.0 sniffio==1.3.1 rouge==1.0.1 fairscale==0.4.13"
wheels="$work/wheels"
mkdir -p "$wheels"
log "downloading $(echo $pins | wc -w) packages"
for p in $pins; do
  case "$p" in
    fairscale==*) "$python" -m pip wheel --quiet --no-deps "$p" -w "$wheels" ;;   # an sdist only, pure Python
    jiter==*) for v in 3.12 3.11; do
        "$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$v" --implementation cp \
          --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$wheels/$v" "$p"; done ;;
    *) "$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 -d "$wheels" "$p" \
         || "$python" -m pip wheel --quiet --no-deps "$p" -w "$wheels" ;;
  esac
done
core="pydantic-core==$(unzip -p "$wheels"/pydantic-*.whl '*/METADATA' | sed -n 's/^Requires-Dist: pydantic-core==\([0-9.]*\).*/\1/p')"
for v in 3.12 3.11; do
  "$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$v" --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$wheels/$v" "$core"
done
# A wheel is a zip: unpacking it is installing it (--target semantics, no scripts run).
for w in "$wheels"/*.whl "$wheels"/3.1*/*.whl; do unzip -q -o "$w" -d "$stage/site"; done
mkdir -p "$stage/site/av"
cat > "$stage/site/av/__init__.py" <<'EOF'
"""Stand-in for PyAV, written by dualedit's scripts/gpu/easyedit_env.sh.

EasyEdit imports `av` at module level (easyeditor/dataset/processor/*_processors.py) to
decode video; the image-only runs carried to the GPU never call it. PyAV itself is a 35 MB
binary wheel, over what one GPU call may carry beside the repository. Any use raises."""


def __getattr__(name):
    raise ImportError(f"av.{name}: PyAV is not carried to this machine (scripts/gpu/easyedit_env.sh): video decoding is unavailable")
EOF
find "$stage/site" -name '__pycache__' -prune -exec rm -rf {} +
# The real model's config and tokenizer (no weights: its 98 MB GGUF cannot travel), for
# random_models.py's SmolLM2-135M-shaped model (scripts/gpu/versus.py).
real="$here/data/real/model"
if [ -f "$real/config.json" ]; then
  mkdir -p "$stage/smollm2"
  for f in config.json tokenizer.json tokenizer_config.json chat_template.jinja generation_config.json; do
    [ -f "$real/$f" ] && cp "$real/$f" "$stage/smollm2/"
  done
else
  log "no data/real/model (./x demo --real builds it): the archive carries no SmolLM2 config"
fi
{
  echo "commit=$COMMIT"
  echo "source=https://github.com/zjunlp/EasyEdit"
  echo "carried=$(ls "$wheels" "$wheels"/3.1* | grep '\.whl$' | sed 's/-py.*\|-cp.*//' | sort -u | tr '\n' ' ')"
  echo "stand_in=av (PyAV, video only)"
} > "$stage/EasyEdit/EASYEDIT-INFO"

# What the GPU image has (KINDS.md, 2026-11) and `import easyeditor` loads, for this
# machine's Python: the stand-in for that image in the CPU dry run.
image_pkgs="transformers==5.17.0 huggingface_hub==1.33.0 tokenizers safetensors pyyaml tqdm numpy pandas scipy
scikit-learn joblib threadpoolctl matplotlib contourpy cycler fonttools kiwisolver pyparsing python-dateutil six
narwhals cloudpickle peft timm torchvision opencv-python-headless sentence-transformers pillow regex requests
urllib3 idna certifi charset-normalizer accelerate psutil packaging einops pyarrow xxhash jinja2 markupsafe
filelock fsspec typing-extensions hf-xet httpx anyio h11 httpcore typer click shellingham rich annotated-doc
markdown-it-py mdurl pygments aiohttp multidict yarl frozenlist aiosignal attrs propcache aiohappyeyeballs
portalocker protobuf sentencepiece tabulate"
if [ "$test_site" = 1 ]; then
  log "installing the GPU image's packages for this Python into $out/image-site (the dry run's stand-in)"
  rm -rf "$out/image-site.partial"
  # No dependency resolution: torch stays the venv's (a resolver would fetch another).
  "$python" -m pip install --quiet --no-deps --target "$out/image-site.partial" $image_pkgs || die "could not install the image's packages"
  rm -rf "$out/image-site" && mv "$out/image-site.partial" "$out/image-site"
fi
if [ -d "$out/image-site" ]; then
  EASYEDIT_CHECK_PYTHONPATH="$out/image-site${EASYEDIT_CHECK_PYTHONPATH:+:$EASYEDIT_CHECK_PYTHONPATH}"
fi

# The check: import from the unpacked copy, this machine's torch and transformers beside it
# (the GPU image has its own), no network.
check_path="$stage/EasyEdit:$stage/site${EASYEDIT_CHECK_PYTHONPATH:+:$EASYEDIT_CHECK_PYTHONPATH}"
net=(); unshare -n true 2>/dev/null && net=(unshare -n)
log "importing easyeditor with no network (${net[*]:-network not cut: unshare unavailable})"
(cd "$work" && env PYTHONPATH="$check_path" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "${net[@]}" "$python" -c '
import easyeditor
from easyeditor import MultimodalTrainer, EditTrainer, VQADataset, CounterFactDataset, MENDMultimodalTrainingHparams, MENDTrainingHparams
print("easyeditor imported from", easyeditor.__file__)') \
  || die "import easyeditor failed from the prepared copy (EASYEDIT_CHECK_PYTHONPATH adds this machine's transformers etc.)"

mkdir -p "$out"
tar -C "$stage" -cJf "$out/easyedit-env.tar.xz.tmp" EasyEdit site $( [ -d "$stage/smollm2" ] && echo smollm2 )
mv "$out/easyedit-env.tar.xz.tmp" "$out/easyedit-env.tar.xz"
log "done: $out/easyedit-env.tar.xz ($(du -h "$out/easyedit-env.tar.xz" | cut -f1))"
