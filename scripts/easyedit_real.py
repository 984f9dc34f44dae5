#!/usr/bin/env python3
"""EasyEdit's own MEND trained and judged on the real model: the anchor of issue #46.

  easyedit_real.py --easyedit DIR --model DIR --train FILE --val FILE --edits N
                   [--hparams easyedit | --hparams CONFIG.json] [--eval-limit 200] --out JSON

DIR is an unpacked EasyEdit (scripts/gpu/easyedit_env.sh: `EasyEdit/` with `easyeditor` and its
hparams at the pinned commit). Nothing here computes MEND or a metric:

- training is `EditTrainer(...).run()`, EasyEdit's own loop over its `CounterFactDataset`, with
  `hparams/TRAINING/MEND/llama-7b.yaml`: N training records (EasyEdit's `max_iters` counts
  records; an optimiser step every `accumulate_bs` of them), its validation once at the end on
  the last `--val-records` training records (as dualedit's train holds them out), saved by its
  own `save_state`; with `--stint S`, in stints of S records, each from the last one's archive,
  so that a run killed part way goes on from its last stint when started again;
- judging is `BaseEditor.from_hparams(MENDHyperParams)` with `hparams/MEND/llama-7b.yaml` and
  that archive, `editor.edit(...)` over the first `--eval-limit` validation records, each edited
  from the unedited model (`sequential_edit=False`); the means of its `post.rewrite_acc`,
  `post.rephrase_acc` and `post.locality.neighborhood_acc` are reliability, generalization and
  locality, the teacher-forced metrics dualedit's `eval` reports.

`--hparams easyedit` keeps the yaml's method settings (lr 1e-6, cedit 0.1, cloc 1, rank 1920,
accumulate_bs 10); `--hparams FILE` takes them from a dualedit config (lr, edit_lr, lr_lr,
c_edit, c_loc, rank, accumulate, grad_clip, n_hidden, max_length) so both tools train with the
same settings. Always overridden (recorded under "overrides"): the model folder, the edited
weights' blocks (the yaml's 29-31 become --layers), the device, the results folder,
`alg_name` (its collate reads it; the class has `alg`), and `tokenizer_class`. EasyEdit picks
the LLaMA forward by "llama" in the folder's path: the model is given through a symlink whose
name says so. One JSON object goes to --out (rewritten after each phase).
"""
import argparse
import json
import os
import re
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
from easyedit_mend import recorded, scratch, write  # noqa: E402  (one JSON-writing scaffold for both)

FORMAT = "dualedit-easyedit-real/1"


def moved(inner, layers):
    theirs = sorted({int(re.search(r"\.layers\.(\d+)\.", n).group(1)) for n in inner})
    if len(theirs) != len(layers):
        raise SystemExit(f"easyedit_real: --layers names {len(layers)} blocks, the yaml edits {len(theirs)}")
    to = dict(zip(theirs, layers))
    return [re.sub(r"\.layers\.(\d+)\.", lambda m: f".layers.{to[int(m.group(1))]}.", n) for n in inner]


