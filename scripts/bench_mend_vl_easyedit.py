#!/usr/bin/env python3
"""PyTorch side of benches/mend_vl.rs: one meta-training micro-batch, the optimiser step
and one edit of MEND on a small Qwen2-VL, computed as EasyEdit's MultimodalTrainer
(`edit_step` / `train_step`) and MEND (`models/mend/mend.py`: hooks, GradientTransform,
IDMLP of LRLinear layers) compute them, with the same sizes as the Rust bench:

- model: benches/vl_configs/qwen2_vl.json (text 4 x 512, vocabulary 4096; vision tower
  4 x 256), random f32 weights, sdpa attention, transformers' Qwen2VLForConditionalGeneration;
- three distinct images of 224 x 224 pixels (grid 1 x 16 x 16: 256 patches, 64 image
  tokens), given as random pixel values (EasyEdit's dataset preprocesses images in its
  collate, outside the timed step);
- image views: <|vision_start|> + 64 pads + <|vision_end|> + 13 question + 3 answer tokens;
  `loc`: 13 + 3 tokens (the same ids as the Rust bench); batch 1;
- MEND: the up/down projections of blocks 1-3, one shared editor per weight shape
  (combine mode: norm of x and delta with running mean/std, one IDMLP over cat(x, delta)
  of n_hidden + 1 = 2 LRLinear layers of rank 1920 with per-weight scale/shift, the
  pseudo-gradient delta^T x, W' = W - lr * g), Adam (lr 1e-6) over the editor and Adam
  (lr_lr 1e-4) over the edit learning rates, gradient clipping at 100, accumulate 10.

Per micro-batch, as MultimodalTrainer.edit_step with training=True: the unedited model
on `loc` and `loc_image` (no grad); MEND.edit on `edit_inner` (forward with hooks that keep
each edited linear's input x and output gradient delta, NLL, backward, the editor with the
per-row running-statistics update of GradientTransform, W'); the edited model (through
torch.func.functional_call, as higher's monkeypatch) on edit_outer, edit_outer_image,
edit_inner, loc and loc_image with grad; the losses (NLL of the two edit views, KL of the
two locality views over every position, the accuracy metrics without grad); the weighted
loss / accumulate backward into the editor. Every model call runs the vision tower on its
image, as EasyEdit's do. `edit`: MEND.edit alone in evaluation mode (capture, editor, W').

    .venv/bin/python scripts/bench_mend_vl_easyedit.py [--model small|tiny] [--side 448]
        [--dtype f32|bf16] [--runs 10] [--warmup 3]

The options are the Rust bench's DUALEDIT_BENCH_MODEL / _SIDE / _DTYPE / _RUNS / _WARMUP
(`tiny`: benches/vl_configs/qwen2_vl_tiny.json; images of side x side pixels, (side/14)^2
patches, (side/28)^2 image tokens; bf16: the model's weights, the editor stays f32 and
each W' is rounded to the weight's dtype, as a bf16 model needs). Prints the median of
the timed runs after the warm-up runs, on one thread (as the Rust bench).
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn as nn
from torch.func import functional_call
from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

ROOT = Path(__file__).resolve().parent.parent
QUESTION, ANSWER = 13, 3
# Set from --side in main(): image tokens per image and the patch grid.
IMAGE_TOKENS, GRID = 64, [1, 16, 16]
RANK, N_HIDDEN = 1920, 1
LR, LR_LR, EDIT_LR, GRAD_CLIP, ACCUMULATE = 1e-6, 1e-4, 1e-4, 100.0, 10
C_EDIT, C_LOC, I_EDIT = 0.1, 1.0, 0.1
# The last three blocks' MLP projections (set in main from the config: blocks 1-3 of the
# 4-block small and tiny models), as EasyEdit's Qwen2-VL-7B preset (25-27 of 28).
EDITED = []


def timed(name, fn, warmup, runs):
    """Median wall-clock and CPU time (this thread's: with one torch thread every op and
    the backward run on it, so other processes holding the core do not count) of `runs`
    runs after `warmup`."""
    for _ in range(warmup):
        fn()
    times, cpu = [], []
    for _ in range(runs):
        t0, c0 = time.perf_counter(), time.thread_time()
        fn()
        times.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
    med = statistics.median(times) * 1e3
    print(
        f"{name:<18} median {med:8.1f} ms  (min {min(times) * 1e3:.1f}, max {max(times) * 1e3:.1f})"
        f"  cpu median {statistics.median(cpu) * 1e3:8.1f} ms"
    )
    return med


class LRLinear(nn.Module):
    """EasyEdit's LRLinear: u (v x^T) + bias after a per-mode scale and shift, relu on
    hidden layers, identity skip."""

    def __init__(self, dim, rank, relu, n_modes):
        super().__init__()
        self.u = nn.Parameter(torch.zeros(dim, rank))
        self.v = nn.Parameter(torch.randn(rank, dim) / dim**0.5)
        self.bias = nn.Parameter(torch.zeros(dim))
        self.mode_scale = nn.Embedding(n_modes, dim)
        self.mode_scale.weight.data.fill_(1)
        self.mode_shift = nn.Embedding(n_modes, dim)
        self.mode_shift.weight.data.zero_()
        self.relu = relu

    def forward(self, x, mode):
        x = x * self.mode_scale(mode) + self.mode_shift(mode)
        pre = (self.u @ (self.v @ x.T)).T + self.bias
        return (pre.clamp(min=0) if self.relu else pre) + x


class GradientTransform(nn.Module):
    """EasyEdit's GradientTransform in combine mode with norm: rows with no signal
    dropped, running mean/variance updated row by row in training, normalised x and delta
    through one IDMLP, split back."""

    def __init__(self, x_dim, delta_dim, n_modes):
        super().__init__()
        self.x_dim, self.delta_dim = x_dim, delta_dim
        w = x_dim + delta_dim
        self.mlp = nn.ModuleList([LRLinear(w, min(RANK, w), i < N_HIDDEN, n_modes) for i in range(N_HIDDEN + 1)])
        for n, d in (("u", x_dim), ("v", delta_dim)):
            self.register_buffer(f"{n}_mean", torch.zeros(d))
            self.register_buffer(f"{n}_s", torch.zeros(d))
        self.register_buffer("k", torch.zeros(1))
        self.norm_init = False

    def forward(self, u, v, mode):
        u_, v_ = u.reshape(-1, u.shape[-1]).float(), v.reshape(-1, v.shape[-1]).float()
        nz = (u_ != 0).any(-1) * (v_ != 0).any(-1)
        u_, v_ = u_[nz], v_[nz]
        if self.training:
            for idx in range(u_.shape[0]):
                if not self.norm_init:
                    self.u_mean = u_[idx].clone().detach()
                    self.v_mean = v_[idx].clone().detach()
                    self.u_s.zero_()
                    self.v_s.zero_()
                    self.k[:] = 1
                    self.norm_init = True
                else:
                    self.k += 1
                    u_mean_, v_mean_ = self.u_mean.clone().detach(), self.v_mean.clone().detach()
                    self.u_mean += (u_[idx] - u_mean_) / self.k
                    self.v_mean += (v_[idx] - v_mean_) / self.k
                    self.u_s += (u_[idx] - u_mean_) * (u_[idx] - self.u_mean)
                    self.v_s += (v_[idx] - v_mean_) * (v_[idx] - self.v_mean)
        u_std = (self.u_s / (self.k - 1)) ** 0.5
        v_std = (self.v_s / (self.k - 1)) ** 0.5
        x = torch.cat(((u_ - self.u_mean) / (u_std + 1e-7), (v_ - self.v_mean) / (v_std + 1e-7)), -1)
        m = torch.tensor(mode)
        for layer in self.mlp:
            x = layer(x, m)
        return x.split([self.x_dim, self.delta_dim], -1)


class Mend(nn.Module):
    """MEND.edit: capture with hooks, the shared editors, W' = W - lr * delta'^T x'."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.modules_ = {n: model.get_submodule(n) for n in EDITED}
        shapes = {}
        for n, m in self.modules_.items():
            shapes.setdefault(tuple(m.weight.shape), []).append(n)
        self.shape_dict = shapes
        self.mend = nn.ModuleDict(
            {str(s): GradientTransform(s[1], s[0], len(names)) for s, names in shapes.items()}
        )
        self.edit_lrs = nn.ParameterList([nn.Parameter(torch.tensor(EDIT_LR)) for _ in EDITED])
        self.store = {}
        for n, m in self.modules_.items():
            m.register_forward_hook(self._hook(n))

    def _hook(self, name):
        def fwd(mod, inputs, output):
            if not torch.is_grad_enabled() or not self.capturing:
                return
            self.store[name] = [inputs[0].detach(), None]
            output.register_hook(lambda g: self.store[name].__setitem__(1, g.detach()))

        return fwd

    capturing = False

    def edit(self, batch):
        self.capturing = True
        with torch.enable_grad():
            logits = self.model(**batch["inputs"]).logits
            loss = nll(logits, batch["labels"])
            loss.backward()
        self.capturing = False
        new = {}
        for lr, (n, m) in zip(self.edit_lrs, self.modules_.items()):
            s = tuple(m.weight.shape)
            x, delta = self.store[n]
            x_, d_ = self.mend[str(s)](x, delta, self.shape_dict[s].index(n))
            g = torch.einsum("bi,bj->ij", d_, x_)
            new[n + ".weight"] = (m.weight - lr * g).to(m.weight.dtype)
        for m in self.modules_.values():
            m.weight.grad = None
        return new


