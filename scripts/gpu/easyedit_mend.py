#!/usr/bin/env python3
"""EasyEdit's own MEND, timed: one edit and meta-training steps, as EasyEdit runs them.

  easyedit_mend.py --easyedit DIR --family vl|text --model DIR --data FILE [--image-root DIR]
                   [--device cuda:0] [--steps 6] [--warmup 2] [--rank R] --out JSON

DIR is the carried EasyEdit (scripts/gpu/easyedit_env.sh): its `easyeditor` package at the
pinned commit and its training hparams. Nothing here computes MEND: the edit is
`MEND.edit` and a step is `trainer.train_step(batch)` of EasyEdit's own trainer, the same
call its `BaseTrainer.run` makes per batch:

- vl: `MultimodalTrainer` with `hparams/TRAINING/MEND/qwen2vl-7b.yaml` and `VQADataset`
  (E-VQA records; images under --image-root); five edited forwards per step;
- text: `EditTrainer` with `hparams/TRAINING/MEND/llama-7b.yaml` and `CounterFactDataset`.

What the yaml is given besides (recorded under "overrides"): the model folder (name,
model_name, tokenizer), the device, results_dir in the scratch folder, the image roots,
`dtype` (EasyEdit's `get_model` reads `config.dtype`, which its hparams class lacks),
`alg_name` (the text collate reads it; the class has `alg`), and
the edited weights renamed to this transformers' parameter names: the Qwen2-VL yaml names
`model.layers.N...`, which transformers 5 calls `model.language_model.layers.N...` (as
EasyEdit's own qwen3vl-4b yaml writes them); `--rank` (test sizes only) and `--layers`
(the yaml's blocks moved to a model of another depth: SmolLM2's 27-29 for LLaMA-7B's
29-31, a test model's last three) where given.

Timing: a CUDA device is synchronised around each timed call; `--warmup` steps run first
and are not counted. Peak memory: the CUDA allocator's peak (torch.cuda.max_memory_allocated),
reset before the edit and before the steps; on the CPU the process's peak RSS (ru_maxrss,
which cannot be reset: the training figure includes the edit's). One JSON object is written
to --out, also when a phase fails (its "error" then says where).
"""
import argparse
import json
import os
import re
import resource
import statistics
import sys
import time
import traceback
from pathlib import Path

FORMAT = "dualedit-easyedit-mend/1"


