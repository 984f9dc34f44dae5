#!/usr/bin/env python3
"""Tiny random Qwen2-VL / Qwen2.5-VL checkpoints, test images and reference outputs.

Run from the repository root (dependencies: scripts/requirements-fixtures.txt plus pillow):

    .venv/bin/python scripts/make_vl_fixtures.py

Writes

    tests/fixtures/vl_images/   PNG (RGB, RGBA, grayscale, palette) and JPEG images of odd
                                sizes and aspect ratios, pixels.safetensors (the processor's
                                pixel_values per image, float32) and reference.json (grids,
                                image-token counts, resized sizes)
    tests/fixtures/qwen2_vl/    Qwen2VLForConditionalGeneration with the config.json transformers 5
                                writes (nested: text_config, rope_parameters), tensor names as
                                its modules name them (model.language_model.* / model.visual.*),
                                untied head,
                                preprocessor_config.json in the `size` form
    tests/fixtures/qwen2_5_vl/  Qwen2_5_VLForConditionalGeneration rewritten into the released
                                checkpoints' layout: flat config.json (rope_theta,
                                rope_scaling {type: mrope}), tensor names model.layers.* /
                                visual.* / lm_head, tied head, preprocessor_config.json with
                                min_pixels / max_pixels; transformers reloads it and must
                                reproduce the references bit for bit

Each model directory's reference.json holds, per case (an image and a text, or a text
alone), the token ids as dualedit builds them (<|vision_start|> + one <|image_pad|> per
merged patch + <|vision_end|> + the text) and the log-probability of every token given
everything before it. Floats are float32 values written as the shortest decimal that
round-trips as float32.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_fixtures as mf  # noqa: E402  (tokenizer training, float formatting)

import tokenizers  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers, Regex  # noqa: E402
from transformers import (  # noqa: E402
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
)
try:  # transformers >= 5 (the PIL backend); scripts/make_vl_version_fixtures.py also runs on 4.x
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil  # noqa: E402
except ImportError:  # pragma: no cover
    Qwen2VLImageProcessorPil = None

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
IMAGES = FIXTURES / "vl_images"
VOCAB = 512
SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
MIN_PIXELS = 56 * 56
MAX_PIXELS = 28 * 28 * 16
TEXTS = [
    "The capital of France is Paris.",
    "The Eiffel Tower is located in the city of",
    "Water boils at one hundred degrees.",
]


def make_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.normalizer = tokenizers.normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(mf.QWEN_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        min_frequency=1,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(mf.corpus_lines(), trainer=trainer)
    return tok


def make_images() -> dict[str, Path]:
    """Deterministic images: smooth gradients plus noise, so resampling has work to do."""
    rng = np.random.default_rng(7)

    def field(h, w, c):
        y, x = np.mgrid[0:h, 0:w]
        base = np.stack([(x * 255 / max(w - 1, 1)), (y * 255 / max(h - 1, 1)), ((x + y) * 127 / max(h + w, 1))], -1)
        base = base[..., :c] if c <= 3 else np.concatenate([base, (x * 7 + y * 3)[..., None] % 256], -1)
        return np.clip(base + rng.normal(0, 40, base.shape), 0, 255).astype(np.uint8)

    out = {}
    IMAGES.mkdir(parents=True, exist_ok=True)
    out["rgb.png"] = Image.fromarray(field(40, 75, 3), "RGB")
    out["rgba.png"] = Image.fromarray(field(97, 33, 4), "RGBA")
    out["gray.png"] = Image.fromarray(field(50, 50, 3)[..., 0], "L")
    out["palette.png"] = Image.fromarray(field(45, 61, 3), "RGB").quantize(colors=37)
    out["photo.jpg"] = Image.fromarray(field(90, 120, 3), "RGB")
    out["big.png"] = Image.fromarray(field(300, 400, 3), "RGB")
    out["tall.jpg"] = Image.fromarray(field(150, 41, 3), "RGB")
    out.update(hostile_images(rng))
    paths = {}
    for name, im in out.items():
        p = IMAGES / name
        if isinstance(im, bytes):
            p.write_bytes(im)
        elif name.endswith(".jpg"):
            im.save(p, quality=90, **({"exif": im.info["exif"]} if "exif" in im.info else {}))
        else:
            im.save(p, **({"transparency": im.info["transparency"]} if "transparency" in im.info else {}))
        paths[name] = p
    return paths


def hostile_images(rng) -> dict:
    """What photos and odd files have and smooth test images do not: uniform noise and
    flat blocks (the bicubic overshoots and clips after each pass), saturated colours
    with hard edges, sizes whose resize runs the vertical pass first (Pillow 13: the
    height shrinks by more than twice as many pixels as the width), and every mode a PNG
    or JPEG opens as in Pillow: 1, L, LA, P with and without transparency, RGB with a
    colour key, RGBA, I;16, CMYK JPEG, a JPEG with an EXIF orientation, a JPEG named .png."""
    out = {}

    def noise(h, w, c=3):
        a = rng.integers(0, 256, (h, w, c), dtype=np.uint8)
        a[h // 5: h // 2, w // 6: w // 2] = [255, 0, 40, 255][:c]  # a flat saturated block
        return a

    out["noise_block.png"] = Image.fromarray(noise(60, 100), "RGB")        # up in width, down in height: vertical first
    out["noise_big.png"] = Image.fromarray(noise(118, 120), "RGB")        # down in both, vertical first
    out["noise_odd.png"] = Image.fromarray(noise(113, 57), "RGB")         # odd sizes, horizontal first
    sat = np.zeros((41, 97, 3), np.uint8)
    for i, col in enumerate([(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0), (0, 255, 255), (255, 0, 255), (255, 255, 255)]):
        sat[:, i * 14:(i + 1) * 14] = col
    sat[::2, ::3] = 0
    out["saturated.png"] = Image.fromarray(sat, "RGB")
    out["mode1.png"] = Image.fromarray(noise(45, 70, 1)[..., 0] > 127).convert("1")
    la = np.stack([noise(50, 38, 1)[..., 0], rng.integers(0, 256, (50, 38), dtype=np.uint8)], -1)
    out["la.png"] = Image.fromarray(la, "LA")
    pt = Image.fromarray(noise(39, 66), "RGB").quantize(colors=16)
    pt.info["transparency"] = 3
    out["palette_trns.png"] = pt
    key = noise(44, 52)
    key[5:20, 5:30] = [10, 20, 30]
    rk = Image.fromarray(key, "RGB")
    rk.info["transparency"] = (10, 20, 30)
    out["rgb_key.png"] = rk
    g16 = (rng.integers(0, 65536, (48, 64), dtype=np.uint32)).astype(np.uint16)
    g16[:, :20] = rng.integers(0, 256, (48, 20))  # below 256: grey levels in Pillow's conversion
    out["gray16.png"] = Image.fromarray(g16)  # uint16 → mode I;16
    out["rgba_noise.png"] = Image.fromarray(noise(70, 90, 4), "RGBA")
    out["cmyk.jpg"] = Image.fromarray(noise(50, 80, 4), "CMYK")
    ex = Image.fromarray(noise(40, 96), "RGB")
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90° CW to display; not applied by the processor
    ex.info["exif"] = exif.tobytes()
    out["exif_rotated.jpg"] = ex
    import io
    buf = io.BytesIO()
    Image.fromarray(noise(36, 52), "RGB").save(buf, format="JPEG", quality=90)
    out["jpeg_named.png"] = buf.getvalue()
    return out


# Pillow's bicubic resize alone, on noise (clipping in both passes), for sizes in either
# direction: (source height, width, target height, width). Which pass runs first in
# Pillow 13 is noted; the order matters bit for bit.
RESIZE_CASES = [
    (60, 100, 56, 112),   # height down, width up: vertical first
    (113, 57, 112, 56),   # both down by one pixel: horizontal first
    (90, 120, 56, 112),   # dy 34 > 2·dx 16: vertical first
    (90, 120, 70, 80),    # dy 20 < 2·dx 40: horizontal first
    (23, 17, 61, 45),     # up in both
    (41, 37, 5, 33),      # height far down: vertical first
    (37, 41, 33, 5),      # width far down: horizontal first
    (7, 120, 28, 28),     # wide strip: down in width, up in height
    (120, 3, 28, 28),     # tall strip: dy 92 > 2·dx (−50): vertical first
    (51, 49, 51, 23),     # width only
    (51, 49, 19, 49),     # height only
]


def resize_reference() -> None:
    """resize.safetensors: the noise sources and Pillow's bicubic results (uint8)."""
    rng = np.random.default_rng(11)
    tensors, cases = {}, []
    for i, (h, w, th, tw) in enumerate(RESIZE_CASES):
        src = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        src[h // 4: h // 2, w // 4: w // 2] = [255, 255, 0]
        out = np.array(Image.fromarray(src, "RGB").resize((tw, th), Image.Resampling.BICUBIC))
        tensors[f"src{i}"] = torch.from_numpy(src.copy())
        tensors[f"out{i}"] = torch.from_numpy(out.copy())
        cases.append([h, w, th, tw])
    save_file(tensors, str(IMAGES / "resize.safetensors"))
    mf.dump_json({"pillow": Image.__version__, "cases": cases}, IMAGES / "resize.json")


def processor() -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)