def nll(logits, labels):
    """masked_log_probs with the shift: NLL of the labelled tokens."""
    lp = logits[:, :-1].float().log_softmax(-1)
    t = labels[:, 1:]
    mask = t != -100
    tok = lp.gather(-1, t.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return -(tok * mask).sum() / mask.sum()


def acc(logits, labels):
    t = labels[:, 1:]
    mask = t != -100
    return ((logits[:, :-1].argmax(-1) == t) & mask).sum() / mask.sum()


def kl_loc_loss(pre, post, mask):
    pre_, post_ = pre.float().reshape(-1, pre.shape[-1]), post.float().reshape(-1, pre.shape[-1])
    m = mask.reshape(-1)
    kl = (pre_.softmax(-1) * (pre_.log_softmax(-1) - post_.log_softmax(-1))).sum(-1)
    return (kl * m).sum() / m.sum()


def view(raw, seed, pixels):
    ids = []
    if pixels is not None:
        ids = [raw["vision_start_token_id"]] + [raw["image_token_id"]] * IMAGE_TOKENS + [raw["vision_end_token_id"]]
    ids += [(seed * 131 + i * 17) % 4000 + 10 for i in range(QUESTION + ANSWER)]
    input_ids = torch.tensor([ids])
    labels = torch.full_like(input_ids, -100)
    labels[:, -ANSWER:] = input_ids[:, -ANSWER:]
    inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    if pixels is not None:
        inputs.update(
            pixel_values=pixels,
            image_grid_thw=torch.tensor([GRID]),
            mm_token_type_ids=(input_ids == raw["image_token_id"]).to(torch.int32),
        )
    return {"inputs": inputs, "labels": labels}


def main():
    global IMAGE_TOKENS, GRID
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=["small", "tiny", "medium"], default="small")
    ap.add_argument("--side", type=int, default=448)
    ap.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    if args.side < 56 or args.side % 28:
        ap.error(f"--side must be a multiple of 28 (at least 56), not {args.side}")
    g = args.side // 14
    IMAGE_TOKENS, GRID = g * g // 4, [1, g, g]
    torch.set_num_threads(1)
    config = {"tiny": "qwen2_vl_tiny.json", "medium": "qwen2_vl_medium.json"}.get(args.model, "qwen2_vl.json")
    raw = json.loads((ROOT / "benches/vl_configs" / config).read_text())
    n_layers = raw["num_hidden_layers"]
    EDITED[:] = [f"model.language_model.layers.{l}.mlp.{m}" for l in range(n_layers - 3, n_layers) for m in ("up_proj", "down_proj")]
    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model = Qwen2VLForConditionalGeneration._from_config(
        Qwen2VLConfig.from_dict(raw), attn_implementation="sdpa", dtype=dtype
    )
    for n, p in model.named_parameters():
        p.requires_grad_(any(n == e + ".weight" for e in EDITED))
    patch_dim = 3 * 2 * 14 * 14
    images = [torch.randn(GRID[1] * GRID[2], patch_dim) for _ in range(3)]
    batch = {
        "edit_inner": view(raw, 1, images[0]),
        "edit_outer": view(raw, 2, images[0]),
        "edit_outer_image": view(raw, 1, images[1]),
        "loc": view(raw, 3, None),
        "loc_image": view(raw, 4, images[2]),
    }
    mend = Mend(model)
    params = dict(model.named_parameters())
    outer = list(mend.mend.parameters())
    opt = torch.optim.Adam(outer, lr=LR)
    lr_opt = torch.optim.Adam(list(mend.edit_lrs), lr=LR_LR)
    n_editor = sum(p.numel() for p in outer) + len(EDITED)
    print(
        f"model {args.model}, {args.side} x {args.side} px ({IMAGE_TOKENS} image tokens), {args.dtype}; "
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), editor parameters {n_editor}"
    )

    def run(new, b):
        return functional_call(model, {**params, **new}, args=(), kwargs=b["inputs"]).logits

    def micro_batch():
        mend.train(True)
        with torch.no_grad():
            base = model(**batch["loc"]["inputs"]).logits
            base_image = model(**batch["loc_image"]["inputs"]).logits
        new = mend.edit(batch["edit_inner"])
        post_edit = run(new, batch["edit_outer"])
        post_image_edit = run(new, batch["edit_outer_image"])
        inner_edit = run(new, batch["edit_inner"])
        l_edit = nll(post_edit, batch["edit_outer"]["labels"])
        l_image_edit = nll(post_image_edit, batch["edit_outer_image"]["labels"])
        with torch.no_grad():
            acc(post_edit, batch["edit_outer"]["labels"])
            acc(inner_edit, batch["edit_inner"]["labels"])
            acc(post_image_edit, batch["edit_outer_image"]["labels"])
        post_base = run(new, batch["loc"])
        post_image_base = run(new, batch["loc_image"])
        l_loc = kl_loc_loss(base, post_base, batch["loc"]["inputs"]["attention_mask"])
        l_image_loc = kl_loc_loss(base_image, post_image_base, batch["loc_image"]["inputs"]["attention_mask"])
        total = C_EDIT * l_edit + C_LOC * (l_loc + l_image_loc) + I_EDIT * l_image_edit
        (total / ACCUMULATE).backward()
        with torch.no_grad():
            post_base.softmax(-1).topk(1, -1)
            base.softmax(-1).topk(1, -1)
            post_image_base.softmax(-1).topk(10, -1)
            base_image.softmax(-1).topk(10, -1)
        return total.item()

    def adam_step():
        torch.nn.utils.clip_grad_norm_(outer, GRAD_CLIP)
        opt.step()
        lr_opt.step()

    def edit():
        mend.train(False)
        with torch.no_grad():
            new = mend.edit(batch["edit_inner"])
        return new

    # The editor's statistics need two rows before they normalise (as after training).
    micro_batch()
    timed("train_microbatch", micro_batch, args.warmup, args.runs)
    timed("adam_step", adam_step, args.warmup, args.runs)
    opt.zero_grad()
    lr_opt.zero_grad()
    timed("edit", edit, args.warmup, args.runs)
    print(f"a meta-training step = train_microbatch + adam_step / accumulate ({ACCUMULATE})")


if __name__ == "__main__":
    main()
