"""Tiny GGUF files and what transformers makes of them: the fixtures of `dualedit convert`.

For llama (SmolLM-style), qwen2 and gpt2 this draws a tiny random checkpoint from a fixed
seed, writes it as a GGUF the way llama.cpp's converter lays it out (its tensor names, the
rotary row permutation of llama's q/k, GPT-2's transposed Conv1D weights, no `output.weight`
when the head is tied), every tensor in one of the types `dualedit convert` reads (F32,
F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 quantised by gguf-py; Q4_K, Q5_K, Q6_K as random
but valid raw blocks, since gguf-py cannot quantise to them), with a tokenizer section (the
byte-level BPE vocabularies of the tiny HF fixtures in tests/fixtures/{gpt2,qwen2}, their
merges, control tokens, special ids, a chat template), and one more llama, `llama-spm`,
with a SentencePiece vocabulary (tokens and scores, no merges). Then it loads each file with
transformers (`from_pretrained(dir, gguf_file=...)`, `AutoTokenizer.from_pretrained(dir,
gguf_file=...)`) and stores what it gives: `expected.safetensors` (the state dict, f32),
`expected.json` (config, token ids of a few texts, the chat template rendered, next-token
log-probabilities of a text). Nothing is downloaded.

    PYTHONPATH=<gguf + transformers 5.23 + accelerate> .venv/bin/python scripts/make_gguf_fixtures.py
"""

import json
import os
import sys

import numpy as np
import torch

import gguf
from gguf import GGMLQuantizationType as Q
from safetensors.torch import save_file

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
OUT = os.path.join(ROOT, "tests", "fixtures", "gguf")

TEXTS = [
    "The capital of France is",
    "The mother tongue of Danielle Darrieux is",
    "In 1999, 3.14159 * 42 = 131.95 (approx.)",
    "Ünïcödé — 日本語 🙂 naïve café\n\ttabs  and   spaces",
    "<|im_start|>user\nHi<|im_end|>",
]
SCORE = "The capital of France is Paris"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]

SMOL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def hf_tokenizer(name):
    """Vocabulary (by id), merges and added tokens of a tiny fixture's tokenizer.json."""
    t = json.load(open(os.path.join(ROOT, "tests", "fixtures", name, "tokenizer.json")))
    vocab = sorted(t["model"]["vocab"].items(), key=lambda kv: kv[1])
    tokens = [tok for tok, _ in vocab]
    merges = [m if isinstance(m, str) else " ".join(m) for m in t["model"]["merges"]]
    added = {a["id"]: a["content"] for a in t["added_tokens"]}
    for i, c in added.items():
        if i < len(tokens):
            tokens[i] = c
        else:
            assert i == len(tokens)
            tokens.append(c)
    types = [3 if i in added else 1 for i in range(len(tokens))]
    return tokens, merges, types


def raw_k_blocks(rng, qtype, rows, cols):
    """Random K-quant blocks whose f16 scales are small, finite and positive."""
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    n = rows * cols // block_elems
    b = rng.integers(0, 256, size=(n, block_bytes), dtype=np.uint8)
    scale = lambda: rng.uniform(0.0005, 0.004, size=n).astype(np.float16).view(np.uint8).reshape(n, 2)
    if qtype in (Q.Q4_K, Q.Q5_K):
        b[:, 0:2] = scale()  # d
        b[:, 2:4] = scale()  # dmin
    else:  # Q6_K: d is last, the 16 int8 scales before it
        b[:, 208:210] = scale()
    return b.reshape(rows, cols // block_elems * block_bytes)


def add(w, rng, name, t, qtype):
    """`t` (torch shape) stored as `qtype`."""
    a = t.detach().float().numpy().astype(np.float32)
    if qtype == Q.F32:
        w.add_tensor(name, a)
    elif qtype == Q.F16:
        w.add_tensor(name, a.astype(np.float16))
    elif qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        rows, cols = a.shape
        w.add_tensor(name, raw_k_blocks(rng, qtype, rows, cols), raw_dtype=qtype)
    else:
        w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)


