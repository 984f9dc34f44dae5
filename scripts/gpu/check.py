#!/usr/bin/env python3
"""The GPU check (issue #38): one command, one JSON, every step with its own timeout.

  DEVICE=cuda:0 SUB=cpu scripts/gpu/check.py --out gpu-check.json          # on a GPU machine
  DEVICE=cpu SUB=cpu:1 scripts/gpu/check.py --small --out check.json       # CI, on CPU

Steps (each records "status": ok | failed | skipped, its commands, seconds and, when it
failed, the error; a failed step never stops the check):
  environment            the binary, its build info, the torch and GPU beside it
  models                 random-weight models written by this machine's transformers
                         (scripts/gpu/random_models.py): GPT-2 124M, Qwen2-VL-2B- and 7B-shaped,
                         in --dtype (bf16); --small: the same families at test size, or the
                         committed fixtures when transformers is not importable (recorded)
  data                   the text world (data/world) and a visual world whose images are
                         replaced by IMAGE×IMAGE pictures (448×448; --small 84×84)
  planner_vs_allocator   per model (text default in f32, GPT-2 and Qwen2-VL-2B in --dtype):
                         `dualedit plan` against one meta-training step's measured peak on DEVICE
  single_vs_balanced     `dualedit compare train` single DEVICE vs DEVICE + SUB balanced, and
                         balanced with the optimiser's state on SUB: main-device peak ratio,
                         wall times, whether losses agree within the dtype's tolerance
  chain                  `dualedit compare train` single DEVICE vs the layer split over a chain
                         DEVICE + CHAIN (#38; default cpu:1,cpu:2 on a CPU, cpu,cpu:1 beside a
                         GPU: three devices): whether losses agree, each device's peak, what
                         each crossing carried
  max_memory_cap         a `--max-memory DEVICE=CAP` between the balanced main peak and the
                         single peak: single runs out of memory with the diagnosis, which
                         names a placement that fits the cap (a GPU), the split completes. A CPU cannot be capped: there the out-of-memory is injected
                         (DUALEDIT_FAULT_OOM_STEP, builds with the fault-injection feature) and
                         the record says so
  qwen2vl_7b_step        Qwen2-VL-7B-shaped, --dtype, one IMAGE×IMAGE image: one meta-training
                         step's peak on DEVICE against the plan and the seed's ~40 GB
  qwen2vl_7b_split       the same step split over DEVICE + SUB (balanced): the main peak
                         against the plan and the single run's

The JSON is rewritten after every step (atomically), so a run stopped from outside still
leaves what it measured.
"""
import argparse
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SEED_7B_BYTES = 40e9  # the seed's (EasyEdit MEND) Qwen2-VL-7B meta-training on one device: ~40 GB
FORMAT = "dualedit-gpu-check/1"


def now():
    return time.monotonic()


