#!/usr/bin/env python3
"""dualedit against EasyEdit's own MEND on the same GPU, models, records and edited weights
(issue #51): one command, one JSON (check.py's report format: steps with status, commands,
seconds), rewritten after every step.

  scripts/gpu/versus.sh [OUT_JSON]                               # on the GPU machine
  DEVICE=cpu scripts/gpu/versus.py --small --out versus.json     # the dry run, on a CPU

Needs the carried EasyEdit (scripts/gpu/easyedit_env.sh: .easyedit/easyedit-env.tar.xz)
and a Python with torch and transformers (the GPU image's; EasyEdit's other needs are in
the archive). Steps, in the order they matter (each bounded; a failed one never stops the
rest; the whole run stays inside --budget):

  environment       the binary, torch, the GPU
  easyedit          the archive unpacked, `import easyeditor` timed, its commit recorded
  models            random weights written by this transformers (scripts/gpu/random_models.py):
                    Qwen2-VL-7B- and 2B-shaped in bf16; SmolLM2-135M-shaped (the real model's
                    config and tokenizer, carried in the archive) in f32 and bf16
  data              E-VQA records of the visual world with IMAGE x IMAGE pictures (448; --small 84),
                    and the real model's five CounterFact facts (data/real/facts.json)
  vl7b              Qwen2-VL-7B-shaped: EasyEdit's MultimodalTrainer (qwen2vl-7b.yaml) and
                    dualedit (configs/qwen2vl-7b.json, the same weights and hyperparameters) on
                    DEVICE alone, alone with the optimiser in host memory (phases timed on the GPU),
                    and on DEVICE + SUB balanced under a cap on DEVICE (--split-cap) with the
                    optimiser on SUB: time per meta-training record and peak memory; EasyEdit's
                    one edit
  real              SmolLM2-135M-shaped, f32 and bf16: EasyEdit's EditTrainer (llama-7b.yaml on
                    blocks 27-29) against dualedit (configs/smollm2-135m.json): a step and an edit
  vl2b              Qwen2-VL-2B-shaped: the single-device step, both tools
  vl7b_edit         one edit on the 7B shape with dualedit (its editor from vl7b's run), against
                    EasyEdit's edit measured in vl7b

Time per record: EasyEdit's mean over --steps timed train_step calls (one record each; its
optimiser steps every accumulate_bs records, which the steps cover) after --warmup; dualedit's
mean of its report's per-step wall times after the first step, divided by the records each step
accumulates (set to EasyEdit's accumulate_bs). Peaks: the CUDA allocator's (EasyEdit from
reset before its steps; dualedit's report, the whole run); on a CPU the process RSS, where
the ratios mean little. Ratios are dualedit / EasyEdit.

The JSON's "markdown" is the side-by-side table of docs/notebook/gpu.md (one row per
measurement, both tools and the ratio); `dualedit report merge` also reads each EasyEdit run
(easyedit-runs/*.json) beside dualedit's own reports (runs/*.json) as rows of one table.
"""
import argparse
import json
import math
import os
import re
import shutil
import statistics
import sys
import tarfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import check as gpu_check  # noqa: E402  (the step machinery and the picture writer)

ROOT = gpu_check.ROOT
FORMAT = "dualedit-gpu-versus/1"
GOALS = {"single_peak": 0.6, "split_main_peak": 0.3, "time": 0.7}
# The measurement steps, in the order they run, and the model kind each needs.
MODEL_OF = {"vl7b": "qwen2vl-7b", "real": "smollm2-135m", "vl7b_edit": "qwen2vl-7b", "vl2b": "qwen2vl-2b"}


