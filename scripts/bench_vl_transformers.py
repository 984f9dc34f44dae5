#!/usr/bin/env python3
"""transformers' side of benches/vl.rs: the same small Qwen2-VL / Qwen2.5-VL configs
(benches/vl_configs/*.json, random f32 weights), the same image (tests/fixtures/vl_images/
big.png, max_pixels 28·28·256 -> 392 × 308, 616 patches) and the same 32 text tokens.

    .venv/bin/python scripts/bench_vl_transformers.py

Prints the median of 10 timed runs (after 3 warm-up runs) of: the image processor (PIL
backend), the vision tower, the text forward given the image features, and the whole
model forward (vision + text) — with the default (sdpa) attention, as `from_pretrained`
would pick, on one thread (as benches/vl.rs).
"""

import json
import statistics
import time
from pathlib import Path

import torch
from PIL import Image
from transformers import (
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

ROOT = Path(__file__).resolve().parent.parent
TEXT_TOKENS = 32


def timed(fn, warmup=3, runs=10):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


@torch.no_grad()
def main():
    torch.set_num_threads(1)  # as benches/vl.rs: the CPU is shared, one thread is steadier
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    proc = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=28 * 28 * 256)
    path = ROOT / "tests/fixtures/vl_images/big.png"
    for name, cfg_cls, cls in [
        ("qwen2_vl", Qwen2VLConfig, Qwen2VLForConditionalGeneration),
        ("qwen2_5_vl", Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration),
    ]:
        raw = json.loads((ROOT / "benches/vl_configs" / f"{name}.json").read_text())
        cfg = cfg_cls.from_dict(raw)
        torch.manual_seed(0)
        model = cls._from_config(cfg, attn_implementation="sdpa", dtype=torch.float32).eval()
        out = proc(images=[Image.open(path)], return_tensors="pt")
        pv, grid = out["pixel_values"], out["image_grid_thw"]
        assert grid.tolist() == [[1, 22, 28]], grid
        n_img = int(grid.prod()) // 4
        ids = [raw["vision_start_token_id"]] + [raw["image_token_id"]] * n_img + [raw["vision_end_token_id"]]
        ids += [(i * 37 + 11) % 4000 for i in range(TEXT_TOKENS)]
        input_ids = torch.tensor([ids])
        mm = (input_ids == raw["image_token_id"]).to(torch.int32)
        inner = model.model

        def vision():
            return inner.get_image_features(pv, grid).pooler_output

        feats = torch.cat(vision(), 0)
        pos, _ = inner.get_rope_index(input_ids, mm, image_grid_thw=grid)

        def text():
            emb = inner.get_input_embeddings()(input_ids)
            emb = emb.masked_scatter((input_ids == raw["image_token_id"])[..., None], feats)
            h = inner.language_model(inputs_embeds=emb, position_ids=pos).last_hidden_state
            return model.lm_head(h)

        def whole():
            return model(input_ids=input_ids, pixel_values=pv, image_grid_thw=grid, mm_token_type_ids=mm).logits

        print(f"{name}: preprocess_png_400x300 {timed(lambda: proc(images=[Image.open(path)], return_tensors='pt')):.2f} ms")
        print(f"{name}: vision_tower_616_patches {timed(vision):.2f} ms")
        print(f"{name}: text_forward_188_tokens {timed(text):.2f} ms")
        print(f"{name}: vision_and_text_forward {timed(whole):.2f} ms")


if __name__ == "__main__":
    main()
