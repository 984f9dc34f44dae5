"""The Python package against the CLI: run by `./x test` in a fresh virtualenv that has
`pip install .`-ed the package (see ./x), on the embedded defaults in data/.

The CLI binary is target/release/dualedit (or $DUALEDIT_BIN); tests that compare with it
run it on the same records and compare the numbers exactly, except the wall-clock times
and the floats of an edit (`same_edit`).

Why an edit's floats get a tolerance: within one process the same edit gives the same
bits every time (the reset tests here, serve's tests), but two processes need not. On two
cores, in about one `dualedit edit` run in 30 the capture's head gradient comes out with
other last bits from the same hidden states (traced by dumping each stage of 180 runs of
the CLI on data/model: 5 differed there and every later stage followed), which moves
`nll_post` by ~1e-6. `MKL_NUM_THREADS=1` made 80 of 80 runs equal (so MKL's threaded
products), but costs 40-60 % per edit on the real model; MKL's reproducibility modes
(`MKL_CBWR=AUTO`, `AUTO,STRICT`, the branch pinned) did not remove it.

The tolerance is relative (1e-5) and absolute (1e-6). The absolute part is for the small
differences among an edit's floats: a guard's KL is a mean of f32 log-prob differences,
resolved only to ~1e-7 nats whatever its size, so a KL of 8e-5 moved by 4e-9 (5e-5
relative) between two processes (CI, session 29 of #47's notebook), within f32's noise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dualedit

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data"
MODEL, EDITOR = DATA / "model", DATA / "editor"
VL = DATA / "vl"
BIN = Path(os.environ.get("DUALEDIT_BIN", ROOT / "target" / "release" / "dualedit"))
TEXT = "Vacorp was founded by Ledrerra"

# Wall-clock fields, the only ones allowed to differ between two runs.
TIMES = {"seconds_per_edit"}


def holdout(n: int, start: int = 0):
    return json.loads((DATA / "world" / "edits-holdout.json").read_text())[start : start + n]


def fresh(n: int, start: int = 0):
    """Requests with targets no editor was trained on, about facts the held-out set edits
    only once each: what many edits at once are measured on (edits-holdout.json gives the
    same facts conflicting targets, which a least-squares solve cannot all hold)."""
    return json.loads((ROOT / "tests" / "fixtures" / "many" / "fresh-50.json").read_text())[start : start + n]


def committed(report: dict) -> int:
    """How many of a report's requests the commit guard let through."""
    return report["n"] - report["refused"]