class Versus(gpu_check.Check):
    def __init__(self, args):
        super().__init__(args)
        self.result.update(format=FORMAT, goals=GOALS)

    # -- setup -----------------------------------------------------------------------------

    def easyedit(self, rec):
        dest = self.work / "easyedit"
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        archive = self.args.easyedit_archive
        if not archive.is_file():
            raise RuntimeError(f"{archive} missing: run scripts/gpu/easyedit_env.sh here and carry .easyedit")
        with tarfile.open(archive) as t:
            t.extractall(dest, filter="data")
        self.ee_root, self.ee_site = dest / "EasyEdit", dest / "site"
        info = self.ee_root / "EASYEDIT-INFO"
        rec["info"] = dict(l.split("=", 1) for l in info.read_text().splitlines() if "=" in l)
        if self.args.tools == "dualedit":
            return  # unpacked for the real model's config and tokenizer only
        t = time.monotonic()
        self.run([self.args.python, "-c", "import easyeditor"], env=self.ee_env(), timeout=180)
        rec["import_seconds"] = round(time.monotonic() - t, 1)

    def ee_env(self):
        path = [str(self.ee_root), str(self.ee_site)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
        return {"PYTHONPATH": ":".join(path), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}

    def write_models(self, rec):
        like = self.work / "easyedit" / "smollm2"
        if not (like / "config.json").is_file():
            like = ROOT / "data/real/model"
        kinds = [("qwen2vl-7b", "bf16"), ("qwen2vl-2b", "bf16"), ("smollm2-135m", "f32"), ("smollm2-135m", "bf16")]
        # Only the models the measurement steps run need writing.
        wanted = {MODEL_OF[s] for s in self.args.only or MODEL_OF}
        kinds = [k for k in kinds if k[0] in wanted]
        rec["models"] = {}
        for kind, dtype in kinds:
            # EasyEdit's MEND picks its LLaMA forward by "llama" in the folder's path.
            name = f"{kind}-llama-{dtype}" if kind.startswith("smollm2") else f"{kind}-{dtype}"
            out = self.work / "models" / name
            argv = [self.args.python, ROOT / "scripts/gpu/random_models.py", "--kind", kind, "--out", out, "--dtype", dtype]
            if kind.startswith("smollm2"):
                argv += ["--like", like]
            if self.args.small:
                argv.append("--small")
            try:
                _, so, _ = self.run(argv)
                rec["models"][name] = json.loads(so.strip().splitlines()[-1])
                self.models[name] = {"dir": out, "dtype": dtype, "family": "text" if kind.startswith("smollm2") else "vl",
                                     "layers": self.last_blocks(out)}
            except Exception as e:
                rec["models"][name] = {"error": str(e)}
        missing = [k for k in rec["models"] if k not in self.models]
        if missing:
            raise RuntimeError(f"not written: {', '.join(missing)}")

    @staticmethod
    def last_blocks(model_dir):
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        n = (cfg.get("text_config") or cfg)["num_hidden_layers"]
        return [n - 3, n - 2, n - 1]

    def write_data(self, rec):
        super().write_data(rec)
        # A few records are all a timed run reads (warm-up + timed steps; the edits).
        records = json.loads((self.vl_world / "vqa-train.json").read_text())
        self.vl_records = self.work / "vqa-records.json"
        self.vl_records.write_text(json.dumps(records[:12]))
        self.vl_edits = self.work / "vqa-edits.json"
        self.vl_edits.write_text(json.dumps(records[:4]))
        self.facts = ROOT / "data/real/facts.json"
        rec.update(vl_records=12, facts=str(self.facts.relative_to(ROOT)))

    # -- one tool, one measurement ---------------------------------------------------------

    def easyedit_run(self, model, steps, warmup):
        m = self.models[model]
        out = self.work / "easyedit-runs" / f"{model}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        argv = [self.args.python, ROOT / "scripts/gpu/easyedit_mend.py", "--easyedit", self.ee_root, "--family", m["family"],
                "--model", m["dir"], "--device", self.args.device, "--steps", steps, "--warmup", warmup, "--out", out,
                "--layers", ",".join(map(str, m["layers"]))]
        argv += ["--data", self.vl_records, "--image-root", self.vl_world] if m["family"] == "vl" else ["--data", self.facts]
        if self.args.small:
            argv += ["--rank", 16]
        rc, _, se = self.run(argv, env=self.ee_env(), expect_fail=True)
        if not out.is_file():
            raise RuntimeError(f"easyedit_mend.py wrote nothing (exit {rc}): {gpu_check.last_error(se)}")
        r = json.loads(out.read_text())
        if r.get("error"):
            r["failed_in"] = r.get("phase")
        return r

    def dualedit_config(self, model, accumulate, optimizer_steps):
        """The repository's preset for the model (EasyEdit's hyperparameters), on the model's
        last three blocks, run for `optimizer_steps` steps of `accumulate` records."""
        m = self.models[model]
        preset = "qwen2vl-7b.json" if m["family"] == "vl" else "smollm2-135m.json"
        cfg = json.loads((ROOT / "configs" / preset).read_text())
        theirs = sorted({int(re.search(r"\.layers\.(\d+)\.", n).group(1)) for n in cfg["edit_params"]})
        to = dict(zip(theirs, m["layers"]))
        cfg["edit_params"] = [re.sub(r"\.layers\.(\d+)\.", lambda x: f".layers.{to[int(x.group(1))]}.", n) for n in cfg["edit_params"]]
        cfg.update(max_steps=optimizer_steps, accumulate=accumulate, batch_size=1, val_every=10**6, val_records=1,
                   max_length=64 if m["family"] == "vl" else 32)
        if self.args.small:
            cfg["rank"] = 16
        path = self.work / f"config-{model}-{accumulate}x{optimizer_steps}.json"
        path.write_text(json.dumps(cfg))
        return path

    def data_args(self, model, requests=False):
        m = self.models[model]
        if m["family"] == "vl":
            return ["--requests" if requests else "--data", self.vl_edits if requests else self.vl_records, "--ds", "vqa", "--image-root", self.vl_world]
        return ["--requests" if requests else "--data", self.facts, "--ds", "counterfact"]

    def dualedit_train(self, model, name, accumulate, timed_records, devices):
        steps = 1 + max(1, math.ceil(timed_records / accumulate))
        cfg = self.dualedit_config(model, accumulate, steps)
        out = self.work / "runs" / name
        shutil.rmtree(out, ignore_errors=True)
        report = self.work / "runs" / f"{name}.json"
        m = self.models[model]
        # A label ending "-synced" waits for the GPU at each phase's start and end, so the
        # report's timeline gives each phase its device time (and the step some waiting).
        env = {"DUALEDIT_SYNC_SPANS": "1"} if name.endswith("-synced") else None
        rc, _, se = self.dualedit("train", "--model", m["dir"], *self.data_args(model), "--config", cfg, "--out", out,
                                  "--dtype", m["dtype"], "--seed", "1", *devices, "--report", report, expect_fail=True, env=env)
        if rc != 0:
            return {"error": gpu_check.last_error(se)}
        rep = json.loads(report.read_text())
        hist = rep["metrics"]["history"]
        timed = [h["seconds"] for h in hist[1:]]
        mem = {role: v["peak_allocated_bytes"] for role, v in rep["memory"].items()}
        return {"devices": " + ".join([rep["devices"]["main"]] + ([rep["devices"]["sub"]] if rep["devices"]["split"] else [])),
                "placement": rep["devices"].get("placement"), "optimizer_device": rep["devices"].get("optimizer_device"),
                "record_seconds": round(sum(timed) / (len(timed) * accumulate), 4) if timed else None,
                "step_seconds": [round(h["seconds"], 4) for h in hist], "accumulate": accumulate, "peak_bytes": mem,
                "loss": [h["loss"] for h in hist], "editor_dir": str(out), "seconds": rep["seconds"],
                "phase_seconds": ((rep.get("metrics") or {}).get("timeline") or {}).get("summary", {}).get("phase_s")}

    def dualedit_edit(self, model, editor, name):
        """Time per edit once warm: `edit --sequential` reports the mean over its requests,
        the first of which pays one-off costs, so it runs with 1 and with 5 requests and
        takes the difference (5 m5 - m1) / 4. Where noise outweighs the first request's
        one-off cost the difference is not positive and says nothing: the mean of 5 (an upper
        bound) is taken instead, and `edit_seconds_is` says which. The peak is the 5-request run's.
        A third run edits the first request 5 times: against the mean of 5 different ones it
        tells a cost per new shape (sequence length) from a cost per edit."""
        m = self.models[model]
        records = json.loads((self.vl_edits if m["family"] == "vl" else self.facts).read_text())
        runs = {}
        for n in (1, 5, "5-same"):
            reqs = self.work / f"{name}-requests-{n}.json"
            reqs.write_text(json.dumps([records[i % len(records)] for i in range(n)] if n != "5-same" else [records[0]] * 5))
            report = self.work / "runs" / f"{name}-{n}.json"
            data = ["--requests", reqs, "--ds", "vqa", "--image-root", self.vl_world] if m["family"] == "vl" else ["--requests", reqs, "--ds", "counterfact"]
            rc, _, se = self.dualedit("edit", "--model", m["dir"], "--editor", editor, *data, "--method", "mend", "--no-guard", "--sequential",
                                      "--dtype", m["dtype"], "--device", self.args.device, "--report", report, expect_fail=True)
            if rc != 0:
                return {"error": gpu_check.last_error(se)}
            runs[n] = json.loads(report.read_text())
        m1, m5 = runs[1]["metrics"]["seconds_per_edit"], runs[5]["metrics"]["seconds_per_edit"]
        warm = (5 * m5 - m1) / 4
        secs, how = (warm, "(5 x mean of 5 - mean of 1) / 4") if warm > 0 else (m5, "mean of 5 (the difference was not positive)")
        return {"edit_seconds": round(secs, 6), "edit_seconds_is": how, "mean_of_1": m1, "mean_of_5": m5,
                "mean_of_5_same": runs["5-same"]["metrics"]["seconds_per_edit"],
                "peak_bytes": {role: v["peak_allocated_bytes"] for role, v in runs[5]["memory"].items()}}


    def pair(self, rec, model, prefix, placements):
        m = self.models.get(model)
        if not m:
            raise gpu_check.Skip(f"{model} not written")
        # Whole optimiser steps of EasyEdit's accumulate_bs (its yaml's: 2 for Qwen2-VL, 10
        # for LLaMA) are timed, so both tools' means include their optimiser updates alike.
        yaml = self.ee_root / "hparams/TRAINING/MEND" / ("qwen2vl-7b.yaml" if m["family"] == "vl" else "llama-7b.yaml")
        acc = int(re.search(r"^accumulate_bs:\s*(\d+)", yaml.read_text(), re.M).group(1))
        steps = acc * max(1, math.ceil(self.args.steps / acc))
        ee = self.easyedit_run(model, steps, self.args.warmup) if self.args.tools != "dualedit" else {}
        rec["easyedit"] = ee
        if self.args.tools == "easyedit":
            placements = []
        rec["dualedit"] = {}
        for label, devices in placements:
            rec["dualedit"][label] = self.dualedit_train(model, f"{prefix}-{label}", acc, steps, devices)
            self.save()
        rec["model"] = model
        if ee.get("error"):
            raise RuntimeError(f"EasyEdit failed in {ee.get('failed_in')}: {ee['error']}")
        bad = [k for k, d in rec["dualedit"].items() if d.get("error")]
        if bad:
            raise RuntimeError("dualedit failed: " + ", ".join(k + ": " + rec["dualedit"][k]["error"] for k in bad))

    def vl7b(self, rec):
        # One GPU; one GPU with the Adam moments in host memory (its phases timed on the
        # GPU, see dualedit_train); the CPU as sub-device under a cap on the GPU that
        # leaves it 0.3x EasyEdit's peak (the balance then puts the blocks where the cap
        # says), the optimiser on the CPU too.
        one = ["--device", self.args.device]
        split = [*one, "--sub-device", self.args.sub, "--placement", "balanced", "--optimizer-device", "sub",
                 "--max-memory", f"{self.args.device}={self.args.split_cap}"]
        self.pair(rec, "qwen2vl-7b-bf16", "qwen2vl-7b", [("single", one), ("single-opt-cpu-synced", [*one, "--optimizer-device", "cpu"]),
                                                         ("capped-split", split)])

    def vl2b(self, rec):
        self.pair(rec, "qwen2vl-2b-bf16", "qwen2vl-2b", [("single", ["--device", self.args.device])])

    def real(self, rec):
        failures = []
        for dtype in ("f32", "bf16"):
            model = f"smollm2-135m-llama-{dtype}"
            sub = rec.setdefault(dtype, {})
            try:
                self.pair(sub, model, f"smollm2-135m-{dtype}", [("single", ["--device", self.args.device])])
            except Exception as e:
                sub["error"] = str(e)
                failures.append(f"{dtype}: {e}")
            d = (sub.get("dualedit") or {}).get("single") or {}
            if d.get("editor_dir") and self.args.tools != "easyedit":
                sub["dualedit_edit"] = self.dualedit_edit(model, d["editor_dir"], f"smollm2-{dtype}-edit")
            self.save()
        if failures:
            raise RuntimeError("; ".join(failures))

    def vl7b_edit(self, rec):
        d = ((self.result["steps"].get("vl7b") or {}).get("dualedit") or {}).get("single") or {}
        if not d.get("editor_dir") or self.args.tools == "easyedit":
            raise gpu_check.Skip("needs vl7b's single-device editor (and --tools both or dualedit)")
        e = rec["dualedit"] = self.dualedit_edit("qwen2vl-7b-bf16", d["editor_dir"], "qwen2vl-7b-edit")
        if e.get("error"):
            raise RuntimeError(e["error"])

    def main(self):
        self.step("environment", self.environment, 120)
        self.step("easyedit", self.easyedit, 200)
        self.step("models", self.write_models, 240)
        self.step("data", self.write_data, 60)
        for name, f, timeout in [("vl7b", self.vl7b, 300), ("real", self.real, 200), ("vl7b_edit", self.vl7b_edit, 90), ("vl2b", self.vl2b, 150)]:
            if not self.args.only or name in self.args.only:
                self.step(name, f, timeout)
        finish(self.result)
        self.save()
        return 0