def image_reference(paths: dict[str, Path]) -> dict:
    proc = processor()
    pixels, meta = {}, {}
    for name, p in paths.items():
        im = Image.open(p)
        out = proc(images=[im], return_tensors="pt")
        pv, grid = out["pixel_values"], out["image_grid_thw"][0].tolist()
        pixels[name] = pv.to(torch.float32).contiguous()
        meta[name] = {
            "mode": im.mode,
            "format": im.format,
            "size": [im.height, im.width],
            "grid_thw": grid,
            "image_tokens": grid[0] * grid[1] * grid[2] // 4,
        }
    save_file(pixels, str(IMAGES / "pixels.safetensors"))
    ref = {"min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS, "images": meta}
    mf.dump_json(ref, IMAGES / "reference.json")
    return ref


def text_config(**extra):
    return dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
        **extra,
    )


def build(kind: str, tok: Tokenizer):
    ids = {s: tok.token_to_id(s) for s in SPECIAL}
    common = dict(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    eot = ids["<|endoftext|>"]
    if kind == "qwen2_vl":
        cfg = Qwen2VLConfig(
            text_config=text_config(bos_token_id=eot, eos_token_id=eot),
            vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2,
                               hidden_act="quick_gelu", patch_size=14, temporal_patch_size=2, spatial_merge_size=2),
            tie_word_embeddings=False,
            **common,
        )
        model = Qwen2VLForConditionalGeneration._from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    else:
        cfg = Qwen2_5_VLConfig(
            text_config=text_config(bos_token_id=eot, eos_token_id=eot),
            vision_config=dict(depth=4, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                               hidden_act="silu", patch_size=14, temporal_patch_size=2, spatial_merge_size=2,
                               window_size=56, fullatt_block_indexes=[1, 3]),
            tie_word_embeddings=True,
            **common,
        )
        model = Qwen2_5_VLForConditionalGeneration._from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    return model, ids