class Check:
    def __init__(self, args):
        self.args = args
        self.start = now()
        self.work = args.work
        self.result = {
            "format": FORMAT,
            "small": args.small,
            "device": args.device,
            "sub_device": args.sub,
            "chain": args.chain,
            "dtype": args.dtype,
            "image_size": args.image,
            "budget_seconds": args.budget,
            "started_unix": int(time.time()),
            "steps": {},
        }
        self.models = {}

    # -- bookkeeping ---------------------------------------------------------------------

    def save(self):
        self.result["seconds"] = round(now() - self.start, 1)
        out = self.args.out
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(self.result, indent=2, sort_keys=False) + "\n")
        os.replace(tmp, out)

    def left(self):
        return self.args.budget - (now() - self.start)

    def step(self, name, fn, timeout):
        rec = {"status": "running", "commands": []}
        self.result["steps"][name] = rec
        self.save()
        t = now()
        self.current = rec
        self.deadline = t + max(1.0, min(timeout * self.args.timeout_scale, self.left()))
        try:
            if self.left() <= 1:
                raise Skip("no time left in the check's budget (--budget)")
            fn(rec)
            rec["status"] = "ok"
        except Skip as e:
            rec["status"] = "skipped"
            rec["reason"] = str(e)
        except Exception as e:  # recorded, never fatal: the check goes on
            rec["status"] = "failed"
            rec["error"] = str(e)
        rec["seconds"] = round(now() - t, 1)
        print(f"[gpu/check] {name}: {rec['status']} ({rec['seconds']} s){': ' + rec.get('error', rec.get('reason', '')) if rec['status'] != 'ok' else ''}",
              file=sys.stderr, flush=True)
        self.save()

    def run(self, argv, env=None, expect_fail=False, timeout=None):
        """Runs a command under the current step's deadline; returns (rc, stdout, stderr)."""
        left = self.deadline - now()
        if timeout is not None:
            left = min(left, timeout)
        if left <= 0:
            raise RuntimeError(f"step timeout before running {argv[0]}")
        cmd = {"argv": [str(a) for a in argv]}
        self.current["commands"].append(cmd)
        t = now()
        full_env = dict(os.environ, **(env or {}))
        try:
            p = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=left, env=full_env, cwd=ROOT)
        except subprocess.TimeoutExpired:
            cmd.update(rc=None, seconds=round(now() - t, 1), timed_out=True)
            raise RuntimeError(f"timed out after {left:.0f} s: {' '.join(cmd['argv'][:3])} ...")
        cmd.update(rc=p.returncode, seconds=round(now() - t, 2))
        if p.returncode != 0:
            cmd["stderr_tail"] = p.stderr[-1500:]
            if not expect_fail:
                raise RuntimeError(f"exit {p.returncode}: {last_error(p.stderr)}")
        return p.returncode, p.stdout, p.stderr

    def dualedit(self, *args, **kw):
        return self.run([self.args.bin, *args], **kw)

    # -- steps ---------------------------------------------------------------------------

    def environment(self, rec):
        _, out, _ = self.dualedit("--version")
        rec["binary"] = str(self.args.bin)
        rec["version"] = out.strip()
        info = Path(self.args.bin).with_name("BUILD-INFO")
        if info.is_file():
            rec["build_info"] = dict(l.split("=", 1) for l in info.read_text().splitlines() if "=" in l)
        rc, out, _ = self.run([self.args.python, "-c", "import torch, json; print(json.dumps({'torch': torch.__version__, "
                              "'cuda': torch.version.cuda, 'gpus': [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}))"],
                              expect_fail=True, timeout=120)
        rec["python_torch"] = json.loads(out) if rc == 0 and out.strip() else None
        if shutil.which("nvidia-smi"):
            rc, out, _ = self.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"], expect_fail=True, timeout=30)
            rec["nvidia_smi"] = out.strip().splitlines() if rc == 0 else None

    def write_models(self, rec):
        # The text default needs nothing written.
        self.models["default"] = {"dir": ROOT / "data/model", "dtype": "f32", "family": "text", "source": "data/model"}
        kinds = ["gpt2-124m", "qwen2vl-2b", "qwen2vl-7b"]
        rec["models"] = {}
        rc, err = 0, ""
        if self.args.models != "fixtures":
            rc, _, err = self.run([self.args.python, "-c", "import transformers, torch"], expect_fail=True, timeout=120)
            if rc != 0 and (self.args.models == "transformers" or not self.args.small):
                raise RuntimeError(f"transformers is not importable by {self.args.python}: {last_error(err)}")
        if self.args.models == "fixtures" or rc != 0:
            # The committed fixtures (written by transformers, scripts/make_fixtures.py) stand
            # in for the small models: CI without transformers, or --models fixtures.
            why = "--models fixtures" if self.args.models == "fixtures" else f"transformers not importable ({last_error(err)})"
            why += ": committed fixtures used"
            stand_in = {"gpt2-124m": "tests/fixtures/gpt2", "qwen2vl-2b": "tests/fixtures/qwen2_vl", "qwen2vl-7b": "tests/fixtures/qwen2_vl"}
            for k in kinds:
                self.models[k] = {"dir": ROOT / stand_in[k], "dtype": self.args.dtype, "family": family(k), "source": stand_in[k]}
                rec["models"][k] = {"source": stand_in[k], "why": why}
            return
        for k in kinds:
            out = self.work / "models" / k
            argv = [self.args.python, ROOT / "scripts/gpu/random_models.py", "--kind", k, "--out", out, "--dtype", self.args.dtype]
            if self.args.small:
                argv.append("--small")
            try:
                _, so, _ = self.run(argv)
                rec["models"][k] = json.loads(so.strip().splitlines()[-1])
                self.models[k] = {"dir": out, "dtype": self.args.dtype, "family": family(k), "source": "random_models.py"}
            except Exception as e:
                rec["models"][k] = {"error": str(e)}
        missing = [k for k in kinds if k not in self.models]
        if missing:
            raise RuntimeError(f"not written: {', '.join(missing)}")

    def write_data(self, rec):
        # Text: the embedded world's CounterFact-shaped edits.
        self.text_data = ROOT / "data/world/edits-train.json"
        if not self.text_data.is_file():
            raise RuntimeError(f"{self.text_data} missing")
        world = self.work / "vl-world"
        shutil.rmtree(world, ignore_errors=True)
        self.dualedit("world", "--vl", "--out", world, "--image-size", "84x84", "--train-scenes", "3", "--holdout-scenes", "2", "--seed", "1")
        # The world draws at most 420 px (an odd number of 28-pixel cells): the pictures are
        # replaced by IMAGE×IMAGE ones under the same names, so every image view of the
        # records shows one of that size.
        w, h = self.args.image
        n = 0
        for folder in ("images", "images_rephrase"):
            for i, f in enumerate(sorted((world / folder).glob("*.png"))):
                write_png(f, w, h, seed=i + 17 * n)
                n += 1
        self.vl_world = world
        rec.update(text_data=str(self.text_data.relative_to(ROOT)), vl_world=str(world), images_replaced=n, image_size=[w, h])

    def config(self, name, max_length):
        """A one-step meta-training config: MEND's defaults (the last three MLPs, rank 1920;
        --small rank 16), one record per step, validation on one record."""
        cfg = {"rank": 16 if self.args.small else 1920, "max_steps": 1, "batch_size": 1, "accumulate": 1,
               "val_every": 1000, "val_records": 1, "early_stop_patience": 5, "max_length": max_length}
        path = self.work / f"config-{name}.json"
        path.write_text(json.dumps(cfg))
        return path

    def train_args(self, key, cfg, out):
        m = self.models[key]
        if m["family"] == "vl":
            data = ["--data", self.vl_world / "vqa-train.json", "--ds", "vqa", "--image-root", self.vl_world]
        else:
            data = ["--data", self.text_data, "--ds", "counterfact"]
        return ["train", "--model", m["dir"], *data, "--config", cfg, "--out", out, "--dtype", m["dtype"], "--seed", "1"]

    def length(self, key):
        """Tokens per example: the text records fit 32; the visual world's questions 64 with
        data/vl/model's tokenizer, 128 with the fixture's (which splits them finer)."""
        m = self.models[key]
        if m["family"] == "text":
            return self.text_len
        return 64 if m["source"] == "random_models.py" else 128

    def plan_args(self, key, cfg):
        m = self.models[key]
        extra = ["--ds", "vqa", "--image-size", f"{self.args.image[0]}x{self.args.image[1]}", "--loc-length", str(self.text_len)] if m["family"] == "vl" else []
        return ["plan", "--model", m["dir"], "--config", cfg, "--dtype", m["dtype"], "--max-length", str(self.length(key)),
                "--kept-tokens", "8", *extra, "--json"]

    def planned_peak(self, key, cfg, devices):
        """The plan's meta-training peak on the main device (and, split, on the sub-device)."""
        _, out, _ = self.dualedit(*self.plan_args(key, cfg), *devices)
        v = json.loads(out)
        peaks = {t["device"]: t["peak_bytes"] for t in v["totals"] if t["phase"] == "train"}
        return peaks, v["shape"]

    def measured(self, key, name, devices, env=None, expect_fail=False, extra=()):
        cfg = self.config(key, self.length(key))
        out = self.work / "runs" / name
        shutil.rmtree(out, ignore_errors=True)
        report = self.work / "runs" / f"{name}.json"
        rc, so, se = self.dualedit(*self.train_args(key, cfg, out), *devices, *extra, "--report", report, env=env, expect_fail=expect_fail)
        if rc != 0:
            return {"rc": rc, "error": last_error(se), "diagnosis": se[-3000:]}, None
        rep = json.loads(report.read_text())
        mem = {role: m["peak_allocated_bytes"] for role, m in rep["memory"].items()}
        return {"rc": 0, "peak_bytes": mem, "seconds": rep["seconds"], "report": str(report),
                "loss": [h["loss"] for h in rep["metrics"].get("history", [])]}, cfg

    def planner_vs_allocator(self, rec):
        rec["models"] = {}
        failures = []
        for key in ("default", "gpt2-124m", "qwen2vl-2b"):
            if key not in self.models:
                rec["models"][key] = {"status": "skipped", "reason": "model not written"}
                failures.append(key)
                continue
            try:
                meas, cfg = self.measured(key, f"plan-{key}", ["--device", self.args.device])
                if meas["rc"] != 0:
                    raise RuntimeError(meas["error"])
                peaks, shape = self.planned_peak(key, cfg, ["--device", self.args.device])
                main = meas["peak_bytes"]["main"]
                planned = peaks[self.args.device_canonical]
                rec["models"][key] = {"status": "ok", "dtype": self.models[key]["dtype"], "parameters": shape["n_params"],
                                      "planned_bytes": planned, "measured_bytes": main, "planned_over_measured": round(planned / max(main, 1), 4),
                                      "measured_is": "process RSS" if self.args.device.startswith("cpu") else "CUDA allocator peak",
                                      "loss": meas["loss"], "seconds": meas["seconds"]}
            except Exception as e:
                rec["models"][key] = {"status": "failed", "error": str(e)}
                failures.append(key)
        if failures:
            raise RuntimeError(f"failed for {', '.join(failures)}")

    def compare_split(self, key, name, extra=()):
        """`dualedit compare train`: DEVICE alone against DEVICE + SUB balanced (+ extra flags)."""
        cfg = self.config(f"{name}-{key}", self.text_len)
        out = self.work / "runs" / name
        shutil.rmtree(out, ignore_errors=True)
        self.dualedit("compare", *self.train_args(key, cfg, out), "--device", self.args.device, "--sub-device", self.args.sub,
                      "--placement", "balanced", *extra)
        c = json.loads((out / "compare.json").read_text())
        peak = lambda side, role: side["memory"].get(role, {}).get("peak_allocated_bytes")
        return dict(placement=" ".join(["balanced", *extra]),
                    main_peak_ratio=round(c["main_peak_ratio"], 4), metrics_agree=c["metrics_agree"],
                    max_relative_difference=c["max_relative_difference"], tolerance=c.get("tolerance"),
                    single={"devices": c["single"]["devices"], "main_peak_bytes": peak(c["single"], "main"), "wall_seconds": round(c["single"]["wall_seconds"], 2)},
                    dual={"devices": c["dual"]["devices"], "main_peak_bytes": peak(c["dual"], "main"), "sub_peak_bytes": peak(c["dual"], "sub"),
                          "main_peak_reserved_bytes": c["dual"]["memory"].get("main", {}).get("peak_reserved_bytes"),
                          "wall_seconds": round(c["dual"]["wall_seconds"], 2)},
                    wall_ratio=round(c["dual"]["wall_seconds"] / max(c["single"]["wall_seconds"], 1e-9), 3))

    def single_vs_balanced(self, rec):
        key = "default" if self.args.small else "gpt2-124m"
        if key not in self.models:
            raise Skip(f"{key} not written")
        # The layer split alone, then with the optimiser's state on the sub-device too (the
        # placement the planner gives the smallest main peak when the editor dominates).
        runs = [self.compare_split(key, "compare"), self.compare_split(key, "compare-opt-sub", ["--optimizer-device", "sub"])]
        rec.update(model=key, dtype=self.models[key]["dtype"], placements=runs)
        # The cap step separates the single run from the split with the smaller main peak.
        self.balanced = dict(min(runs, key=lambda r: r["dual"]["main_peak_bytes"] or 0), model=key)
        bad = [r["placement"] for r in runs if not r["metrics_agree"]]
        if bad:
            raise RuntimeError(f"the split changed the losses beyond the dtype's tolerance: {', '.join(bad)}")

    def chain(self, rec):
        key = "default" if self.args.small else "gpt2-124m"
        if key not in self.models:
            raise Skip(f"{key} not written")
        cfg = self.config(f"chain-{key}", self.text_len)
        out = self.work / "runs" / "chain"
        shutil.rmtree(out, ignore_errors=True)
        self.dualedit("compare", *self.train_args(key, cfg, out), "--device", self.args.device, "--sub-device", self.args.chain,
                      "--placement", "balanced")
        c = json.loads((out / "compare.json").read_text())
        rep = json.loads((out / "dual" / "report.json").read_text())
        peaks = {role: m.get("peak_allocated_bytes") for role, m in c["dual"]["memory"].items()}
        rec.update(model=key, dtype=self.models[key]["dtype"], chain=self.args.chain, devices=rep["devices"],
                   metrics_agree=c["metrics_agree"], max_relative_difference=c["max_relative_difference"],
                   peak_bytes=peaks, crossings=rep["moved"].get("crossings", []),
                   wall_ratio=round(c["dual"]["wall_seconds"] / max(c["single"]["wall_seconds"], 1e-9), 3))
        if not c["metrics_agree"]:
            raise RuntimeError(f"the chain changed the losses (max relative difference {c['max_relative_difference']})")

    def max_memory_cap(self, rec):
        bal = getattr(self, "balanced", None)
        if not bal:
            raise Skip("needs single_vs_balanced's peaks")
        key = bal["model"]
        # The cap bounds what the caching allocator reserves: the split must be allowed its
        # reserved peak, the single run refused its allocated one.
        single, dual_main = bal["single"]["main_peak_bytes"], bal["dual"]["main_peak_bytes"]
        dual_reserved = max(bal["dual"].get("main_peak_reserved_bytes") or 0, dual_main)
        cap = int((single + dual_reserved) / 2)
        can_cap = not self.args.device.startswith("cpu")
        rec.update(model=key, cap_bytes=cap, single_peak_bytes=single, balanced_main_peak_bytes=dual_main,
                   balanced_main_reserved_bytes=dual_reserved, cap_enforced=can_cap)
        if dual_reserved >= single and can_cap:
            raise RuntimeError(f"the balanced main device reserves {dual_reserved} B at its peak, not below the single peak "
                               f"({single} B): no cap separates them")
        caps = ["--max-memory", f"{self.args.device}={cap}"]
        env = None
        if not can_cap:
            # The CPU allocator cannot be capped: inject the out-of-memory at step 0 instead.
            env = {"DUALEDIT_FAULT_OOM_STEP": "0"}
            rec["oom_source"] = "injected (DUALEDIT_FAULT_OOM_STEP=0): a CPU cannot be capped"
        else:
            rec["oom_source"] = "the CUDA caching allocator's cap"
        res, _ = self.measured(key, "cap-single", ["--device", self.args.device], env=env, expect_fail=True, extra=caps)
        diag = res.get("diagnosis", "")
        fit = re.search(r"would fit \(planner\): (.*)", diag)
        rec["single"] = {"completed": res["rc"] == 0, "out_of_memory": "out of memory" in diag.lower(),
                         "would_fit": fit.group(1) if fit else None, "diagnosis": diag[:2500] if diag else None}
        split = ["--device", self.args.device, "--sub-device", self.args.sub, *bal["placement"].replace("balanced", "--placement balanced", 1).split()]
        rec["placement"] = bal["placement"]
        res, _ = self.measured(key, "cap-balanced", split, expect_fail=True, extra=caps)
        rec["balanced"] = {"completed": res["rc"] == 0, "peak_bytes": res.get("peak_bytes"), "error": res.get("error")}
        if not rec["single"]["out_of_memory"]:
            raise RuntimeError("the single-device run under the cap did not run out of memory")
        if not rec["balanced"]["completed"]:
            raise RuntimeError(f"the balanced run under the cap failed: {rec['balanced']['error']}")
        if can_cap and not rec["single"]["would_fit"]:
            raise RuntimeError("the diagnosis names no placement that fits the cap, yet the split ran under it")

    def qwen2vl_7b_step(self, rec):
        key = "qwen2vl-7b"
        if key not in self.models:
            raise Skip("qwen2vl-7b not written")
        meas, cfg = self.measured(key, "vl7b", ["--device", self.args.device])
        if meas["rc"] != 0:
            raise RuntimeError(meas["error"])
        peaks, shape = self.planned_peak(key, cfg, ["--device", self.args.device])
        main, planned = meas["peak_bytes"]["main"], peaks[self.args.device_canonical]
        rec.update(model=key, dtype=self.models[key]["dtype"], parameters=shape["n_params"], image_size=self.args.image,
                   image_tokens=(shape.get("image") or {}).get("tokens") if isinstance(shape.get("image"), dict) else shape.get("image"),
                   measured_bytes=main, planned_bytes=planned, planned_over_measured=round(planned / max(main, 1), 4),
                   seed_bytes=SEED_7B_BYTES, measured_over_seed=round(main / SEED_7B_BYTES, 4), loss=meas["loss"],
                   seconds=meas["seconds"])

    def qwen2vl_7b_split(self, rec):
        """The seed's headline on one GPU: Qwen2-VL-7B's layer split with the CPU as the
        sub-device (the blocks from the planner's boundary run there)."""
        key = "qwen2vl-7b"
        single = self.result["steps"].get("qwen2vl_7b_step", {}).get("measured_bytes")
        if key not in self.models or not single:
            raise Skip("needs qwen2vl_7b_step's single-device peak")
        devices = ["--device", self.args.device, "--sub-device", self.args.sub, "--placement", "balanced"]
        meas, cfg = self.measured(key, "vl7b-split", devices)
        if meas["rc"] != 0:
            raise RuntimeError(meas["error"])
        peaks, _ = self.planned_peak(key, cfg, devices)
        main = meas["peak_bytes"]["main"]
        planned = peaks[self.args.device_canonical]
        rec.update(model=key, dtype=self.models[key]["dtype"], sub=self.args.sub, measured_main_bytes=main,
                   measured_sub=meas["peak_bytes"].get("sub"), planned_main_bytes=planned,
                   planned_over_measured=round(planned / max(main, 1), 4), main_over_single=round(main / single, 4),
                   loss=meas["loss"], seconds=meas["seconds"])

    def main(self):
        self.text_len = 32
        self.step("environment", self.environment, 180)
        self.step("models", self.write_models, 420)
        self.step("data", self.write_data, 60)
        self.step("planner_vs_allocator", self.planner_vs_allocator, 300)
        self.step("single_vs_balanced", self.single_vs_balanced, 240)
        self.step("max_memory_cap", self.max_memory_cap, 240)
        self.step("chain", self.chain, 240)
        self.step("qwen2vl_7b_step", self.qwen2vl_7b_step, 300)
        self.step("qwen2vl_7b_split", self.qwen2vl_7b_split, 200)
        statuses = [s["status"] for s in self.result["steps"].values()]
        self.result["summary"] = {k: statuses.count(k) for k in ("ok", "failed", "skipped")}
        self.save()
        return 0


