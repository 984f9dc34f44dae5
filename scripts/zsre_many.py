#!/usr/bin/env python3
"""Request files and texts for the zsRE capacity measurement of issue #24
(docs/notebook/many-edits.md, "Many edits, part 4 (issue #24): zsRE").

From the shared zsRE file (1,000 records as prepared for MEND) it writes into OUT_DIR:

    ztrain.json    records 0-799, for meta-training the editors (the tenth session's split;
                   `dualedit train` holds the last `val_records` of them out for validation)
    zeval.json     records 800-999, the held-out edits
    zall.json      all 1,000 records (N = 1000: most of them were seen in meta-training)
    zdev.json      records 700-799: inside the editors' validation split (the last 100
                   usable training records), never meta-trained on; the `mend-ls`
                   settings are chosen on these, the table reports zeval.json

    keep-heldout.txt  the keep text of `mend-ls` for edits of zeval.json: the pretraining
                      corpus lines (src.rephrase + answer, loc + loc_ans, the new-target
                      lines) of records 0-799 only, so none of the held-out records' lines
                      and none of their locality probes are in it
    keep-dev.txt      the keep text for zdev.json: the corpus lines of records 0-699
    keep-heldout-nofacts.txt  the keep text of the reported `mend-ls` setting (chosen on
                      zdev.json with keep-dev-nofacts.txt): the loc + loc_ans lines and the
                      new-target lines of records 0-799, none of the fact / rephrase lines
    keep-dev-nofacts.txt  the same for records 0-699
    keep-heldout-loc.txt  keep-heldout.txt plus the loc + loc_ans lines of records 800-999 (the
                      scored locality probes' facts, as parts 2 and 3 kept the locality
                      prompts' facts); a check, not the reported setting
    keep-all.txt      for zall.json: the corpus minus every line that states an edited
                      fact (src / rephrase + answer), i.e. the loc + loc_ans lines and the
                      new-target lines of all records; it holds the scored locality probes
    drift.txt         unrelated text for the NLL drift: the corpus lines of records 0-99
                      (fact, rephrase, loc lines); `eval` skips the lines that name an
                      edited subject, so for zall.json mostly the loc lines remain

The corpus lines are built exactly as `dualedit pretrain --with-new-targets` builds them
(src/pretrain.rs::corpus_from_records): "{prompt} {answer}." and " {alt}.".

Usage: scripts/zsre_many.py ZSRE_JSON OUT_DIR
"""
import json
import sys
from pathlib import Path


def blank(s):
    return s is None or not str(s).strip()


def lines_of(r, facts=True, loc=True, new_target=True):
    """The corpus lines of one record, as corpus_from_records writes them."""
    if blank(r.get("src")) or blank(r.get("alt")):
        return []  # the loader skips such records: they are not in the corpus
    join = lambda p, a: f"{p.rstrip()} {a.strip()}."
    answers = r.get("answers") or []
    gt = answers[0] if answers and not blank(answers[0]) else (r.get("pred") if not blank(r.get("pred")) else None)
    out = []
    if gt is not None and facts:
        out.append(join(r["src"], gt))
        if not blank(r.get("rephrase")):
            out.append(join(r["rephrase"], gt))
    if loc and not blank(r.get("loc")) and not blank(r.get("loc_ans")):
        out.append(join(r["loc"], r["loc_ans"]))
    if new_target:
        out.append(f" {r['alt'].strip()}.")
    return out


def write_lines(path, lines):
    path.write_text("".join(l.replace("\n", " ") + "\n" for l in lines))


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    recs = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    if len(recs) != 1000:
        print(f"warning: {len(recs)} records, expected 1000", file=sys.stderr)
    train, held = recs[:800], recs[800:]
    (out / "ztrain.json").write_text(json.dumps(train))
    (out / "zeval.json").write_text(json.dumps(held))
    (out / "zall.json").write_text(json.dumps(recs))
    (out / "zdev.json").write_text(json.dumps(recs[700:800]))
    write_lines(out / "keep-dev.txt", [l for r in recs[:700] for l in lines_of(r)])
    keep = [l for r in train for l in lines_of(r)]
    write_lines(out / "keep-heldout.txt", keep)
    write_lines(out / "keep-heldout-nofacts.txt", [l for r in train for l in lines_of(r, facts=False)])
    write_lines(out / "keep-dev-nofacts.txt", [l for r in recs[:700] for l in lines_of(r, facts=False)])
    write_lines(out / "keep-heldout-loc.txt", keep + [l for r in held for l in lines_of(r, facts=False, new_target=False)])
    write_lines(out / "keep-all.txt", [l for r in recs for l in lines_of(r, facts=False)])
    write_lines(out / "drift.txt", [l for r in recs[:100] for l in lines_of(r, new_target=False)])
    for name in ["ztrain.json", "zeval.json", "zall.json", "zdev.json", "keep-dev.txt", "keep-heldout.txt", "keep-heldout-nofacts.txt", "keep-dev-nofacts.txt", "keep-heldout-loc.txt", "keep-all.txt", "drift.txt"]:
        p = out / name
        n = len(json.loads(p.read_text())) if name.endswith(".json") else len(p.read_text().splitlines())
        print(f"{p}: {n}")


if __name__ == "__main__":
    main()