def peak_reset(device):
    import torch
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak(device):
    import torch
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        return {"peak_bytes": int(torch.cuda.max_memory_allocated()), "peak_is": "CUDA allocator peak (max_memory_allocated)"}
    return {"peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "peak_is": "process peak RSS (ru_maxrss)"}


def sync(device):
    import torch
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def scratch(args, paths=()):
    """The run's scratch folder (--work, default beside --out), made; --out and the `paths`
    arguments made absolute first, since the scripts move into the scratch folder (EasyEdit
    writes logs/ and results into the working folder)."""
    args.out = args.out.resolve()
    for k in paths:
        setattr(args, k, getattr(args, k).resolve())
    work = (args.work or args.out.with_name(args.out.stem + ".work")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    return work


def write(out, result):
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, out)


def parameter_names(model_dir, family):
    """The names this transformers gives the model's parameters (not the checkpoint's keys:
    transformers 5 saves Qwen2-VL's language model under its old names), from the model
    built on the meta device."""
    import torch
    import transformers
    config = transformers.AutoConfig.from_pretrained(model_dir)
    cls = transformers.Qwen2VLForConditionalGeneration if family == "vl" else transformers.AutoModelForCausalLM
    with torch.device("meta"):
        model = cls.from_config(config) if family == "text" else cls._from_config(config)
    return {n for n, _ in model.named_parameters()}


def rename(inner, names, layers):
    """The yaml's edited weights under the model's names: `model.layers.N` becomes
    `model.language_model.layers.N` where only the latter exists (transformers 5's Qwen2-VL);
    with `layers`, the yaml's blocks (in order) become those (a model of another depth)."""
    if layers:
        theirs = sorted({int(re.search(r"\.layers\.(\d+)\.", n).group(1)) for n in inner})
        if len(theirs) != len(layers):
            raise SystemExit(f"easyedit_mend: --layers names {len(layers)} blocks, the yaml edits {len(theirs)}")
        to = dict(zip(theirs, layers))
        inner = [re.sub(r"\.layers\.(\d+)\.", lambda m: f".layers.{to[int(m.group(1))]}.", n) for n in inner]
    out = []
    for n in inner:
        if n not in names and n.startswith("model.layers."):
            alt = "model.language_model." + n[len("model."):]
            if alt in names:
                n = alt
        if n not in names:
            raise SystemExit(f"easyedit_mend: edited weight {n} is not a parameter of the model")
        out.append(n)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--easyedit", type=Path, required=True, help="EasyEdit's root: easyeditor/ and hparams/")
    ap.add_argument("--family", choices=["vl", "text"], required=True)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--data", type=Path, required=True, help="E-VQA (vl) or CounterFact (text) records")
    ap.add_argument("--image-root", type=Path, help="the records' image folder (vl)")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--steps", type=int, default=6, help="timed meta-training steps (records, one per step)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    ap.add_argument("--rank", type=int, help="the editor's rank (the yaml's 1920 unless given)")
    ap.add_argument("--layers", help="the edited blocks in place of the yaml's (a model of another depth), e.g. 27,28,29")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, help="scratch (results_dir); default beside --out")
    args = ap.parse_args()
    work = scratch(args)
    result = {"format": FORMAT, "tool": "easyedit", "family": args.family, "model": str(args.model), "device": args.device,
              "steps": args.steps, "warmup": args.warmup, "phase": "import"}
    return recorded("easyedit_mend", run, args, work, result)


def recorded(name, run, args, work, result):
    """Runs `run(args, work, result)` and writes `result` to `args.out` whatever happens: with
    the carried EasyEdit's commit, and on a failure the phase, the error and its traceback.
    Returns the exit code."""
    info = args.easyedit / "EASYEDIT-INFO"
    if info.is_file():
        result["easyedit"] = dict(l.split("=", 1) for l in info.read_text().splitlines() if "=" in l)
    try:
        run(args, work, result)
        result["phase"] = "done"
    except BaseException as e:  # recorded: the caller reads the JSON
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()[-4000:]
        write(args.out, result)
        print(f"{name}: {result['phase']} failed: {result['error']}", file=sys.stderr)
        return 1
    write(args.out, result)
    return 0


