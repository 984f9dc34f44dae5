#!/usr/bin/env python3
"""Qwen2-VL / Qwen2.5-VL checkpoints as a given transformers version saves them.

A user's checkpoint is whatever their transformers wrote: a released checkpoint (flat
config.json with `in_chans`, `spatial_patch_size`, `rope_scaling {type: mrope}`) loaded and
saved again. This script does exactly that with the transformers on PYTHONPATH, one version
per run, each installed into its own --target folder (never into the shared venv):

    .venv/bin/pip install --no-deps --target /work/pyenv/tf-5.24.0 transformers==5.24.0
    PYTHONPATH=/work/pyenv/tf-5.24.0:/work/pyenv/common \\
        .venv/bin/python scripts/make_vl_version_fixtures.py

(/work/pyenv/common: pillow 13.0.0, numpy, safetensors, tokenizers, huggingface_hub; 4.x
also needs its own huggingface_hub < 1 and tokenizers < 0.23 first on the path, and
requests.) Writes tests/fixtures/vl_versions/<version>/<family>_<layout>/ for family
qwen2_vl and qwen2_5_vl and layout

    saved     config.json, weights and preprocessor_config.json exactly as this version's
              save_pretrained writes them, from the released-style config
    released  the released checkpoints' layout: the flat config.json the model was built
              from, tensor names model.layers.* / visual.* / lm_head

each with tokenizer.json and reference.json: per case (an image file from
tests/fixtures/vl_images and a text, or a text alone) the token ids and the
log-probabilities this version computes, with this version's image processor (the PIL
one) giving the pixel values. The two layouts must load in this transformers and give the
same log-probabilities bit for bit (checked). Models are tiny (hidden 32) to keep the files
small and stored in bf16 (as released checkpoints are); weights are re-drawn from fixed
seeds, so every version gets the same weights.
"""

from __future__ import annotations

import inspect
import json
import shutil
import sys
from pathlib import Path

import torch
import transformers
from PIL import Image
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_fixtures as mf  # noqa: E402
import make_vl_fixtures as vlf  # noqa: E402

from transformers import (  # noqa: E402
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
)

VERSION = transformers.__version__
OUT = vlf.FIXTURES / "vl_versions" / VERSION
MAJOR = int(VERSION.split(".")[0])

# Hostile and plain PNGs (log-probs from the file must agree ≤ 1e-4) and text alone.
CASES = [(["noise_block.png"], 0), (["rgba.png"], 1), (["gray16.png"], 2), ([], 1)]


def image_processor():
    if MAJOR >= 5:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
        return Qwen2VLImageProcessorPil(min_pixels=vlf.MIN_PIXELS, max_pixels=vlf.MAX_PIXELS)
    from transformers import Qwen2VLImageProcessor
    return Qwen2VLImageProcessor(min_pixels=vlf.MIN_PIXELS, max_pixels=vlf.MAX_PIXELS)


def released_config(kind: str, ids: dict) -> dict:
    """config.json in the layout of the released Qwen2-VL / Qwen2.5-VL checkpoints."""
    eot = ids["<|endoftext|>"]
    text = dict(
        vocab_size=vlf.VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, hidden_act="silu", rms_norm_eps=1e-6, max_position_embeddings=256,
        rope_theta=1000000.0, rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]},
        use_sliding_window=False, sliding_window=256, max_window_layers=2, attention_dropout=0.0,
        bos_token_id=eot, eos_token_id=eot, image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        vision_token_id=7, torch_dtype="bfloat16", use_cache=True,
    )
    if kind == "qwen2_vl":
        return dict(
            architectures=["Qwen2VLForConditionalGeneration"], model_type="qwen2_vl", tie_word_embeddings=False, **text,
            vision_config=dict(depth=2, embed_dim=16, mlp_ratio=2, num_heads=2, in_chans=3, hidden_size=32,
                               hidden_act="quick_gelu", patch_size=14, spatial_merge_size=2, spatial_patch_size=14,
                               temporal_patch_size=2),
        )
    return dict(
        architectures=["Qwen2_5_VLForConditionalGeneration"], model_type="qwen2_5_vl", tie_word_embeddings=True, **text,
        vision_config=dict(depth=2, hidden_act="silu", hidden_size=16, intermediate_size=24, num_heads=2, in_chans=3,
                           out_hidden_size=32, patch_size=14, spatial_merge_size=2, spatial_patch_size=14,
                           window_size=56, fullatt_block_indexes=[1], tokens_per_second=2, temporal_patch_size=2),
    )


