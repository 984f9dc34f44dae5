#!/usr/bin/env python3
"""EasyEdit's own MEMIT, AlphaEdit and fine-tuning (FT) on the real model, many edits at once:
the references of issue #47 for dualedit's many-edit numbers.

  easyedit_many.py --easyedit DIR --model DIR --records FILE --n N --method {MEMIT,AlphaEdit,FT}
                   [--layers 4,5,6,7,8] [--sequential] --stats-text FILE --out JSON [--work DIR]

DIR is an unpacked EasyEdit at the pinned commit (`easyeditor/` and `hparams/`; see
scripts/gpu/easyedit_env.sh). Run it from a scratch folder (EasyEdit writes `logs/` into the
working folder; this script moves into --work, default beside --out), one thread, e.g.

  cd /tmp/refs && OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 taskset -c 0 venv/bin/python \\
      /work/main/scripts/easyedit_many.py --easyedit EasyEdit --model /work/main/data/real/model \\
      --records /work/shared/data/counterfact/counterfact-val.json --n 100 --method MEMIT \\
      --stats-text /work/main/data/real/stats-text.txt --out results/memit-100-batch.json

Nothing here computes an edit or a metric. The edit is EasyEdit's `apply_*_to_model`, driven by
`BaseEditor.batch_edit` (the first N records as one batch: `batch_size = N`, each record scored
before and after, then the weights restored) or, with --sequential, `BaseEditor.edit(...,
sequential_edit=True)` (`batch_size = 1`, one edit after another on the same weights). The
scores are EasyEdit's teacher-forced ones: reliability, generalization and locality are the
means over records of `post.rewrite_acc`, `post.rephrase_acc` and
`post.locality.neighborhood_acc` (EasyEdit's locality: agreement of the edited model's argmax
tokens on the locality answer with the unedited model's, not with the answer).

EasyEdit's sequential mode scores record i right after edit i (edits i+1.. not yet made). With
--sequential the output also holds `after_all`: the same EasyEdit functions
(`compute_edit_quality`, `finalize_locality_metrics`) applied to every record once all N edits
are in, against the `pre` scores EasyEdit took before the first edit.

Hyperparameters are EasyEdit's own yamls (hparams/MEMIT/llama-7b.yaml,
hparams/AlphaEdit/llama3-8b.yaml, hparams/FT/llama-7b.yaml), with these overrides, each recorded
under "overrides" in the output:
- model_name: a symlink named `smollm2-llama` to --model (EasyEdit picks its LLaMA code paths,
  tokenizer and padding side by "llama" in the path);
- device: cpu;
- layers: --layers, default the yaml's blocks scaled from the 32-block 7B/8B model to this
  model's depth (round(l * L / 32): MEMIT and AlphaEdit 4-8 stay 4-8, FT's 21 becomes 20);
- v_loss_layer (MEMIT, AlphaEdit): the yaml's 31 is the 7B model's last block; here L - 1;
- batch_size: N for one batch (EasyEdit's `batch_edit` splits the requests by it; FT also
  trains on minibatches of it), 1 with --sequential;
- lm_head_module (MEMIT, AlphaEdit): `model.embed_tokens` when the model ties its embeddings
  (SmolLM2 does): compute_z looks the unembedding up by parameter name, and torch names a tied
  tensor once, as `model.embed_tokens.weight` (the same tensor; no bias either way);
- P_loc (AlphaEdit): a path in --work that does not exist, so EasyEdit computes the null-space
  projection from the covariance below (and saves it there) instead of loading a downloaded one.

The covariance: MEMIT (`mom2_update_weight * C + K Kᵀ`) and AlphaEdit (the null space of C)
read C through `get_cov` in their `*_main.py`, which calls ROME's `layer_stats` over Wikipedia
from the hub. Both modules' `get_cov` are replaced by one that returns the uncentred second
moment E[k kᵀ] of the inputs of `model.layers.{l}.mlp.down_proj` over the tokens of
--stats-text (each line one sequence, tokenised as EasyEdit's `TokenizedDataset` does, i.e.
`tok.encode(line)`; 32 lines a forward, right-padded, the padding left out as `layer_stats`
leaves it out), accumulated in the yaml's `mom2_dtype` (float32), returned as float32 on
the device: what `stat.mom2.moment().float()` returns. It is computed once for all the edited
layers on the unedited model before the edit (so its time is not in the edit's) and cached as
EasyEdit caches it; `layer_stats` in both modules is replaced by a function that raises. One
JSON object goes to --out, rewritten after each phase.
"""
import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
from easyedit_mend import recorded, scratch, write  # noqa: E402  (one JSON-writing scaffold for all)