def steps_list(v):
    """`--only`'s value: known step names, comma-separated."""
    names = v.split(",")
    unknown = [n for n in names if n not in MODEL_OF]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown step {', '.join(unknown)} (steps: {', '.join(MODEL_OF)})")
    return names


def row(what, dual, ee, kind):
    """One row of that table: dualedit's number against EasyEdit's, and their ratio."""
    ratio = round(dual / ee, 3) if isinstance(dual, (int, float)) and isinstance(ee, (int, float)) and ee else None
    return {"measurement": what, "kind": kind, "dualedit": dual, "easyedit": ee, "ratio": ratio}


def rows(steps):
    """The rows from the steps' records (also for --combine: one run's dualedit side
    beside another run's EasyEdit side)."""
    out = []

    def step_rows(rec):
        ee = rec.get("easyedit") or {}
        model = rec.get("model") or ee.get("model", "?").rsplit("/", 1)[-1]
        ee_train = ee.get("train") or {}
        for label, d in (rec.get("dualedit") or {}).items():
            if d.get("error"):
                continue
            out.append(row(f"{model} step, dualedit {label}: time per record", d["record_seconds"], ee_train.get("mean_step_seconds"), "seconds"))
            out.append(row(f"{model} step, dualedit {label}: main-device peak", d["peak_bytes"].get("main"), ee_train.get("peak_bytes"), "bytes"))
            if " + " in d.get("devices", "") and "sub" in d["peak_bytes"]:
                out.append(row(f"{model} step, dualedit {label}: sub-device peak", d["peak_bytes"]["sub"], ee_train.get("peak_bytes"), "bytes"))

    def edit_rows(model, e, ee):
        e, ee = e or {}, ee or {}
        out.append(row(f"{model} one edit: time", e.get("edit_seconds"), ee.get("seconds"), "seconds"))
        out.append(row(f"{model} one edit: peak", (e.get("peak_bytes") or {}).get("main"), ee.get("peak_bytes"), "bytes"))

    if steps.get("vl7b"):
        step_rows(steps["vl7b"])
        edit_rows("qwen2vl-7b-bf16", (steps.get("vl7b_edit") or {}).get("dualedit"), (steps["vl7b"].get("easyedit") or {}).get("edit"))
    for dtype in ("f32", "bf16"):
        sub = (steps.get("real") or {}).get(dtype)
        if sub:
            step_rows(sub)
            edit_rows(f"smollm2-135m-llama-{dtype}", sub.get("dualedit_edit"), (sub.get("easyedit") or {}).get("edit"))
    if steps.get("vl2b"):
        step_rows(steps["vl2b"])
    return out


