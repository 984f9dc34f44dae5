"""The overhead of a Python `Session.edit` over the CLI's edit, on the same request.

Each run, alternating, in fresh processes (both cold: first edit after the model load):
  * CLI: `dualedit edit --requests F --json`; its run report's `seconds.edit` is the
    library's `Session::edit_examples` call (guard, edit, measurement, answers), the
    records already read and tokenised, the model load excluded;
  * Python: `dualedit.Session(...)` then wall time around `session.edit(records)`
    (records -> JSON -> parse -> tokenise -> the same `edit_examples` -> report JSON ->
    dict), the load excluded; its report's `seconds.edit` is the same span as the CLI's.
Reported: medians of the CLI's `seconds.edit`, Python's wall time, and per Python run the
binding's own cost (wall - seconds.edit: JSON both ways, tokenising, the GIL release),
which the machine's load does not blur as it blurs two processes' times.

    python python/bench/edit_overhead.py [--records N] [--runs R] [--device cpu|cuda]
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, sys, time, dualedit
model, editor, req, device = sys.argv[1:5]
records = json.load(open(req))
s = dualedit.Session(model, editor, device=device)
t0 = time.perf_counter()
out = s.edit(records)
wall = time.perf_counter() - t0
print(json.dumps({"wall": wall, "edit": out["seconds"]["edit"], "reliability": [r["reliability"] for r in out["requests"]]}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=5)
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--bin", default=str(ROOT / "target" / "release" / "dualedit"))
    ap.add_argument("--model", default=str(ROOT / "data" / "model"))
    ap.add_argument("--editor", default=str(ROOT / "data" / "editor"))
    ap.add_argument("--requests", default=str(ROOT / "data" / "world" / "edits-holdout.json"))
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    records = json.loads(Path(a.requests).read_text())[: a.records]
    tmp = Path(tempfile.mkdtemp(prefix="dualedit-bench-"))
    req = tmp / "requests.json"
    req.write_text(json.dumps(records))
    cli, wall, inner = [], [], []
    for i in range(a.runs):
        report = tmp / f"r{i}.json"
        out = subprocess.run([a.bin, "edit", "--model", a.model, "--editor", a.editor, "--requests", str(req), "--device", a.device,
                              "--json", "--report", str(report)], capture_output=True, text=True, check=True)
        cli.append(json.loads(report.read_text())["seconds"]["edit"])
        py = subprocess.run([sys.executable, "-c", CHILD, a.model, a.editor, str(req), a.device], capture_output=True, text=True, check=True)
        p = json.loads(py.stdout.strip().splitlines()[-1])
        wall.append(p["wall"])
        inner.append(p["edit"])
        assert p["reliability"] == [r["reliability"] for r in json.loads(out.stdout)["requests"]], "different results"
    overhead = [w - e for w, e in zip(wall, inner)]
    mc, mw = statistics.median(cli), statistics.median(wall)
    print(json.dumps({
        "records": a.records, "runs": a.runs, "device": a.device,
        "cli_edit_s_median": mc, "python_wall_s_median": mw,
        "python_vs_cli_pct": 100 * (mw - mc) / mc,
        "python_inner_edit_s_median": statistics.median(inner),
        "binding_overhead_s_median": statistics.median(overhead),
        "binding_overhead_pct_median": 100 * statistics.median([o / e for o, e in zip(overhead, inner)]),
        "cli_edit_s": cli, "python_wall_s": wall, "python_inner_edit_s": inner,
    }, indent=1))


if __name__ == "__main__":
    main()