def method_settings(spec):
    """The yaml's method settings to replace: none for `easyedit`, a dualedit config's otherwise."""
    if spec == "easyedit":
        return {}
    c = json.loads(Path(spec).read_text())
    names = {"lr": "lr", "edit_lr": "edit_lr", "lr_lr": "lr_lr", "c_edit": "cedit", "c_loc": "cloc", "rank": "rank",
             "accumulate": "accumulate_bs", "grad_clip": "grad_clip", "n_hidden": "n_hidden", "max_length": "max_length"}
    out = {theirs: c[ours] for ours, theirs in names.items() if ours in c}
    for k, want in {"norm": True, "shared": True, "mode": "combine", "batch_size": 1}.items():
        if k in c and c[k] != want:
            raise SystemExit(f"easyedit_real: {spec}: {k} = {c[k]!r}; EasyEdit's MEND yaml has {want!r} and this script keeps it")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--easyedit", type=Path, required=True, help="EasyEdit's root: easyeditor/ and hparams/")
    ap.add_argument("--model", type=Path, required=True, help="the real model's HF folder (data/real/model)")
    ap.add_argument("--train", type=Path, required=True, help="CounterFact training records")
    ap.add_argument("--val", type=Path, required=True, help="CounterFact validation records (judged, never trained on)")
    ap.add_argument("--edits", type=int, required=True, help="training records seen (dualedit: steps x accumulate)")
    ap.add_argument("--val-records", type=int, default=50, help="the last training records, held out for EasyEdit's validation")
    ap.add_argument("--hparams", default="easyedit", help="`easyedit` (the yaml's) or a dualedit config JSON")
    ap.add_argument("--layers", default="27,28,29", help="the edited blocks in place of the yaml's 29-31")
    ap.add_argument("--eval-limit", type=int, default=200)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--stint", type=int, help="train in stints of this many records, resumable (default: one stint)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, help="scratch: the model link, EasyEdit's results; default beside --out")
    args = ap.parse_args()
    work = scratch(args, ("easyedit", "model", "train", "val"))
    if args.hparams != "easyedit":
        args.hparams = str(Path(args.hparams).resolve())
    os.chdir(work)  # EasyEdit writes its logs/ into the working folder
    result = {"format": FORMAT, "tool": "easyedit", "model": str(args.model), "edits": args.edits, "hparams_from": args.hparams,
              "phase": "import"}
    return recorded("easyedit_real", run, args, work, result)