def finish(result):
    statuses = [s["status"] for s in result["steps"].values()]
    result["summary"] = {k: statuses.count(k) for k in ("ok", "failed", "skipped")}
    result["rows"] = rows(result["steps"])
    result["markdown"] = markdown(result)


def combine(dual_path, ee_path, out):
    """One JSON from two runs of this script on the same kind of machine: the dualedit side
    of `dual_path` (a run whose EasyEdit side failed) and the EasyEdit side of `ee_path`
    (a `--tools easyedit` rerun). Both runs are kept whole under "runs"."""
    dual, ee = json.loads(Path(dual_path).read_text()), json.loads(Path(ee_path).read_text())
    steps = json.loads(json.dumps(dual["steps"]))
    for name in ("vl7b", "vl2b"):
        if name in steps and name in ee["steps"]:
            steps[name]["easyedit"] = ee["steps"][name].get("easyedit")
            steps[name]["model"] = steps[name].get("model") or ee["steps"][name].get("model")
    for dtype in ("f32", "bf16"):
        if dtype in (steps.get("real") or {}) and dtype in (ee["steps"].get("real") or {}):
            steps["real"][dtype]["easyedit"] = ee["steps"]["real"][dtype].get("easyedit")
    result = {"format": FORMAT, "combined_from": [str(dual_path), str(ee_path)], "goals": GOALS, "steps": steps,
              "runs": {"dualedit_side": dual, "easyedit_side": ee}}
    finish(result)
    result["summary"] = {"dualedit_side": dual.get("summary"), "easyedit_side": ee.get("summary")}
    Path(out).write_text(json.dumps(result, indent=2) + "\n")
    print(result["markdown"])


