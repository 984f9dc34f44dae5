#!/usr/bin/env python3
"""Generate tiny random Hugging Face checkpoints + reference outputs for dualedit tests.

Run from the repository root:

    .venv/bin/python scripts/make_fixtures.py

(Dependencies: scripts/requirements-fixtures.txt.)  Nothing is downloaded: the
tokenizers are trained locally on the fixed English text below and the model
weights are random, drawn from fixed seeds.  Output goes to tests/fixtures/<name>/:

    config.json, model.safetensors (or sharded model-0000x-of-0000y.safetensors +
    model.safetensors.index.json for llama), generation_config.json,
    tokenizer.json, reference.json

reference.json is plain JSON (see tests/fixtures/README.md for the schema).
Every float in it is a float32 value written with the shortest decimal that
round-trips *as float32*: parse it as f64 and cast to f32 to recover the exact
value that torch computed.

After writing, the script reloads every directory with
AutoModelForCausalLM.from_pretrained and tokenizers.Tokenizer.from_file and
checks that it reproduces the stored input_ids and logits bit-for-bit.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
from pathlib import Path

import numpy as np
import safetensors
import tokenizers
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers, Regex
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"

ATTN_IMPL = "eager"
DTYPE = torch.float32
VOCAB = 512

# Std-devs used to re-randomise every parameter (larger than HF defaults so that
# logits are spread out and tests are discriminative).
WEIGHT_STD = 0.2
BIAS_STD = 0.1
NORM_NOISE_STD = 0.1

# ---------------------------------------------------------------------------
# Fixed training corpus for the tokenizers (original text, written for this
# script).  Do not edit: changing it changes every fixture.
# ---------------------------------------------------------------------------
CORPUS = """\
The capital of France is Paris. The capital of Germany is Berlin. The capital
of Italy is Rome, and the capital of Spain is Madrid. Many people think that
the largest city of a country is always its capital, but that is not true.
The capital of Australia is Canberra, not Sydney, and the capital of Canada is
Ottawa, not Toronto.

A language model reads a sequence of tokens and predicts the next token. When
we edit the knowledge stored in a model, we want to change one fact without
breaking the other facts that the model already knows. For example, we might
want the model to say that the Eiffel Tower is located in Rome instead of Paris,
while it should still know that the Colosseum is in Rome and that the Louvre is
in Paris. A good editor changes the target fact, generalises to paraphrases of
the question, and leaves unrelated knowledge untouched.

The method trains a small network that transforms the gradient of the loss on
a single example into a low rank update of the weights. The gradient of a
linear layer is the outer product of the input activations and the gradient of
the output, so the network only needs to look at two short vectors for each
token. This makes the editor cheap to train and fast to apply, even for large
models with billions of parameters.

Once upon a time there was a little village near a quiet river. Every morning
the baker opened his shop and the smell of fresh bread filled the street. The
children walked to school along the water, and the old fisherman told them
stories about the sea, the wind and the stars. In the evening the sun went down
behind the hills and the lights of the houses came on one by one.

Water boils at one hundred degrees Celsius at sea level. The Earth goes around
the Sun once every year, and the Moon goes around the Earth about once every
month. Light travels faster than sound, which is why we see the lightning
before we hear the thunder. Plants use the energy of sunlight to turn water and
carbon dioxide into sugar and oxygen.

The quick brown fox jumps over the lazy dog. She sells sea shells by the sea
shore. How much wood would a woodchuck chuck if a woodchuck could chuck wood?
Peter Piper picked a peck of pickled peppers. A journey of a thousand miles
begins with a single step. Knowledge is power, and time is money.

Who wrote the novel? The novel was written by a famous author who lived in
London. What is the name of the river that flows through the city? The river is
called the Thames. Which team won the game last night? The home team won by
three points after a long and exciting match. Where was the president born? He
was born in a small town in the north of the country.

