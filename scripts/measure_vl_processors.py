#!/usr/bin/env python3
"""How far transformers' torchvision ("fast") Qwen2-VL image processor is from the PIL one
(the one dualedit reproduces bit for bit on PNGs), on the images in tests/fixtures/vl_images,
and what that does to log-probabilities of the tiny fixture model tests/fixtures/qwen2_vl.

    PYTHONPATH=/work/pyenv/tf-5.24.0:/work/pyenv/torchvision-0.28.0:/work/pyenv/common \\
        .venv/bin/python scripts/measure_vl_processors.py

Prints one line per image: the max abs difference of pixel_values (normalised units and
8-bit levels, one level = 1/255/std), the share of values that differ, and the max abs
log-prob difference of the fixture's first text scored after the image.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import transformers
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_vl_fixtures as vlf  # noqa: E402
from transformers import Qwen2VLForConditionalGeneration  # noqa: E402
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil  # noqa: E402
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor as Fast  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    pil = Qwen2VLImageProcessorPil(min_pixels=vlf.MIN_PIXELS, max_pixels=vlf.MAX_PIXELS)
    fast = Fast(min_pixels=vlf.MIN_PIXELS, max_pixels=vlf.MAX_PIXELS)
    model = Qwen2VLForConditionalGeneration.from_pretrained(str(vlf.FIXTURES / "qwen2_vl"), dtype=torch.float32, attn_implementation="eager").eval()
    ref = json.loads((vlf.FIXTURES / "qwen2_vl" / "reference.json").read_text())
    ids = ref["token_ids"]
    tok = vlf.Tokenizer.from_file(str(vlf.FIXTURES / "qwen2_vl" / "tokenizer.json"))
    meta = json.loads((vlf.IMAGES / "reference.json").read_text())["images"]
    print(f"transformers {transformers.__version__}, fast processor {type(fast).__name__} (torchvision), PIL processor {type(pil).__name__}")
    worst_lp = 0.0
    for name in meta:
        im = Image.open(vlf.IMAGES / name)
        a = pil(images=[im], return_tensors="pt")
        b = fast(images=[Image.open(vlf.IMAGES / name)], return_tensors="pt")
        pa, pb = a["pixel_values"].float(), b["pixel_values"].float()
        if pa.shape != pb.shape:
            print(f"{name:18s} shapes differ {tuple(pa.shape)} vs {tuple(pb.shape)}")
            continue
        d = (pa - pb).abs()
        grid = a["image_grid_thw"][0].tolist()
        n = grid[0] * grid[1] * grid[2] // 4
        input_ids = vlf.sequence(ids, tok, vlf.TEXTS[0], [n])
        lps = [vlf.logprobs(model, ids, input_ids, [p], [grid]) for p in (pa, pb)]
        dl = max(abs(x - y) for x, y in zip(*lps))
        worst_lp = max(worst_lp, dl)
        print(f"{name:18s} {meta[name]['format']:4s} {meta[name]['mode']:5s} max |Δ| {d.max().item():.4f} "
              f"({d.max().item() * 0.26130258 * 255:.2f} levels), {(d > 1e-6).float().mean().item() * 100:5.1f}% of values differ, "
              f"max |Δ log-prob| {dl:.2e}")
    print(f"worst log-prob difference {worst_lp:.2e}")


if __name__ == "__main__":
    main()
