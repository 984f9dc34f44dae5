"""The overhead of a Python `Session.edit` over the CLI's edit, on the same request.

Compared: the in-process edit time, model load excluded, of
  * the CLI: `dualedit edit --requests F --json`'s report `seconds.edit` (the library's
    `Session::edit_examples` call: guard, the edit, its measurement, the answers), one
    process per run;
  * Python: wall time around `session.edit(records)` (records -> JSON -> parse ->
    tokenise -> the same `edit_examples` -> report JSON -> dict), the session opened once
    and reset between runs.
Runs alternate CLI / Python; medians are reported.

    python python/bench/edit_overhead.py [--records N] [--runs R] [--bin target/release/dualedit]
"""

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import dualedit

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=10)
    ap.add_argument("--runs", type=int, default=15)
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
    s = dualedit.Session(a.model, a.editor, device=a.device)
    s.edit(records)  # warm-up (first-call allocations)
    s.reset()
    cli, py = [], []
    for i in range(a.runs):
        report = tmp / f"r{i}.json"
        out = subprocess.run([a.bin, "edit", "--model", a.model, "--editor", a.editor, "--requests", str(req), "--device", a.device,
                              "--json", "--report", str(report)], capture_output=True, text=True, check=True)
        cli.append(json.loads(report.read_text())["seconds"]["edit"])
        t0 = time.perf_counter()
        got = s.edit(records)
        py.append(time.perf_counter() - t0)
        s.reset()
        want = json.loads(out.stdout)
        assert [r["reliability"] for r in got["requests"]] == [r["reliability"] for r in want["requests"]]
    mc, mp = statistics.median(cli), statistics.median(py)
    print(json.dumps({
        "records": a.records, "runs": a.runs, "device": a.device,
        "cli_edit_s_median": mc, "python_edit_s_median": mp,
        "overhead_pct": 100 * (mp - mc) / mc,
        "cli_edit_s": cli, "python_edit_s": py,
    }, indent=1))


if __name__ == "__main__":
    main()