def run(args, work, result):
    sys.path.insert(0, str(args.easyedit.resolve()))
    # EasyEdit's trainer reads a stint's archive with a plain torch.load, which torch >= 2.6 refuses
    # for the pickled config inside; the archive is this run's own file.
    os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    import numpy as np
    import torch
    import transformers
    from easyeditor import EditTrainer, CounterFactDataset, MENDTrainingHparams, MENDHyperParams, BaseEditor
    result.update(torch=torch.__version__, transformers=transformers.__version__, threads=torch.get_num_threads())

    link = work / "llama-smollm2"
    if not link.exists():
        link.symlink_to(args.model.resolve(), target_is_directory=True)
    layers = [int(l) for l in args.layers.split(",")]
    common = {"model_name": str(link), "tokenizer_name": str(link), "tokenizer_class": "AutoTokenizer", "device": "cpu"}
    method = method_settings(args.hparams)

    result["phase"] = "data"
    records = json.loads(args.train.read_text())
    if args.val_records >= len(records):
        raise SystemExit(f"easyedit_real: {args.train} has {len(records)} records, fewer than --val-records + 1")
    hold_file = work / "held-out.json"
    train_records = records[: len(records) - args.val_records]
    # EasyEdit runs round(max_iters / len(train)) epochs and stops at max_iters inside them, so more
    # records than one pass (dualedit's 2,500 steps of 5 are 1.26 passes) would be cut to one pass.
    # The records are the passes laid end to end instead: each once or twice, as dualedit sees them.
    seen = [train_records[i % len(train_records)] for i in range(args.edits)]
    hold_file.write_text(json.dumps(records[len(records) - args.val_records:]))

    result["phase"] = "train"
    train_yaml = args.easyedit / "hparams/TRAINING/MEND/llama-7b.yaml"
    hp = MENDTrainingHparams.from_hparams(str(train_yaml))
    stint = args.stint or args.edits
    overrides = {**common, **method, "alg_name": hp.alg, "results_dir": str(work / "results"),
                 "val_steps": args.val_records, "final_eval": False, "save": True, "debug": False,
                 "early_stop_patience": 10**9, "seed": args.seed}
    for k, v in overrides.items():
        setattr(hp, k, v)
    hp.inner_params = moved(hp.inner_params, layers)
    hp.dtype = torch.float32
    if stint % hp.accumulate_bs:
        raise SystemExit(f"easyedit_real: --stint {stint} is not a whole number of optimiser steps of {hp.accumulate_bs}")
    result.update(train_hparams=str(train_yaml.relative_to(args.easyedit)), overrides=overrides, inner_params=hp.inner_params,
                  stint=stint, method={k: getattr(hp, k) for k in ["lr", "edit_lr", "lr_lr", "cedit", "cloc", "rank", "accumulate_bs", "grad_clip"]})
    # A long training runs in stints of --stint records, each EasyEdit's own `run()` from the last
    # stint's archive (its `archive` hparam restores the editor, Adam's and the learning rates'
    # optimiser states); a stint's archive is kept under its number and `stints.json` says which
    # ended, so a killed run started again with the same arguments goes on from the last one.
    progress_file = work / "stints.json"
    progress = json.loads(progress_file.read_text()) if progress_file.is_file() else []
    held = CounterFactDataset(str(hold_file), config=hp)
    for k, start in enumerate(range(0, args.edits, stint)):
        if k < len(progress):
            if progress[k]["start"] != start:
                raise SystemExit(f"easyedit_real: {progress_file} was written with another --stint; remove it or keep its --stint")
            continue
        part = seen[start:start + stint]
        train_file = work / "train.json"
        train_file.write_text(json.dumps(part))
        hp.max_iters, hp.val_interval, hp.log_interval = len(part) + 1, len(part), max(len(part) // 10, 1)
        hp.archive = progress[-1]["archive"] if progress else None
        torch.manual_seed(args.seed + k)
        np.random.seed(args.seed + k)
        trainer = EditTrainer(config=hp, train_set=CounterFactDataset(str(train_file), config=hp), val_set=held)
        t = time.perf_counter()
        trainer.run()
        secs = time.perf_counter() - t
        saved = Path(trainer.save_path)
        if not saved.is_file():
            raise RuntimeError(f"EasyEdit saved no archive at {saved}")
        kept = work / f"stint-{k}.pt"
        os.replace(saved, kept)
        progress.append({"start": start, "records": len(part), "seconds": round(secs, 1), "archive": str(kept),
                         "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024})
        write(progress_file, progress)
        del trainer
    secs = sum(p["seconds"] for p in progress)
    result["train"] = {"seconds": round(secs, 1), "records": args.edits, "optimizer_steps": args.edits // hp.accumulate_bs,
                       "stints": len(progress), "seconds_per_record": round(secs / args.edits, 4),
                       "peak_rss_bytes": max(p["peak_rss_bytes"] for p in progress)}
    archive = Path(progress[-1]["archive"])
    result["archive"] = str(archive)
    write(args.out, result)

    result["phase"] = "judge"
    edit_yaml = args.easyedit / "hparams/MEND/llama-7b.yaml"
    ehp = MENDHyperParams.from_hparams(str(edit_yaml))
    for k, v in {**common, **{k: v for k, v in method.items() if k not in ("accumulate_bs",)}, "archive": str(archive)}.items():
        setattr(ehp, k, v)
    ehp.inner_params = moved(ehp.inner_params, layers)
    val = json.loads(args.val.read_text())[: args.eval_limit]
    editor = BaseEditor.from_hparams(ehp)
    t = time.perf_counter()
    metrics, _, _ = editor.edit(
        prompts=[r["prompt"] for r in val],
        ground_truth=[r["ground_truth"] for r in val],
        target_new=[r["target_new"] for r in val],
        rephrase_prompts=[r["rephrase_prompt"] for r in val],
        locality_inputs={"neighborhood": {"prompt": [r["locality_prompt"] for r in val],
                                          "ground_truth": [r["locality_ground_truth"] for r in val]}},
        subject=[r["subject"] for r in val],
        sequential_edit=False,
    )
    secs = time.perf_counter() - t

    def mean(get):
        return float(np.mean([np.mean(get(m)) for m in metrics]))

    result["judge"] = {
        "records": len(metrics), "seconds": round(secs, 1), "edit_hparams": str(edit_yaml.relative_to(args.easyedit)),
        "reliability": mean(lambda m: m["post"]["rewrite_acc"]),
        "generalization": mean(lambda m: m["post"]["rephrase_acc"]),
        "locality": mean(lambda m: m["post"]["locality"]["neighborhood_acc"]),
        "reliability_before": mean(lambda m: m["pre"]["rewrite_acc"]),
    }


if __name__ == "__main__":
    sys.exit(main())