def build(kind: str, flat: dict):
    cfg_cls, cls = {
        "qwen2_vl": (Qwen2VLConfig, Qwen2VLForConditionalGeneration),
        "qwen2_5_vl": (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration),
    }[kind]
    cfg = cfg_cls.from_dict({k: v for k, v in flat.items() if k != "architectures"})
    cfg.architectures = flat["architectures"]
    model = cls._from_config(cfg, attn_implementation="eager", torch_dtype=torch.float32)
    return model, cls


@torch.no_grad()
def logprobs(model, ids: dict, input_ids: list[int], pixels: list[torch.Tensor], grids: list[list[int]]) -> list[float]:
    t = torch.tensor([input_ids])
    kw = {}
    if pixels:
        kw = dict(pixel_values=torch.cat(pixels, 0), image_grid_thw=torch.tensor(grids))
        if "mm_token_type_ids" in inspect.signature(model.forward).parameters:
            kw["mm_token_type_ids"] = (t == ids["<|image_pad|>"]).to(torch.int32)
    logits = model(input_ids=t, **kw).logits[0].double()
    lp = torch.log_softmax(logits, -1)[:-1].gather(1, t[0, 1:, None])[:, 0]
    return mf.f32_list(lp.to(torch.float32))


def released_names(path: Path) -> None:
    st = load_file(str(path))
    out = {}
    for k, v in st.items():
        if k.startswith("model.language_model."):
            k = "model." + k[len("model.language_model."):]
        elif k.startswith("model.visual."):
            k = "visual." + k[len("model.visual."):]
        out[k] = v.contiguous()
    save_file(out, str(path), metadata={"format": "pt"})


def main() -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    tok = vlf.make_tokenizer()
    ids = {s: tok.token_to_id(s) for s in vlf.SPECIAL}
    proc = image_processor()
    pix, grids = {}, {}
    for images, _ in CASES:
        for name in images:
            out = proc(images=[Image.open(vlf.IMAGES / name)], return_tensors="pt")
            pix[name] = out["pixel_values"].to(torch.float32)
            grids[name] = out["image_grid_thw"][0].tolist()
    if OUT.exists():
        shutil.rmtree(OUT)
    for kind, seed in [("qwen2_vl", 3101), ("qwen2_5_vl", 3102)]:
        flat = released_config(kind, ids)
        torch.manual_seed(seed)
        model, cls = build(kind, flat)
        mf.rerandomise(model, seed)
        # Values a bf16 checkpoint can hold (released checkpoints are bf16): the files are
        # saved in bf16, and float32 loads reproduce the float32 references exactly.
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16).to(torch.float32)
        model.eval()
        cases = []
        for images, ti in CASES:
            n_tok = [grids[i][0] * grids[i][1] * grids[i][2] // 4 for i in images]
            input_ids = vlf.sequence(ids, tok, vlf.TEXTS[ti], n_tok)
            lp = logprobs(model, ids, input_ids, [pix[i] for i in images], [grids[i] for i in images])
            cases.append({"images": images, "grids": [grids[i] for i in images], "text": vlf.TEXTS[ti],
                          "input_ids": input_ids, "logprobs": lp})
        ref = {"model": kind, "generator": {"script": "scripts/make_vl_version_fixtures.py", "torch": torch.__version__,
                                            "transformers": VERSION, "pillow": Image.__version__},
               "token_ids": ids, "cases": cases}
        for layout in ("saved", "released"):
            d = OUT / f"{kind}_{layout}"
            d.mkdir(parents=True)
            tok.save(str(d / "tokenizer.json"))
            model.to(torch.bfloat16).save_pretrained(str(d))
            model.to(torch.float32)
            (d / "generation_config.json").unlink(missing_ok=True)
            proc.save_pretrained(str(d))
            if layout == "released":
                (d / "config.json").write_text(json.dumps(flat, indent=2, sort_keys=True) + "\n")
                released_names(d / "model.safetensors")
            mf.dump_json(ref, d / "reference.json")
            # Both layouts load in this version and reproduce the references exactly.
            m2 = cls.from_pretrained(str(d), attn_implementation="eager", torch_dtype=torch.float32).eval()
            for c in cases:
                got = logprobs(m2, ids, c["input_ids"], [pix[i] for i in c["images"]], c["grids"])
                if got != c["logprobs"]:
                    raise SystemExit(f"{d}: reloaded log-probs differ for {c['images']}")
            print(f"[verify] {d.relative_to(vlf.ROOT)}: reloaded by transformers {VERSION}, log-probs reproduced")
    total = sum(f.stat().st_size for f in OUT.rglob("*") if f.is_file())
    print(f"{total} bytes in {OUT.relative_to(vlf.ROOT)}")


if __name__ == "__main__":
    main()