def fmt(v, kind):
    if v is None:
        return "-"
    return f"{v / 1e9:.2f} GB" if kind == "bytes" else f"{v * 1e3:.1f} ms"


def markdown(result):
    """The table's rows: one per measurement, dualedit against EasyEdit and the ratio."""
    lines = ["| measurement | dualedit | EasyEdit | ratio |", "| --- | --- | --- | --- |"]
    for r in result["rows"]:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}×"
        lines.append(f"| {r['measurement']} | {fmt(r['dualedit'], r['kind'])} | {fmt(r['easyedit'], r['kind'])} | {ratio} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("gpu-versus.json"))
    ap.add_argument("--bin", type=Path, default=Path(os.environ.get("DUALEDIT_BIN", ROOT / "target/gpu-2.11.0/dualedit")))
    ap.add_argument("--device", default=os.environ.get("DEVICE", "cuda:0"))
    ap.add_argument("--sub", default=os.environ.get("SUB", "cpu"))
    ap.add_argument("--image", type=gpu_check.parse_size, default=None, help="WxH of the pictures (default 448x448; --small 84x84)")
    ap.add_argument("--small", action="store_true", help="test-size models, rank 16 (the CPU dry run)")
    ap.add_argument("--steps", type=int, default=4, help="timed records per measurement (at least EasyEdit's accumulate_bs)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--tools", choices=["both", "easyedit", "dualedit"], default="both",
                    help="run one tool's side alone (a rerun of the side that failed; the rows then need the other JSON)")
    ap.add_argument("--easyedit-archive", type=Path, default=ROOT / ".easyedit/easyedit-env.tar.xz")
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--python", default=os.environ.get("PYTHON", sys.executable))
    ap.add_argument("--budget", type=float, default=480.0)
    ap.add_argument("--only", type=steps_list, default=None, help=f"measurement steps to run ({','.join(MODEL_OF)}; default all)")
    ap.add_argument("--split-cap", default="10GiB", help="the GPU's --max-memory in the capped split (vl7b)")
    ap.add_argument("--timeout-scale", type=float, default=1.0)
    ap.add_argument("--combine", nargs=2, type=Path, metavar=("DUALEDIT_SIDE", "EASYEDIT_SIDE"),
                    help="no run: merge two JSONs of this script (a run and a --tools easyedit rerun) into --out")
    args = ap.parse_args()
    if args.combine:
        return combine(*args.combine, args.out)
    args.image = args.image or ([84, 84] if args.small else [448, 448])
    args.chain, args.dtype, args.models = None, "bf16", "transformers"
    args.bin = args.bin.resolve() if args.bin.exists() else args.bin
    if not Path(args.bin).is_file():
        sys.exit(f"gpu/versus: the dualedit binary {args.bin} does not exist (--bin or DUALEDIT_BIN)")
    args.out = args.out.resolve()
    args.work = (args.work or args.out.with_name(args.out.stem + ".work")).resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    args.device_canonical = "cuda:0" if args.device == "cuda" else args.device
    return Versus(args).main()


if __name__ == "__main__":
    sys.exit(main())