def sequence(ids: dict, tok: Tokenizer, text: str, n_image_tokens: list[int]) -> list[int]:
    out = []
    for n in n_image_tokens:
        out += [ids["<|vision_start|>"]] + [ids["<|image_pad|>"]] * n + [ids["<|vision_end|>"]]
    return out + tok.encode(text).ids


@torch.no_grad()
def logprobs(model, ids: dict, input_ids: list[int], pixels: list[torch.Tensor], grids: list[list[int]]) -> list[float]:
    t = torch.tensor([input_ids])
    kw = {}
    if pixels:
        kw = dict(
            pixel_values=torch.cat(pixels, 0),
            image_grid_thw=torch.tensor(grids),
            mm_token_type_ids=(t == ids["<|image_pad|>"]).to(torch.int32),
        )
    logits = model(input_ids=t, **kw).logits[0].double()
    lp = torch.log_softmax(logits, -1)[:-1].gather(1, t[0, 1:, None])[:, 0]
    return mf.f32_list(lp.to(torch.float32))


CASES = [
    # (images, text index)
    (["rgb.png"], 0),
    (["rgba.png"], 1),
    (["gray.png"], 2),
    (["palette.png"], 0),
    (["photo.jpg"], 1),
    (["big.png"], 2),
    (["tall.jpg"], 0),
    (["rgb.png", "gray.png"], 1),
    ([], 1),
    # Hostile images (noise, saturated edges, every Pillow mode): log-probs through the
    # whole pipeline, from the file, must agree as the smooth ones do.
    (["noise_block.png"], 0),
    (["noise_big.png"], 1),
    (["noise_odd.png"], 2),
    (["saturated.png"], 0),
    (["mode1.png"], 1),
    (["la.png"], 2),
    (["palette_trns.png"], 0),
    (["rgb_key.png"], 1),
    (["gray16.png"], 2),
    (["rgba_noise.png"], 0),
]


def compute_reference(name, model, ids, tok, img_ref) -> dict:
    pix = load_file(str(IMAGES / "pixels.safetensors"))
    cases = []
    for images, ti in CASES:
        grids = [img_ref["images"][i]["grid_thw"] for i in images]
        n_tok = [img_ref["images"][i]["image_tokens"] for i in images]
        input_ids = sequence(ids, tok, TEXTS[ti], n_tok)
        lp = logprobs(model, ids, input_ids, [pix[i] for i in images], grids)
        cases.append({"images": images, "text": TEXTS[ti], "input_ids": input_ids, "logprobs": lp})
    return {
        "model": name,
        "generator": {"script": "scripts/make_vl_fixtures.py", "torch": torch.__version__,
                      "transformers": __import__("transformers").__version__},
        "token_ids": {k: v for k, v in ids.items()},
        "cases": cases,
    }