Numbers like 1, 2, 3, 10, 42, 100 and 2024 appear in text as well. So do
symbols such as commas, periods, question marks, quotes "like this", dashes -
and parentheses (like these). Good tokenizers handle all of them gracefully.
"""

# Three fixed sentences of different lengths (each 5..20 tokens for every
# tokenizer; checked below).
TEXTS = [
    "The capital of France is",
    "The capital of Italy is Rome, not Paris.",
    "The Eiffel Tower is located in the city of",
]

GRAD_TEXT_INDEX = 2

QWEN_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


# ---------------------------------------------------------------------------
# Tokenizers
# ---------------------------------------------------------------------------
def corpus_lines() -> list[str]:
    return [line for line in CORPUS.split("\n") if line.strip()]


def make_gpt2_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # Same as the real gpt2 tokenizer.json: only affects offsets, adds no tokens.
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        min_frequency=1,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_lines(), trainer=trainer)
    return tok


def make_qwen2_tokenizer() -> Tokenizer:
    # Qwen2-style byte-level BPE: NFC normaliser, regex Split, ByteLevel without
    # its own regex.
    tok = Tokenizer(models.BPE())
    tok.normalizer = tokenizers.normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        min_frequency=1,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_lines(), trainer=trainer)
    return tok


def make_llama_tokenizer() -> Tokenizer:
    # SentencePiece-style (LLaMA): Metaspace "▁" pre-tokenizer, <unk>=0, <s>=1,
    # </s>=2, "<s> $A" template.
    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        min_frequency=1,
        special_tokens=["<unk>", "<s>", "</s>"],
        show_progress=False,
    )
    tok.train_from_iterator(corpus_lines(), trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A",
        pair="<s> $A <s> $B",
        special_tokens=[("<s>", bos)],
    )
    return tok


# ---------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------
def is_norm_param(name: str) -> bool:
    leaf = name.split(".")[-2] if "." in name else name
    return leaf.startswith("ln_") or leaf.endswith("norm") or leaf == "norm"


@torch.no_grad()
def rerandomise(model: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter with fixed-seed noise (deterministic, independent
    of the HF init code).  named_parameters() de-duplicates tied weights."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        if is_norm_param(name):
            if name.endswith(".weight"):
                p.copy_(1.0 + NORM_NOISE_STD * noise)
            else:
                p.copy_(NORM_NOISE_STD * noise)
        elif name.endswith(".bias"):
            p.copy_(BIAS_STD * noise)
        else:
            p.copy_(WEIGHT_STD * noise)


def build_gpt2(tok: Tokenizer):
    eot = tok.token_to_id("<|endoftext|>")
    cfg = GPT2Config(
        vocab_size=VOCAB,
        n_embd=64,
        n_layer=3,
        n_head=4,
        n_positions=64,
        activation_function="gelu_new",
        initializer_range=WEIGHT_STD,
        tie_word_embeddings=True,
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
    )
    model = GPT2LMHeadModel._from_config(cfg, attn_implementation=ATTN_IMPL, dtype=DTYPE)
    return model, eot, "transformer.h.2.mlp.c_fc.weight"


def build_llama(tok: Tokenizer):
    bos = tok.token_to_id("<s>")
    eos = tok.token_to_id("</s>")
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_act="silu",
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        initializer_range=WEIGHT_STD,
        bos_token_id=bos,
        eos_token_id=eos,
    )
    model = LlamaForCausalLM._from_config(cfg, attn_implementation=ATTN_IMPL, dtype=DTYPE)
    # LLaMA has no pad token; pad the batch with </s> (logits there are ignored).
    return model, eos, "model.layers.2.mlp.down_proj.weight"


def build_qwen2(tok: Tokenizer):
    eot = tok.token_to_id("<|endoftext|>")
    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_act="silu",
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        use_sliding_window=False,
        initializer_range=WEIGHT_STD,
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
    )
    model = Qwen2ForCausalLM._from_config(cfg, attn_implementation=ATTN_IMPL, dtype=DTYPE)
    return model, eot, "model.layers.2.mlp.down_proj.weight"


SPECS = [
    # name, tokenizer builder, model builder, seed, shard size (None = single file)
    ("gpt2", make_gpt2_tokenizer, build_gpt2, 1001, None),
    ("llama", make_llama_tokenizer, build_llama, 1002, "200KB"),
    ("qwen2", make_qwen2_tokenizer, build_qwen2, 1003, None),
]


# ---------------------------------------------------------------------------
# Reference computation
# ---------------------------------------------------------------------------
def f32_list(t: torch.Tensor) -> list[float]:
    """Flatten (row-major) to Python floats carrying the shortest decimal that
    round-trips as float32 (keeps the JSON small and exact)."""
    a = t.detach().to(torch.float32).contiguous().reshape(-1).numpy()
    if not np.all(np.isfinite(a)):
        raise ValueError("non-finite value in reference tensor")
    # str(np.float32) is the shortest float32 round-trip repr, e.g. "0.12345679".
    return [float(str(x)) for x in a]


def forward_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids], dtype=torch.long))
    return out.logits[0].to(torch.float32)


def compute_reference(name, model, tok: Tokenizer, pad_id: int, grad_param: str) -> dict:
    model.eval()
    encs = [tok.encode(t).ids for t in TEXTS]  # add_special_tokens=True by default
    for t, ids in zip(TEXTS, encs):
        if not 5 <= len(ids) <= 20:
            raise SystemExit(f"{name}: text {t!r} has {len(ids)} tokens, want 5..20")

    logits, logprobs, mean_nlls = [], [], []
    for ids in encs:
        lg = forward_logits(model, ids)
        assert lg.shape == (len(ids), VOCAB)
        logits.append(lg)
        lp = torch.log_softmax(lg.double(), dim=-1)
        tgt = torch.tensor(ids[1:], dtype=torch.long)
        tok_lp = lp[:-1].gather(1, tgt[:, None])[:, 0]
        logprobs.append(f32_list(tok_lp.to(torch.float32)))
        mean_nlls.append(float(-tok_lp.mean().item()))

    # Batch: first two texts, right-padded with pad_id.
    b_ids = [encs[0], encs[1]]
    T = max(len(x) for x in b_ids)
    batch_ids = [x + [pad_id] * (T - len(x)) for x in b_ids]
    batch_mask = [[1] * len(x) + [0] * (T - len(x)) for x in b_ids]
    with torch.no_grad():
        b_logits = model(
            input_ids=torch.tensor(batch_ids, dtype=torch.long),
            attention_mask=torch.tensor(batch_mask, dtype=torch.long),
        ).logits.to(torch.float32)
    for i, ids in enumerate(b_ids):
        diff = (b_logits[i, : len(ids)] - logits[i]).abs().max().item()
        if diff > 1e-4:
            raise SystemExit(f"{name}: batched vs single logits differ by {diff}")

    # Gradient of HF's mean shifted NLL w.r.t. one MLP weight.
    params = dict(model.named_parameters())
    p = params[grad_param]
    model.zero_grad(set_to_none=True)
    ids = torch.tensor([encs[GRAD_TEXT_INDEX]], dtype=torch.long)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    g = p.grad.detach().clone()
    model.zero_grad(set_to_none=True)
    loss = float(str(np.float32(out.loss.item())))
    if abs(loss - mean_nlls[GRAD_TEXT_INDEX]) > 1e-4:
        raise SystemExit(f"{name}: HF loss {loss} vs logprob mean_nll {mean_nlls[GRAD_TEXT_INDEX]}")

    return {
        "model": name,
        "generator": {
            "script": "scripts/make_fixtures.py",
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
            "safetensors": safetensors.__version__,
        },
        "dtype": "float32",
        "attn_implementation": ATTN_IMPL,
        "vocab_size": VOCAB,
        "texts": TEXTS,
        "input_ids": encs,
        "logits": [f32_list(lg) for lg in logits],
        "batch": {
            "text_indices": [0, 1],
            "padding_side": "right",
            "pad_id": pad_id,
            "input_ids": batch_ids,
            "attention_mask": batch_mask,
            "shape": [2, T, VOCAB],
            "logits": f32_list(b_logits),
        },
        "grad": {
            "text_index": GRAD_TEXT_INDEX,
            "param": grad_param,
            "shape": list(g.shape),
            "mean_nll": loss,
            "values": f32_list(g),
        },
        "logprobs": logprobs,
        "mean_nll": mean_nlls,
    }


def patch_config_json(path: Path) -> None:
    """transformers>=5 writes rope settings only as "rope_parameters".  Hub
    checkpoints (Llama-2/3, Qwen2) carry a top-level "rope_theta"; add it too so
    loaders that expect the classic layout work.  (transformers reads both.)"""
    cfg = json.loads(path.read_text())
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict) and "rope_theta" in rp and "rope_theta" not in cfg:
        cfg["rope_theta"] = rp["rope_theta"]
        path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def dump_json(obj, path: Path) -> None:
    # Compact separators keep the files small; one top-level key per line is
    # not needed for machine reading.
    path.write_text(json.dumps(obj, separators=(",", ":"), allow_nan=False) + "\n")


def stored_keys(outdir: Path) -> list[str]:
    keys = []
    for f in sorted(outdir.glob("*.safetensors")):
        with safetensors.safe_open(str(f), framework="pt") as h:
            keys.extend(h.keys())
    return sorted(keys)


# ---------------------------------------------------------------------------
# Verification
# ---------------------------------------------------------------------------
def verify(name: str) -> None:
    outdir = FIXTURES / name
    ref = json.loads((outdir / "reference.json").read_text())
    tok = Tokenizer.from_file(str(outdir / "tokenizer.json"))
    for text, ids in zip(ref["texts"], ref["input_ids"]):
        got = tok.encode(text, add_special_tokens=True).ids
        if got != ids:
            raise SystemExit(f"{name}: tokenizer mismatch for {text!r}: {got} vs {ids}")
        dec = tok.decode(got, skip_special_tokens=True)
        if dec != text:
            raise SystemExit(f"{name}: decode round-trip {dec!r} != {text!r}")
    model = AutoModelForCausalLM.from_pretrained(
        str(outdir), dtype=DTYPE, attn_implementation=ref["attn_implementation"]
    )
    model.eval()
    for ids, flat in zip(ref["input_ids"], ref["logits"]):
        got = forward_logits(model, ids).reshape(-1).numpy()
        want = np.asarray(flat, dtype=np.float64).astype(np.float32)
        if not np.array_equal(got, want):
            raise SystemExit(
                f"{name}: reloaded logits differ, max abs {np.abs(got - want).max()}"
            )
    b = ref["batch"]
    with torch.no_grad():
        got = model(
            input_ids=torch.tensor(b["input_ids"]), attention_mask=torch.tensor(b["attention_mask"])
        ).logits.reshape(-1).numpy()
    want = np.asarray(b["logits"], dtype=np.float64).astype(np.float32)
    if not np.array_equal(got, want):
        raise SystemExit(f"{name}: reloaded batch logits differ, max abs {np.abs(got - want).max()}")
    g = ref["grad"]
    p = dict(model.named_parameters())[g["param"]]
    ids = torch.tensor([ref["input_ids"][g["text_index"]]])
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    got = p.grad.reshape(-1).numpy()
    want = np.asarray(g["values"], dtype=np.float64).astype(np.float32)
    if not np.array_equal(got, want):
        raise SystemExit(f"{name}: reloaded grad differs, max abs {np.abs(got - want).max()}")
    print(f"[verify] {name}: tokenizer ids, decode, logits, batch logits, grad reproduced exactly")


# ---------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--verify-only", action="store_true", help="only re-check existing fixtures")
    ap.add_argument("--print-keys", action="store_true", help="print state_dict / safetensors keys")
    args = ap.parse_args()

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)

    if not args.verify_only:
        for name, make_tok, build, seed, shard in SPECS:
            outdir = FIXTURES / name
            if outdir.exists():
                shutil.rmtree(outdir)
            outdir.mkdir(parents=True)

            tok = make_tok()
            if tok.get_vocab_size() != VOCAB:
                raise SystemExit(f"{name}: tokenizer vocab {tok.get_vocab_size()} != {VOCAB}")
            tok.save(str(outdir / "tokenizer.json"))

            torch.manual_seed(seed)
            model, pad_id, grad_param = build(tok)
            rerandomise(model, seed)
            model.eval()

            # transformers>=5 always writes safetensors (no safe_serialization flag).
            if shard is not None:
                model.save_pretrained(str(outdir), max_shard_size=shard)
            else:
                model.save_pretrained(str(outdir))
            patch_config_json(outdir / "config.json")

            ref = compute_reference(name, model, tok, pad_id, grad_param)
            dump_json(ref, outdir / "reference.json")

            print(f"== {name}: ids {ref['input_ids']}")
            print(f"   mean_nll {ref['mean_nll']}")
            lg = torch.tensor(ref["logits"][0])
            print(f"   logits[0] std {lg.std().item():.3f} min {lg.min().item():.3f} max {lg.max().item():.3f}")
            if args.print_keys:
                print(f"   state_dict keys: {list(model.state_dict().keys())}")
                print(f"   safetensors keys: {stored_keys(outdir)}")

    for name, *_ in SPECS:
        verify(name)

    total = 0
    for f in sorted(FIXTURES.rglob("*")):
        if f.is_file():
            total += f.stat().st_size
            print(f"{f.stat().st_size:>9}  {f.relative_to(ROOT)}")
    print(f"{total:>9}  total")


if __name__ == "__main__":
    main()