def cli(*args: str, tmp: Path) -> dict:
    if not BIN.exists():
        pytest.fail(f"{BIN} is missing: build it first (./x build) or set DUALEDIT_BIN")
    report = tmp / f"report-{len(list(tmp.iterdir()))}.json"
    r = subprocess.run([str(BIN), *args, "--json"] + (["--report", str(report)] if args[0] in ("edit", "eval") else []),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def eval_records(out: dict) -> list:
    """The per-record metrics of an `eval --json` run (in its report file)."""
    return json.loads(Path(out["report"]).read_text())["metrics"]["records"]


def same_edit(got, want, rel=1e-5, abs_=1e-6):
    """`got == want` for an edit's results from two processes: keys, strings, counts and
    decisions exactly, floats within `rel` or `abs_` (see the module's docstring). Returns
    the first path that differs, or None."""
    def walk(a, b, path):
        if isinstance(a, dict) and isinstance(b, dict):
            if a.keys() != b.keys():
                return f"{path}: keys {sorted(a)} != {sorted(b)}"
            return next((d for k in a if (d := walk(a[k], b[k], f"{path}.{k}"))), None)
        if isinstance(a, list) and isinstance(b, list):
            if len(a) != len(b):
                return f"{path}: {len(a)} items != {len(b)}"
            return next((d for i, (x, y) in enumerate(zip(a, b)) if (d := walk(x, y, f"{path}[{i}]"))), None)
        if isinstance(a, float) and isinstance(b, float):
            return None if a == pytest.approx(b, rel=rel, abs=abs_) else f"{path}: {a!r} != {b!r}"
        return None if (type(a), a) == (type(b), b) else f"{path}: {a!r} != {b!r}"
    return walk(without_times(got), without_times(want), "")


def without_times(v):
    if isinstance(v, dict):
        return {k: without_times(x) for k, x in v.items() if k not in TIMES}
    if isinstance(v, list):
        return [without_times(x) for x in v]
    return v


@pytest.fixture(scope="module")
def session():
    return dualedit.Session(MODEL, EDITOR)


def test_edit_score_reset_restores_the_score_exactly(session, tmp_path):
    before = session.score(TEXT)
    assert before.tensor.dtype == torch.float64 and before.tensor.shape == (len(before.tokens) - 1,)
    out = session.edit(holdout(2))
    assert out["n"] == 2 and out["edits_total"] == 2 and session.edits_total == 2
    assert [r["answer_after"].strip() for r in out["requests"]] == [r["target_new"] for r in holdout(2)]
    assert all(isinstance(r["answer_before"], str) and r["answer_before"] != r["answer_after"] for r in out["requests"]), out
    edited = session.score(TEXT)
    assert edited.logprobs != before.logprobs, "the edit changed nothing the score sees"
    # save() writes the edited model as a folder a new session loads, with the same scores.
    session.save(tmp_path / "edited")
    assert dualedit.Session(tmp_path / "edited").score(TEXT).logprobs == edited.logprobs
    assert session.memory()[0]["role"] == "main"
    assert session.reset() > 0 and session.edits_total == 0
    after = session.score(TEXT)
    assert after.logprobs == before.logprobs
    assert torch.equal(after.tensor, before.tensor)


def test_score_tensor_equals_the_cli_json(session, tmp_path):
    want = cli("score", "--model", str(MODEL), "--text", TEXT, tmp=tmp_path)
    got = session.score(TEXT)
    assert got.to_dict() == want
    assert torch.equal(got.tensor, torch.tensor(want["logprobs"], dtype=torch.float64))


@pytest.mark.parametrize("sequential", [False, True])
def test_session_edit_is_the_cli_edit_report(tmp_path, sequential):
    records = fresh(3, start=2)
    f = tmp_path / "requests.json"
    f.write_text(json.dumps(records))
    want = cli("edit", "--model", str(MODEL), "--editor", str(EDITOR), "--requests", str(f),
               *(["--sequential"] if sequential else []), tmp=tmp_path)
    # The CLI's default (--method auto) is the Session's: several requests with mend-ls
    # and data/editor-many.
    session = dualedit.Session(MODEL, EDITOR)
    got = session.edit(records, sequential=sequential)
    assert got["method"] == "mend-ls"
    for k in ("data", "report", "saved"):
        want.pop(k)
    # One result type (#49 item 8): the CLI's keys, less the file run's, plus the call's seconds.
    assert got["refused"] < 3 and got["edits_total"] == committed(got)
    assert got.pop("seconds")["edit"] > 0
    assert "conflicts" in got and "seconds_per_edit" in got
    assert (diff := same_edit(got, want)) is None, diff


def test_easyedit_form_metrics_equal_the_cli(tmp_path):
    records = holdout(2, start=5)
    editor = dualedit.Editor(MODEL, EDITOR)
    args = dict(
        prompts=[r["prompt"] for r in records],
        target_new=[r["target_new"] for r in records],
        ground_truth=[r["ground_truth"] for r in records],
        rephrase_prompts=[r["rephrase_prompt"] for r in records],
        locality_inputs={"neighborhood": {"prompt": [r["locality_prompt"] for r in records],
                                          "ground_truth": [r["locality_ground_truth"] for r in records]}},
        subject=[r["subject"] for r in records],
    )
    # sequential_edit=False: each record edited from the unedited model, as `edit` on it alone.
    metrics, edited, weights_copy = editor.edit(**args)
    assert edited is editor.session and weights_copy is None and edited.edits_total == 0
    for i, r in enumerate(records):
        f = tmp_path / f"one-{i}.json"
        f.write_text(json.dumps([r]))
        want = cli("edit", "--model", str(MODEL), "--editor", str(EDITOR), "--requests", str(f), tmp=tmp_path)["requests"][0]
        post = metrics[i]["post"]
        assert metrics[i]["case_id"] == i
        assert post["rewrite_acc"] == [want["reliability"]]
        assert post["rephrase_acc"] == [want["generalization"]]
        assert post["locality"] == {"neighborhood_acc": [want["locality"]]}
        assert set(metrics[i]["pre"]) >= {"rewrite_acc", "rephrase_acc"} and "locality" not in metrics[i]["pre"]
    # The unedited model does not answer the new targets: pre is below post.
    assert all(m["pre"]["rewrite_acc"][0] < m["post"]["rewrite_acc"][0] for m in metrics)

    # sequential_edit=True: all kept, measured after the last, as `edit --sequential`
    # with the CLI's default method (mend-ls with the editor for many edits).
    metrics, edited, _ = editor.edit(**args, sequential_edit=True)
    f = tmp_path / "both.json"
    f.write_text(json.dumps(records))
    want = cli("edit", "--model", str(MODEL), "--editor", str(EDITOR), "--requests", str(f), "--sequential", tmp=tmp_path)
    assert want["method"] == "mend-ls"
    assert edited.edits_total == committed(want) > 0
    for m, w in zip(metrics, want["requests"]):
        assert m["post"]["rewrite_acc"] == [w["reliability"]]
        assert m["post"]["rephrase_acc"] == [w["generalization"]]
        assert m["post"]["locality"]["neighborhood_acc"] == [w["locality"]]
    edited.reset()


def test_the_default_method_is_the_cli_default(tmp_path):
    """Issue #49: Session(model, editor) edits as `dualedit edit` and `serve` do (method
    auto): one request on an unedited session with mend, several or one after another
    with mend-ls; the EasyEdit form's sequential edits give `edit --sequential`'s numbers."""
    session = dualedit.Session(MODEL, EDITOR)
    assert session.method == "mend-ls"
    assert session.edit(fresh(1))["method"] == "mend"
    session.reset()
    assert session.edit(fresh(3))["method"] == "mend-ls"
    session.reset()
    assert session.edit(fresh(1), sequential=True)["method"] == "mend-ls"
    records = fresh(8, start=10)
    f = tmp_path / "eight.json"
    f.write_text(json.dumps(records))
    want = cli("edit", "--model", str(MODEL), "--editor", str(EDITOR), "--requests", str(f), "--sequential", tmp=tmp_path)
    metrics, edited, _ = dualedit.Editor(MODEL, EDITOR).edit(
        prompts=[r["prompt"] for r in records], target_new=[r["target_new"] for r in records],
        rephrase_prompts=[r["rephrase_prompt"] for r in records],
        locality_inputs={"neighborhood": {"prompt": [r["locality_prompt"] for r in records],
                                          "ground_truth": [r["locality_ground_truth"] for r in records]}},
        subject=[r["subject"] for r in records], sequential_edit=True)
    assert [m["post"]["rewrite_acc"] for m in metrics] == [[w["reliability"]] for w in want["requests"]]
    assert [m["refused"] for m in metrics] == [w["refused"] for w in want["requests"]]
    assert edited.edits_total == committed(want)


def test_a_refused_edit_says_so_in_every_shape():
    """Issue #49: a refused edit carries `refused` and the guard's reason, in the report's
    requests and in the EasyEdit form, not only `rewrite_acc: 0.0`."""
    strict = dict(guard_refuse=True, guard_min_agreement=1.0, guard_max_kl=1e-9)
    records = fresh(2, start=20)
    report = dualedit.Session(MODEL, EDITOR, **strict).edit(records, sequential=True)
    assert report["refused"] == 2
    for r in report["requests"]:
        assert r["refused"] is True and "refused" in r["refused_reason"]
    metrics, edited, _ = dualedit.Editor(MODEL, EDITOR, **strict).edit(
        prompts=[r["prompt"] for r in records], target_new=[r["target_new"] for r in records],
        locality_inputs={"neighborhood": {"prompt": [r["locality_prompt"] for r in records],
                                          "ground_truth": [r["locality_ground_truth"] for r in records]}})
    assert edited.edits_total == 0
    for m in metrics:
        assert m["refused"] is True and "refused" in m["refused_reason"], m
    # Committed edits say so too.
    ok = dualedit.Session(MODEL, EDITOR).edit(records[:1])
    assert ok["requests"][0]["refused"] is False and ok["requests"][0]["refused_reason"] is None


def test_image_edit_on_the_multimodal_default(tmp_path):
    world = VL / "world"
    records = json.loads((world / "vqa-holdout.json").read_text())[:1]
    s = dualedit.Session(VL / "model", VL / "editor")
    before = s.score(records[0]["src"], image=world / records[0]["image"])
    assert before.image_tokens > 0 and len(before.logprobs) == len(before.tokens)
    out = s.edit(records, image_root=world)
    assert out["n"] == 1 and s.edits_total == 1
    for k in ("reliability", "generalization", "image_generalization", "locality", "image_locality"):
        assert out[k] is not None, k
    f = tmp_path / "vqa.json"
    f.write_text(json.dumps(records))
    # The same record through the CLI's dataset path (eval: edited from the unedited model).
    want = eval_records(cli("eval", "--model", str(VL / "model"), "--editor", str(VL / "editor"), "--data", str(f), "--ds", "vqa",
                            "--image-root", str(world), tmp=tmp_path))[0]
    got = out["requests"][0]
    for k in ("reliability", "generalization", "image_generalization", "locality", "image_locality"):
        assert got[k] == want[k], k
    s.reset()
    assert s.score(records[0]["src"], image=world / records[0]["image"]).logprobs == before.logprobs
    # A relative image is under image_root, as the edit's images are.
    assert s.score(records[0]["src"], image=records[0]["image"], image_root=world).logprobs == before.logprobs
    assert s.answer(records[0]["src"], 3, image=records[0]["image"], image_root=world) == s.answer(records[0]["src"], 3, image=world / records[0]["image"])

    # EasyEdit's MultimodalEditor form, images as paths.
    mm = dualedit.MultimodalEditor(VL / "model", VL / "editor")
    r = records[0]
    metrics, _, _ = mm.edit(
        prompts=[r["src"]], targets=[r["alt"]], image=[str(world / r["image"])],
        rephrase_prompts=[r["rephrase"]], rephrase_image=[str(world / r["image_rephrase"])],
        locality_inputs={"text": {"prompt": [r["loc"]], "ground_truth": [r["loc_ans"]]},
                         "vision": {"prompt": [r["m_loc_q"]], "ground_truth": [r["m_loc_a"]], "image": [str(world / r["m_loc"])]}},
    )
    post = metrics[0]["post"]
    assert post == {"rewrite_acc": want["reliability"], "rephrase_acc": want["generalization"],
                    "rephrase_image_acc": want["image_generalization"], "locality_acc": want["locality"],
                    "multimodal_locality_acc": want["image_locality"]}
    assert set(metrics[0]["pre"]) == {"rewrite_acc", "rephrase_acc", "rephrase_image_acc"}

    # Only what EasyEdit requires (prompts, targets, image), through from_hparams, with
    # EasyEdit's file_type and keep_original_weight: the absent views' metrics are absent.
    mm = dualedit.MultimodalEditor.from_hparams({"model_name": str(VL / "model"), "archive": str(VL / "editor"), "device": "cpu"})
    metrics, _, _ = mm.edit([r["src"]], [r["alt"]], [r["image"]], "image", image_root=world, keep_original_weight=True)
    assert metrics[0]["post"] == {"rewrite_acc": want["reliability"]} and set(metrics[0]["pre"]) == {"rewrite_acc"}, metrics
    metrics, _, _ = mm.edit([r["src"]], [r["alt"]], [r["image"]], image_root=world,
                            locality_inputs={"text": {"prompt": [r["loc"]], "ground_truth": [r["loc_ans"]]}})
    assert metrics[0]["post"] == {"rewrite_acc": want["reliability"], "locality_acc": want["locality"]}, metrics
    with pytest.raises(dualedit.InputError, match="video"):
        mm.edit([r["src"]], [r["alt"]], [r["image"]], file_type="video", image_root=world)


def test_pil_images_are_accepted():
    Image = pytest.importorskip("PIL.Image")
    world = VL / "world"
    r = json.loads((world / "vqa-holdout.json").read_text())[0]
    s = dualedit.Session(VL / "model", VL / "editor")
    by_path = s.score(r["src"], image=world / r["image"])
    by_pil = s.score(r["src"], image=Image.open(world / r["image"]))
    assert by_pil.logprobs == by_path.logprobs


def test_a_missing_folder_is_file_not_found(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError) as e:
        dualedit.Session(missing)
    assert isinstance(e.value, dualedit.Error) and str(missing) in str(e.value)
    with pytest.raises(dualedit.NotFoundError) as e:
        dualedit.Session(MODEL, tmp_path / "no-such-editor")
    assert "no-such-editor" in str(e.value) and "\n" not in str(e.value)


def test_bad_requests_are_value_errors(session):
    with pytest.raises(ValueError) as e:
        session.edit([{"prompt": "Vacorp was founded by"}])
    assert isinstance(e.value, dualedit.Error) and "target_new" in str(e.value)
    with pytest.raises(dualedit.InputError):
        session.edit([])
    with pytest.raises(dualedit.InputError, match="method"):
        session.edit(holdout(1), method="ft")
    with pytest.raises(ValueError, match="dtype"):
        dualedit.Session(MODEL, dtype="int8")
    assert session.edits_total == 0


def test_keywords_are_the_librarys_option_fields(tmp_path):
    """Issue #50: the keywords are read into the library's option types, so an unknown
    one and a bad value are each one error naming the keyword, as the CLI's flags."""
    with pytest.raises(dualedit.InputError, match="guard_max_kl"):
        dualedit.Session(MODEL, EDITOR, guard_max_kl=-1.0)
    with pytest.raises(dualedit.InputError, match="gaurd"):
        dualedit.Session(MODEL, EDITOR, gaurd=False)
    data = DATA / "world" / "edits-holdout.json"
    with pytest.raises(dualedit.InputError, match="`stepwise`"):
        dualedit.evaluate(MODEL, data, "counterfact", EDITOR, stepwise=True, progress=False)
    with pytest.raises(dualedit.InputError, match="edits_per_btach"):
        dualedit.evaluate(MODEL, data, "counterfact", EDITOR, edits_per_btach=2, progress=False)
    with pytest.raises(dualedit.InputError, match="`truncate` and `strict`"):
        dualedit.train(MODEL, data, "counterfact", ROOT / "configs" / "tiny.json", tmp_path / "ed", truncate=True, strict=True)
    # torch's dtype spelling reads as the CLI's.
    assert dualedit.Session(MODEL, dtype=torch.float32).max_positions > 0


def test_evaluate_reports_progress_and_matches_the_cli(tmp_path):
    data = DATA / "world" / "edits-holdout.json"
    seen = []
    got = dualedit.evaluate(MODEL, data, "counterfact", EDITOR, limit=3, report=tmp_path / "eval.json",
                            progress=lambda done, total, m: seen.append((done, total, m["reliability"])))
    assert [d for d, _, _ in seen] == [1, 2, 3] and all(t == 3 for _, t, _ in seen)
    want = cli("eval", "--model", str(MODEL), "--editor", str(EDITOR), "--data", str(data), "--ds", "counterfact",
               "--limit", "3", tmp=tmp_path)
    assert (diff := same_edit(got["records"], eval_records(want))) is None, diff
    for k in ("n", "reliability", "generalization", "locality", "method", "data"):
        assert got[k] == want[k], k
    assert [r for _, _, r in seen] == [r["reliability"] for r in got["records"]]


def test_evaluates_progress_bar_knows_its_total(tmp_path, monkeypatch):
    tqdm_auto = pytest.importorskip("tqdm.auto")
    bars = []

    class Bar(tqdm_auto.tqdm):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            bars.append(self)

    monkeypatch.setattr(tqdm_auto, "tqdm", Bar)
    dualedit.evaluate(MODEL, DATA / "world" / "edits-holdout.json", "counterfact", EDITOR, limit=2, report=tmp_path / "a.json")
    dualedit.evaluate(MODEL, DATA / "world" / "edits-holdout.json", "counterfact", EDITOR, report=tmp_path / "b.json")
    assert [(b.total, b.n) for b in bars] == [(2, 2), (50, 50)]


def test_an_interrupt_stops_evaluate_cleanly(tmp_path):
    calls = []

    def interrupt(done, total, m):
        calls.append(done)
        raise KeyboardInterrupt

    report = tmp_path / "eval.json"
    with pytest.raises(KeyboardInterrupt):
        dualedit.evaluate(MODEL, DATA / "world" / "edits-holdout.json", "counterfact", EDITOR, report=report, progress=interrupt)
    # Stopped at the next record, not after all 50; no half report.
    assert calls == [1] and not report.exists()


def test_train_writes_an_editor_a_session_opens(tmp_path):
    out = tmp_path / "editor"
    rep = dualedit.train(MODEL, DATA / "world" / "edits-train.json", "counterfact", ROOT / "configs" / "world.json", out,
                         max_steps=2, limit=20, progress=False)
    assert rep["steps"] == 2 and Path(rep["report"]).exists()
    s = dualedit.Session(MODEL, out)
    assert s.edit(holdout(1))["n"] == 1
    # An editor is never replaced: the CLI's one-line error, as a ValueError.
    with pytest.raises(dualedit.FileError, match="already holds an editor"):
        dualedit.train(MODEL, DATA / "world" / "edits-train.json", "counterfact", ROOT / "configs" / "world.json", out, max_steps=2, limit=20)


def test_ctrl_c_stops_training_after_its_step_with_the_editor_saved(tmp_path):
    import _thread
    import signal
    import threading
    import time

    out = tmp_path / "editor"
    # A training that only Ctrl-C ends (no step limit or early stop within reach): on a fast
    # machine world.json's early stop could end it before the interrupt comes.
    cfg = json.loads((ROOT / "configs" / "world.json").read_text())
    cfg.update(max_steps=10**7, early_stop_patience=10**6)
    (tmp_path / "endless.json").write_text(json.dumps(cfg))
    # A Python started as a background job (`./x pytest &` from a script) inherits SIGINT
    # ignored, and interrupt_main then does nothing: the training would never end. Ctrl-C's
    # own handler for the duration, as an interactive Python has it.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(3.0, _thread.interrupt_main)  # as Ctrl-C: SIGINT's flag in the main thread
    timer.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            dualedit.train(MODEL, DATA / "world" / "edits-train.json", "counterfact", tmp_path / "endless.json", out,
                           limit=40, progress=False)
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
    assert time.monotonic() - t0 < 120
    assert (out / "editor.safetensors").exists() and (out / "train_state.safetensors").exists()
    dualedit.Session(MODEL, out)


def test_plan_is_the_cli_plan(tmp_path):
    cfg = ROOT / "configs" / "world.json"
    got = dualedit.plan(MODEL, cfg)
    want = cli("plan", "--model", str(MODEL), "--config", str(cfg), tmp=tmp_path)
    assert got == want
    # Every flag of `plan` is a keyword (the library's PlanRequest), with the CLI's answer.
    got = dualedit.plan(MODEL, cfg, sub_device="cpu:1", placement="balanced", fit="16GiB,24GiB", max_length=32)
    want = cli("plan", "--model", str(MODEL), "--config", str(cfg), "--sub-device", "cpu:1", "--placement", "balanced",
               "--fit", "16GiB,24GiB", "--max-length", "32", tmp=tmp_path)
    assert got == want
    with pytest.raises(dualedit.InputError, match="`image_size`"):
        dualedit.plan(MODEL, cfg, ds="zsre", image_size=(4, 4))
    with pytest.raises(dualedit.InputError, match="nope"):
        dualedit.plan(MODEL, cfg, nope=1)


def test_the_easyedit_example_runs():
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "easyedit_style.py")], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "rewrite_acc" in r.stdout