def permute(w, n_head):
    """llama.cpp's `LlamaModel.permute` of q / k rows (undone by the importer)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tokenizer_section(w, tokens, merges, types, pre, bos, eos, unk, pad, template, add_bos=None):
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    if unk is not None:
        w.add_unk_token_id(unk)
    if pad is not None:
        w.add_pad_token_id(pad)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if template is not None:
        w.add_chat_template(template)


def llama_like(kind, seed):
    """A llama (SmolLM-style, untied) or qwen2 (tied, q/k/v biases) GGUF."""
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    # Both use the qwen2 fixture's byte-level BPE (its <|endoftext|>, <|im_start|>, <|im_end|>).
    tokens, merges, types = hf_tokenizer("qwen2")
    V, D, I, H, KV, L = len(tokens), 64, 256, 4, 2, 3 if kind == "llama" else 2
    hd = D // H
    w = gguf.GGUFWriter(os.path.join(OUT, f"{kind}.gguf"), kind)
    w.add_name(f"tiny-{kind}")
    w.add_block_count(L)
    w.add_context_length(128)
    w.add_embedding_length(D)
    w.add_feed_forward_length(I)
    w.add_head_count(H)
    w.add_head_count_kv(KV)
    w.add_layer_norm_rms_eps(1e-5 if kind == "llama" else 1e-6)
    w.add_rope_freq_base(10000.0 if kind == "llama" else 1000000.0)
    if kind == "llama":
        w.add_rope_dimension_count(hd)
        w.add_vocab_size(V)
    w.add_file_type(1)
    if kind == "llama":
        tokenizer_section(w, tokens, merges, types, "smollm", 1, 2, 0, 2, SMOL_TEMPLATE, add_bos=False)
    else:
        tokenizer_section(w, tokens, merges, types, "qwen2", 0, 2, None, 0, SMOL_TEMPLATE)
    n = lambda *s: torch.randn(*s) * 0.2
    add(w, rng, "token_embd.weight", n(V, D), Q.Q8_0 if kind == "llama" else Q.F16)
    plans = {
        "llama": [
            (Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q4_K),
            (Q.Q5_1, Q.Q8_0, Q.Q4_0, Q.F16, Q.Q8_0, Q.Q4_1, Q.Q5_K),
            (Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.BF16, Q.F32, Q.Q8_0, Q.Q6_K),
        ],
        "qwen2": [
            (Q.Q8_0, Q.Q5_1, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.BF16, Q.Q6_K),
            (Q.Q4_0, Q.Q8_0, Q.F16, Q.Q5_1, Q.Q4_1, Q.Q5_0, Q.Q4_K),
        ],
    }[kind]
    for i, (tq, tk, tv, to, tg, tu, td) in enumerate(plans):
        p = f"blk.{i}."
        add(w, rng, p + "attn_norm.weight", 1 + 0.1 * torch.randn(D), Q.F32)
        q, k = n(H * hd, D), n(KV * hd, D)
        if kind == "llama":
            q, k = permute(q, H), permute(k, KV)
        add(w, rng, p + "attn_q.weight", q, tq)
        add(w, rng, p + "attn_k.weight", k, tk)
        add(w, rng, p + "attn_v.weight", n(KV * hd, D), tv)
        if kind == "qwen2":
            for leaf, size in (("attn_q", H * hd), ("attn_k", KV * hd), ("attn_v", KV * hd)):
                add(w, rng, p + leaf + ".bias", 0.1 * torch.randn(size), Q.F32)
        add(w, rng, p + "attn_output.weight", n(D, H * hd), to)
        add(w, rng, p + "ffn_norm.weight", 1 + 0.1 * torch.randn(D), Q.F32)
        add(w, rng, p + "ffn_gate.weight", n(I, D), tg)
        add(w, rng, p + "ffn_up.weight", n(I, D), tu)
        add(w, rng, p + "ffn_down.weight", n(D, I), td)
    add(w, rng, "output_norm.weight", 1 + 0.1 * torch.randn(D), Q.F32)
    if kind == "llama":
        add(w, rng, "output.weight", n(V, D), Q.Q5_0)
    finish(w)


def gpt2(seed):
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    tokens, merges, types = hf_tokenizer("gpt2")
    V, D, H, L, P = len(tokens), 64, 4, 2, 1024
    w = gguf.GGUFWriter(os.path.join(OUT, "gpt2.gguf"), "gpt2")
    w.add_name("tiny-gpt2")
    w.add_block_count(L)
    w.add_context_length(P)
    w.add_embedding_length(D)
    w.add_feed_forward_length(4 * D)
    w.add_head_count(H)
    w.add_layer_norm_eps(1e-5)
    w.add_file_type(1)
    eot = tokens.index("<|endoftext|>")
    tokenizer_section(w, tokens, merges, types, "gpt-2", eot, eot, None, None, None)
    n = lambda *s: torch.randn(*s) * 0.2
    add(w, rng, "token_embd.weight", n(V, D), Q.Q8_0)
    add(w, rng, "position_embd.weight", n(P, D), Q.F16)
    plans = [(Q.Q4_1, Q.Q5_0, Q.Q8_0, Q.Q6_K), (Q.BF16, Q.Q4_0, Q.Q5_1, Q.Q5_K)]
    for i, (tqkv, to, tup, tdown) in enumerate(plans):
        p = f"blk.{i}."
        add(w, rng, p + "attn_norm.weight", 1 + 0.1 * torch.randn(D), Q.F32)
        add(w, rng, p + "attn_norm.bias", 0.1 * torch.randn(D), Q.F32)
        # llama.cpp stores the Conv1D weights transposed: [out, in] in torch order.
        add(w, rng, p + "attn_qkv.weight", n(3 * D, D), tqkv)
        add(w, rng, p + "attn_qkv.bias", 0.1 * torch.randn(3 * D), Q.F32)
        add(w, rng, p + "attn_output.weight", n(D, D), to)
        add(w, rng, p + "attn_output.bias", 0.1 * torch.randn(D), Q.F32)
        add(w, rng, p + "ffn_norm.weight", 1 + 0.1 * torch.randn(D), Q.F32)
        add(w, rng, p + "ffn_norm.bias", 0.1 * torch.randn(D), Q.F32)
        add(w, rng, p + "ffn_up.weight", n(4 * D, D), tup)
        add(w, rng, p + "ffn_up.bias", 0.1 * torch.randn(4 * D), Q.F32)
        add(w, rng, p + "ffn_down.weight", n(D, 4 * D), tdown)
        add(w, rng, p + "ffn_down.bias", 0.1 * torch.randn(D), Q.F32)
    add(w, rng, "output_norm.weight", 1 + 0.1 * torch.randn(D), Q.F32)
    add(w, rng, "output_norm.bias", 0.1 * torch.randn(D), Q.F32)
    finish(w)


def llama_spm(seed):
    """A one-layer llama whose vocabulary is SentencePiece-style (`tokenizer.ggml.model =
    "llama"`, the tiny llama fixture's tokens with scores, no merges: transformers derives
    them from the scores, as for llama.cpp's LLaMA-2 files)."""
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    t = json.load(open(os.path.join(ROOT, "tests", "fixtures", "llama", "tokenizer.json")))
    tokens = [tok for tok, _ in sorted(t["model"]["vocab"].items(), key=lambda kv: kv[1])]
    types = [2 if i == 0 else 3 if i in (1, 2) else 1 for i in range(len(tokens))]
    scores = [0.0 if i < 3 else -float(i) for i in range(len(tokens))]
    V, D, I, H, KV = len(tokens), 64, 128, 4, 4
    w = gguf.GGUFWriter(os.path.join(OUT, "llama-spm.gguf"), "llama")
    w.add_name("tiny-llama-spm")
    w.add_block_count(1)
    w.add_context_length(256)
    w.add_embedding_length(D)
    w.add_feed_forward_length(I)
    w.add_head_count(H)
    w.add_head_count_kv(KV)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(D // H)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    n = lambda *s: torch.randn(*s) * 0.2
    add(w, rng, "token_embd.weight", n(V, D), Q.F16)
    p = "blk.0."
    add(w, rng, p + "attn_norm.weight", 1 + 0.1 * torch.randn(D), Q.F32)
    add(w, rng, p + "attn_q.weight", permute(n(D, D), H), Q.Q8_0)
    add(w, rng, p + "attn_k.weight", permute(n(D, D), KV), Q.F16)
    add(w, rng, p + "attn_v.weight", n(D, D), Q.F16)
    add(w, rng, p + "attn_output.weight", n(D, D), Q.F16)
    add(w, rng, p + "ffn_norm.weight", 1 + 0.1 * torch.randn(D), Q.F32)
    add(w, rng, p + "ffn_gate.weight", n(I, D), Q.F16)
    add(w, rng, p + "ffn_up.weight", n(I, D), Q.F16)
    add(w, rng, p + "ffn_down.weight", n(D, I), Q.F16)
    add(w, rng, "output_norm.weight", 1 + 0.1 * torch.randn(D), Q.F32)
    finish(w)


def finish(w):
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def expected(kind):
    """What transformers gives for `{kind}.gguf`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    f = f"{kind}.gguf"
    model = AutoModelForCausalLM.from_pretrained(OUT, gguf_file=f)
    tok = AutoTokenizer.from_pretrained(OUT, gguf_file=f)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, os.path.join(OUT, f"{kind}.expected.safetensors"))
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    ids = tok(SCORE, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logp = model(ids).logits.log_softmax(-1)[0]
    lp = logp[:-1].gather(-1, ids[0, 1:, None])[:, 0]
    out = {
        "config": {k: v for k, v in config.items() if not k.startswith("_")},
        "dtype": str(model.dtype),
        "ids": {t: tok(t)["input_ids"] for t in TEXTS},
        "score": {"text": SCORE, "ids": ids[0].tolist(), "logprobs": lp.tolist()},
    }
    if tok.chat_template:
        rendered = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
        out["chat"] = {"text": rendered, "ids": tok(rendered)["input_ids"]}
    json.dump(out, open(os.path.join(OUT, f"{kind}.expected.json"), "w"), indent=1, ensure_ascii=False, default=str)
    print(kind, model.dtype, {k: tuple(v.shape) for k, v in list(state.items())[:3]}, "...", len(state), "tensors")


def main():
    torch.set_num_threads(1)
    os.makedirs(OUT, exist_ok=True)
    llama_like("llama", 1)
    llama_like("qwen2", 2)
    gpt2(3)
    llama_spm(4)
    for kind in ("llama", "qwen2", "gpt2", "llama-spm"):
        expected(kind)


if __name__ == "__main__":
    sys.exit(main())