def run(args, work, result):
    sys.path.insert(0, str(args.easyedit.resolve()))
    t = time.perf_counter()
    import torch
    import transformers
    import easyeditor
    from easyeditor import MultimodalTrainer, EditTrainer, VQADataset, CounterFactDataset
    from easyeditor import MENDMultimodalTrainingHparams, MENDTrainingHparams
    result.update(import_seconds=round(time.perf_counter() - t, 2), torch=torch.__version__, transformers=transformers.__version__)
    result["phase"] = "hparams"
    config = json.loads((args.model / "config.json").read_text())
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[config.get("dtype") or config.get("torch_dtype") or "float32"]
    names = parameter_names(args.model, args.family)
    overrides = {"device": args.device, "results_dir": str(work / "results"), "max_iters": args.warmup + args.steps + 1,
                 "val_interval": 10**9, "log_interval": 10**9, "final_eval": False, "save": False, "debug": True}
    if args.family == "vl":
        yaml = args.easyedit / "hparams/TRAINING/MEND/qwen2vl-7b.yaml"
        hp = MENDMultimodalTrainingHparams.from_hparams(str(yaml))
        root = str(args.image_root.resolve()) + "/"
        # model_name must still name the family: EasyEdit picks its code paths by it.
        overrides.update(name=str(args.model), model_name="qwen2-vl-" + args.model.name, tokenizer_name=str(args.model),
                         coco_image=root, rephrase_image=root)
    else:
        yaml = args.easyedit / "hparams/TRAINING/MEND/llama-7b.yaml"
        hp = MENDTrainingHparams.from_hparams(str(yaml))
        # model_class (LlamaForCausalLM) picks the decoder collate, collate_gpt_fn, which
        # reads `alg_name` (the hparams class names it `alg`). MEND.edit picks its forward
        # by "llama" in model_name, which is also the folder loaded: the folder's path must
        # say llama (the generic branch passes labels the shape of the target alone).
        if "llama" not in str(args.model).lower():
            raise SystemExit(f"easyedit_mend: EasyEdit's MEND runs a LLaMA only when its folder's path says llama: {args.model}")
        overrides.update(model_name=str(args.model), tokenizer_name=str(args.model), tokenizer_class="AutoTokenizer", alg_name=hp.alg)
    if args.rank:
        overrides["rank"] = args.rank
    for k, v in overrides.items():
        setattr(hp, k, v)
    layers = [int(l) for l in args.layers.split(",")] if args.layers else None
    hp.inner_params = rename(hp.inner_params, names, layers)
    hp.dtype = dtype
    result.update(hparams=str(yaml.relative_to(args.easyedit)), overrides={k: v for k, v in overrides.items()},
                  inner_params=hp.inner_params, rank=hp.rank, accumulate_bs=hp.accumulate_bs, dtype=str(dtype).replace("torch.", ""))
    torch.manual_seed(0)

    result["phase"] = "data"
    n = args.warmup + args.steps
    if args.family == "vl":
        train = VQADataset(str(args.data), config=hp, size=max(n, 1))
        trainer_cls = MultimodalTrainer
    else:
        train = CounterFactDataset(str(args.data), config=hp, size=max(n, 1))
        trainer_cls = EditTrainer
    if len(train) == 0:
        raise RuntimeError(f"EasyEdit kept no record of {args.data}")
    result["records"] = len(train)

    result["phase"] = "load"
    peak_reset(args.device)
    t = time.perf_counter()
    trainer = trainer_cls(config=hp, train_set=train, val_set=train)
    sync(args.device)
    result["load_seconds"] = round(time.perf_counter() - t, 2)
    result["parameters"] = sum(p.numel() for p in trainer.model.model.parameters())
    result["editor_parameters"] = sum(p.numel() for p in trainer.model.mend.parameters())
    result["after_load"] = peak(args.device)
    batches = []
    for b in trainer.train_loader:
        batches.append(b)
        if len(batches) >= n:
            break
    while len(batches) < n:  # fewer records than steps: reuse them, as the next epoch would
        batches.append(batches[len(batches) % max(len(batches), 1)])

    # One edit, as EasyEdit's editors apply a trained MEND: model.edit on the edit view,
    # before any optimiser state exists.
    result["phase"] = "edit"
    trainer.model.train(False)
    for i in range(2):
        peak_reset(args.device)
        t = time.perf_counter()
        edited, _ = trainer.model.edit(batches[0]["edit_inner"], batches[0]["cond"])
        sync(args.device)
        secs = time.perf_counter() - t
        del edited
        trainer.model.model.zero_grad(set_to_none=True)
        if i == 1:  # the second: the first pays one-off initialisation
            result["edit"] = {"seconds": round(secs, 4), **peak(args.device)}

    result["phase"] = "train"
    times = []
    peak_reset(args.device)
    for i, b in enumerate(batches):
        trainer.global_iter = i + 1  # as BaseTrainer.run counts before each train_step (accumulate_bs reads it)
        sync(args.device)
        t = time.perf_counter()
        info = trainer.train_step(b)
        sync(args.device)
        if i >= args.warmup:
            times.append(time.perf_counter() - t)
        result["last_loss"] = float(info.get("loss/total_edit", info.get("loss/total", float("nan"))))
    result["train"] = {"step_seconds": [round(s, 4) for s in times], "mean_step_seconds": round(statistics.mean(times), 4) if times else None,
                       "median_step_seconds": round(statistics.median(times), 4) if times else None, **peak(args.device)}


if __name__ == "__main__":
    sys.exit(main())