def to_released_layout(outdir: Path) -> None:
    """Rewrites a transformers-5 save into the released checkpoints' layout."""
    cfg = json.loads((outdir / "config.json").read_text())
    text = cfg.pop("text_config")
    rope = dict(text.pop("rope_parameters"))
    flat = {k: v for k, v in cfg.items()}
    for k, v in text.items():
        if k not in ("model_type", "architectures", "dtype", "transformers_version", "layer_types"):
            flat.setdefault(k, v)
    flat["rope_theta"] = rope["rope_theta"]
    flat["rope_scaling"] = {"type": "mrope", "mrope_section": rope["mrope_section"]}
    vc = flat["vision_config"]
    vc.pop("rope_parameters", None)
    vc["in_chans"] = vc.pop("in_channels", 3)
    (outdir / "config.json").write_text(json.dumps(flat, indent=2, sort_keys=True) + "\n")
    st = load_file(str(outdir / "model.safetensors"))
    renamed = {}
    for k, v in st.items():
        if k.startswith("model.language_model."):
            k = "model." + k[len("model.language_model."):]
        elif k.startswith("model.visual."):
            k = "visual." + k[len("model.visual."):]
        renamed[k] = v.contiguous()
    save_file(renamed, str(outdir / "model.safetensors"), metadata={"format": "pt"})
    (outdir / "preprocessor_config.json").write_text(json.dumps({
        "min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS, "patch_size": 14, "temporal_patch_size": 2,
        "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711], "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2VLProcessor"}, indent=2) + "\n")


def to_new_names(outdir: Path) -> None:
    """transformers 5 saves the released names; rewrite them as its modules name them
    (model.language_model.*, model.visual.*), the layout of checkpoints saved by code that
    writes state_dict() keys as they are."""
    st = load_file(str(outdir / "model.safetensors"))
    renamed = {}
    for k, v in st.items():
        if k.startswith("model."):
            k = "model.language_model." + k[len("model."):]
        elif k.startswith("visual."):
            k = "model." + k
        renamed[k] = v.contiguous()
    save_file(renamed, str(outdir / "model.safetensors"), metadata={"format": "pt"})


def verify(name: str, cls, img_ref) -> None:
    outdir = FIXTURES / name
    ref = json.loads((outdir / "reference.json").read_text())
    model = cls.from_pretrained(str(outdir), dtype=torch.float32, attn_implementation="eager").eval()
    pix = load_file(str(IMAGES / "pixels.safetensors"))
    for case in ref["cases"]:
        grids = [img_ref["images"][i]["grid_thw"] for i in case["images"]]
        got = logprobs(model, ref["token_ids"], case["input_ids"], [pix[i] for i in case["images"]], grids)
        if got != case["logprobs"]:
            raise SystemExit(f"{name}: reloaded log-probs differ for {case['images']}")
    print(f"[verify] {name}: reloaded from disk, log-probs reproduced exactly")


def main() -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    tok = make_tokenizer()
    assert tok.get_vocab_size() == VOCAB
    paths = make_images()
    resize_reference()
    img_ref = image_reference(paths)
    for name, seed, cls in [("qwen2_vl", 2001, Qwen2VLForConditionalGeneration),
                            ("qwen2_5_vl", 2002, Qwen2_5_VLForConditionalGeneration)]:
        outdir = FIXTURES / name
        if outdir.exists():
            shutil.rmtree(outdir)
        outdir.mkdir(parents=True)
        tok.save(str(outdir / "tokenizer.json"))
        torch.manual_seed(seed)
        model, ids = build(name, tok)
        mf.rerandomise(model, seed)
        model.eval()
        model.save_pretrained(str(outdir))
        for extra in ("generation_config.json",):
            (outdir / extra).unlink(missing_ok=True)
        if name == "qwen2_vl":
            processor().save_pretrained(str(outdir))
            to_new_names(outdir)
        else:
            to_released_layout(outdir)
        ref = compute_reference(name, model, ids, tok, img_ref)
        mf.dump_json(ref, outdir / "reference.json")
        verify(name, cls, img_ref)
    total = sum(f.stat().st_size for d in (IMAGES, FIXTURES / "qwen2_vl", FIXTURES / "qwen2_5_vl") for f in d.iterdir())
    print(f"{total} bytes of VL fixtures")


if __name__ == "__main__":
    main()