FORMAT = "dualedit-easyedit-many/1"
COMMIT = "14cea8245f06715684592ab55184939b99d70784"
YAMLS = {"MEMIT": "hparams/MEMIT/llama-7b.yaml", "AlphaEdit": "hparams/AlphaEdit/llama3-8b.yaml", "FT": "hparams/FT/llama-7b.yaml"}
BATCH = 32  # stats-text lines a forward (right-padded, padding masked out as layer_stats' flatten_masked_batch)
YAML_DEPTH = 32  # blocks of llama-2-7b and llama-3-8b, the models those yamls are for


def peak_rss():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--easyedit", type=Path, required=True, help="EasyEdit's root: easyeditor/ and hparams/")
    ap.add_argument("--model", type=Path, required=True, help="the real model's HF folder (data/real/model)")
    ap.add_argument("--records", type=Path, required=True, help="CounterFact records in EasyEdit's format")
    ap.add_argument("--n", type=int, required=True, help="edit the first N records")
    ap.add_argument("--method", choices=sorted(YAMLS), required=True)
    ap.add_argument("--layers", help="edited blocks, e.g. 27,28,29 (default: the yaml's, scaled to this depth)")
    ap.add_argument("--sequential", action="store_true", help="one edit after another (EasyEdit's sequential_edit)")
    ap.add_argument("--stats-text", type=Path, required=True, help="text for the covariance, one sequence a line")
    ap.add_argument("--test-generation", action="store_true", help="EasyEdit's fluency (test_generation=True): slow")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, help="scratch: the model link, EasyEdit's logs/; default beside --out")
    args = ap.parse_args()
    work = scratch(args, ("easyedit", "model", "records", "stats_text"))
    os.chdir(work)  # EasyEdit writes logs/ (and AlphaEdit its null_space_project.pt) here
    result = {"format": FORMAT, "tool": "easyedit", "method": args.method, "n": args.n,
              "mode": "sequential" if args.sequential else "batch", "model": str(args.model),
              "records": str(args.records), "easyedit_commit": COMMIT, "phase": "import"}
    return recorded("easyedit_many", run, args, work, result)


def install_covariance(modules, stats_text, result):
    """Replaces `get_cov` (and `layer_stats`) in EasyEdit's MEMIT / AlphaEdit modules."""
    import torch
    from easyeditor.util.device import normalize_device

    lines = [l for l in stats_text.read_text().splitlines() if l.strip()]
    cache = {}
    info = {"text": str(stats_text), "lines": len(lines), "lines_per_forward": BATCH, "tokens": None, "statistic": "uncentred second moment E[k k^T]",
            "of": "inputs of model.layers.{l}.mlp.down_proj", "layers": {}}
    result["covariance"] = info

    class Enough(Exception):
        pass

    def compute(model, tok, layer_names, dtype):
        hooks, sums = [], {}
        count = 0
        modules = dict(model.named_modules())
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        last = max(layer_names, key=lambda n: list(modules).index(n))
        mask = {}
        for name in layer_names:
            def pre(mod, inp, name=name):
                k = inp[0].detach().reshape(-1, inp[0].shape[-1])[mask["rows"]].to(dtype)  # padding left out
                sums[name] = sums[name] + k.T @ k if name in sums else k.T @ k
                if name == last:  # as layer_stats' Trace(stop=True): nothing after it is needed
                    raise Enough
            hooks.append(modules[name].register_forward_pre_hook(pre))
        t = time.perf_counter()
        try:
            device = next(model.parameters()).device
            with torch.no_grad():
                for i in range(0, len(lines), BATCH):
                    seqs = [tok.encode(line) for line in lines[i:i + BATCH]]
                    width = max(len(q) for q in seqs)
                    ids = torch.tensor([q + [pad] * (width - len(q)) for q in seqs], device=device)
                    att = torch.tensor([[1] * len(q) + [0] * (width - len(q)) for q in seqs], device=device)
                    mask["rows"] = att.reshape(-1).nonzero()[:, 0]
                    count += int(att.sum())
                    try:
                        model(input_ids=ids, attention_mask=att)
                    except Enough:
                        pass
        finally:
            for h in hooks:
                h.remove()
        info["tokens"] = count
        info["seconds"] = round(time.perf_counter() - t, 1)
        for name in layer_names:
            cache[name] = (sums[name] / count).float().cpu()
            ev = torch.linalg.eigvalsh(cache[name].double())
            info["layers"][name] = {"trace": float(ev.sum()), "eig_max": float(ev[-1]), "eig_min": float(ev[0])}

    def get_cov(model, tok, layer_name, mom2_dataset, mom2_n_samples, mom2_dtype, inv=False, force_recompute=False, hparams=None):
        if layer_name not in cache:
            names = [hparams.rewrite_module_tmp.format(l) for l in hparams.layers]
            compute(model, tok, names if layer_name in names else [layer_name], getattr(torch, mom2_dtype))
        cov = cache[layer_name].to(normalize_device(getattr(hparams, "device", None)))
        return torch.inverse(cov) if inv else cov

    def layer_stats(*a, **k):
        raise RuntimeError("easyedit_many: layer_stats (Wikipedia from the hub) is replaced by get_cov over --stats-text")

    for m in modules:
        m.get_cov = get_cov
        m.layer_stats = layer_stats
    return get_cov