class Skip(Exception):
    pass


def family(kind):
    return "vl" if kind.startswith("qwen2vl") else "text"


def last_error(stderr):
    lines = [l for l in stderr.strip().splitlines() if l.strip()]
    errs = [l for l in lines if l.lower().startswith("error")]
    return (errs or lines or ["(no output)"])[-1][:500]


def write_png(path, w, h, seed):
    """An RGB PNG (8-bit, no filter) of smooth colour bands: Python's standard library only."""
    rows = []
    for y in range(h):
        row = bytearray([0])
        for x in range(w):
            row += bytes(((x * 255 // w + seed * 37) % 256, (y * 255 // h + seed * 11) % 256, ((x + y) * 3 + seed * 53) % 256))
        rows.append(bytes(row))
    raw = zlib.compress(b"".join(rows), 6)

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)) + chunk(b"IDAT", raw) + chunk(b"IEND", b"")
    path.write_bytes(png)


def parse_size(s):
    m = re.fullmatch(r"(\d+)x(\d+)", s)
    if not m:
        raise argparse.ArgumentTypeError(f"{s!r} is not WIDTHxHEIGHT")
    return [int(m[1]), int(m[2])]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("gpu-check.json"), help="the JSON written")
    ap.add_argument("--bin", type=Path, default=Path(os.environ.get("DUALEDIT_BIN", ROOT / "target/gpu-2.11.0/dualedit")))
    ap.add_argument("--device", default=os.environ.get("DEVICE", "cuda:0"), help="main device (env DEVICE)")
    ap.add_argument("--sub", default=os.environ.get("SUB", "cpu"), help="sub-device of the split (env SUB)")
    ap.add_argument("--chain", default=os.environ.get("CHAIN"),
                    help="the chain's sub-devices (env CHAIN; default cpu:1,cpu:2 when --device is the CPU, else cpu,cpu:1)")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "f32"], help="dtype of the written models")
    ap.add_argument("--image", type=parse_size, default=None, help="WxH of the pictures (default 448x448; --small 84x84)")
    ap.add_argument("--small", action="store_true", help="test-size models and pictures (CI, on CPU)")
    ap.add_argument("--models", choices=["auto", "transformers", "fixtures"], default="auto",
                    help="who writes the models: transformers (random_models.py), the committed test fixtures (--small only), "
                         "or auto: transformers when importable, else (--small) the fixtures")
    ap.add_argument("--work", type=Path, default=None, help="scratch folder (default: beside --out)")
    ap.add_argument("--python", default=os.environ.get("PYTHON", sys.executable), help="python with torch + transformers")
    ap.add_argument("--budget", type=float, default=560.0, help="seconds for the whole check (each step gets at most what is left)")
    ap.add_argument("--timeout-scale", type=float, default=1.0, help="multiplies every step's own timeout")
    args = ap.parse_args()
    if args.models == "fixtures" and not args.small:
        sys.exit("gpu/check: --models fixtures stands in for the test-size models only (--small)")
    args.image = args.image or ([84, 84] if args.small else [448, 448])
    args.chain = args.chain or ("cpu:1,cpu:2" if args.device.startswith("cpu") else "cpu,cpu:1")
    args.bin = args.bin.resolve() if args.bin.exists() else args.bin
    if not Path(args.bin).is_file():
        sys.exit(f"gpu/check: the dualedit binary {args.bin} does not exist (--bin or DUALEDIT_BIN; scripts/gpu/build.sh builds it)")
    args.out = args.out.resolve()
    args.work = (args.work or args.out.with_name(args.out.stem + ".work")).resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    # The planner names CUDA devices "cuda:N" and the CPU "cpu" (cpu:N logical devices as given).
    args.device_canonical = "cuda:0" if args.device == "cuda" else args.device
    return Check(args).main()


if __name__ == "__main__":
    sys.exit(main())