def run(args, work, result):
    sys.path.insert(0, str(args.easyedit))
    import numpy as np
    import torch
    import transformers
    import easyeditor
    from easyeditor import BaseEditor, MEMITHyperParams, AlphaEditHyperParams, FTHyperParams
    from easyeditor.models.memit import memit_main
    from easyeditor.models.alphaedit import AlphaEdit_main
    from easyeditor.evaluate import compute_edit_quality
    from easyeditor.editors.editor import finalize_locality_metrics
    result.update(torch=torch.__version__, transformers=transformers.__version__, threads=torch.get_num_threads(),
                  easyeditor=str(Path(easyeditor.__file__).parent))

    result["phase"] = "hparams"
    link = work / "smollm2-llama"
    if not link.exists():
        link.symlink_to(args.model, target_is_directory=True)
    depth = json.loads((args.model / "config.json").read_text())["num_hidden_layers"]
    cls = {"MEMIT": MEMITHyperParams, "AlphaEdit": AlphaEditHyperParams, "FT": FTHyperParams}[args.method]
    yaml = args.easyedit / YAMLS[args.method]
    hp = cls.from_hparams(str(yaml))
    if args.layers:
        layers = [int(l) for l in args.layers.split(",")]
        layers_from = "--layers"
    else:
        layers = sorted({min(depth - 1, round(l * depth / YAML_DEPTH)) for l in hp.layers})
        layers_from = f"the yaml's {list(hp.layers)} scaled by {depth}/{YAML_DEPTH}"
    overrides = {"model_name": str(link), "device": "cpu", "layers": layers, "batch_size": 1 if args.sequential else args.n}
    if args.method in ("MEMIT", "AlphaEdit"):
        overrides["v_loss_layer"] = depth - 1
        # compute_z reads the unembedding as the parameter `lm_head.weight`; with tied embeddings
        # (SmolLM2) torch lists that tensor only once, as `model.embed_tokens.weight`.
        config = json.loads((args.model / "config.json").read_text())
        if config.get("tie_word_embeddings"):
            overrides["lm_head_module"] = "model.embed_tokens"
    if args.method == "AlphaEdit":
        p_loc = work / "null_space_project.pt"
        for stale in (p_loc, Path("null_space_project.pt")):
            if stale.exists():
                stale.unlink()
        overrides["P_loc"] = str(p_loc)
    result["overrides"] = {k: {"yaml": getattr(hp, k, None), "used": v} for k, v in overrides.items()}
    for k, v in overrides.items():
        setattr(hp, k, v)
    result.update(hparams=str(yaml.relative_to(args.easyedit)), layers=layers, layers_from=layers_from,
                  edited=[(hp.rewrite_module_tmp.format(l)) for l in layers],
                  method_hparams={k: v if isinstance(v, (int, float, str, bool, list, type(None))) else str(v)
                                  for k, v in vars(hp).items() if k not in overrides})
    if args.method in ("MEMIT", "AlphaEdit"):
        result["stubs"] = ["get_cov and layer_stats in easyeditor.models.{memit.memit_main,alphaedit.AlphaEdit_main}"]
        result["method_hparams"].update(mom2_dataset="unused (replaced)", mom2_n_samples="unused (replaced)")

    result["phase"] = "model"
    records = json.loads(args.records.read_text())[: args.n]
    if len(records) < args.n:
        raise SystemExit(f"easyedit_many: {args.records} has {len(records)} records, fewer than --n")
    editor = BaseEditor.from_hparams(hp)
    result.update(tokenizer=type(editor.tok).__name__, padding_side=editor.tok.padding_side,
                  rss_after_load_bytes=peak_rss())

    if args.method in ("MEMIT", "AlphaEdit"):
        result["phase"] = "covariance"
        get_cov = install_covariance([memit_main, AlphaEdit_main], args.stats_text, result)
        get_cov(editor.model, editor.tok, hp.rewrite_module_tmp.format(layers[0]), hp.mom2_dataset, hp.mom2_n_samples,
                hp.mom2_dtype, hparams=hp)
        write(args.out, result)

    # The edit's own time: every call of EasyEdit's apply_*_to_model (scoring excluded).
    algo, spent = editor.apply_algo, []

    def timed(*a, **k):
        t = time.perf_counter()
        out = algo(*a, **k)
        spent.append(time.perf_counter() - t)
        return out
    editor.apply_algo = timed

    result["phase"] = "edit"
    kw = dict(
        prompts=[r["prompt"] for r in records],
        ground_truth=[r["ground_truth"] for r in records],
        target_new=[r["target_new"] for r in records],
        rephrase_prompts=[r["rephrase_prompt"] for r in records],
        locality_inputs={"neighborhood": {"prompt": [r["locality_prompt"] for r in records],
                                          "ground_truth": [r["locality_ground_truth"] for r in records]}},
        subject=[r["subject"] for r in records],
        sequential_edit=args.sequential,
        test_generation=args.test_generation,
    )
    t = time.perf_counter()
    if args.sequential:
        metrics, edited, _ = editor.edit(**kw)
    else:
        metrics, edited, _ = editor.batch_edit(**kw)
    wall = time.perf_counter() - t

    def mean(ms, get):
        return float(np.mean([np.mean(get(m)) for m in ms]))

    def scores(ms, when):
        out = {"reliability": mean(ms, lambda m: m[when]["rewrite_acc"]),
               "generalization": mean(ms, lambda m: m[when]["rephrase_acc"])}
        if when == "post":
            out["locality"] = mean(ms, lambda m: m["post"]["locality"]["neighborhood_acc"])
        if args.test_generation and "fluency" in ms[0][when]:
            out["fluency"] = {k: mean(ms, lambda m: m[when]["fluency"][k]) for k in ms[0][when]["fluency"]
                              if isinstance(ms[0][when]["fluency"][k], (int, float))}
        return out

    result.update(scores(metrics, "post"))
    result["before"] = scores(metrics, "pre")
    result.update(records_scored=len(metrics), wall_seconds=round(wall, 1), edit_seconds=round(sum(spent), 1),
                  edit_calls=len(spent), seconds_per_edit=round(sum(spent) / args.n, 3),
                  wall_seconds_per_edit=round(wall / args.n, 3), peak_rss_bytes=peak_rss())
    if args.method == "AlphaEdit" and getattr(AlphaEdit_main, "P", None) is not None:
        result["nullspace_dims"] = {l: int(round(float(AlphaEdit_main.P[i].trace()))) for i, l in enumerate(layers)}
    write(args.out, result)

    if args.sequential:
        result["phase"] = "after_all"
        t = time.perf_counter()
        final = []
        for m in metrics:
            request = m["requested_rewrite"]
            f = {"pre": m["pre"], "post": compute_edit_quality(edited, hp.model_name, hp, editor.tok, request, hp.device)}
            finalize_locality_metrics(f, request, hp, hp.model_name)
            final.append(f)
        result["after_all"] = {**scores(final, "post"), "seconds": round(time.perf_counter() - t, 1),
                               "what": "EasyEdit's compute_edit_quality on the model holding all N edits"}
    result["peak_rss_bytes"] = peak_rss()
    with open(work / "metrics.json", "w") as f:
        json.dump(metrics, f, default=str)


if __name__ == "__main__":
    sys.exit(main())
