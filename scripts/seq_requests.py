#!/usr/bin/env python3
"""Edit-request files for the sequential / batch measurements of issue #24.

The embedded default's held-out file (data/world/edits-holdout.json) has 50 records over
only 14 facts of 5 subjects: each fact comes back with up to 4 different targets, and
every locality prompt is a fact of one of those 5 subjects, i.e. a fact that other records
of the same file edit. Applied one after another (or in one batch), such records contradict
each other, so "reliability of all N at the end" and locality cannot both be high whatever
the editor does. This script writes, besides the first N held-out records as they are,
request files with one record per fact (no two requests edit the same fact) whose
locality prompts are facts that no request of the file edits:

    holdout-N.json   the first N held-out records, unchanged (N <= 50)
    distinct-N.json  N distinct facts: the 14 held-out facts first, then the train facts
                     (first record of each fact: its target and rephrase); locality: an
                     unedited fact of the same relation (same true object if possible),
                     as CounterFact's neighbourhood prompts

    distinct-N-from-K.json  (with --skip K) N distinct facts after the first K: a second,
                     disjoint set of requests (to choose settings on one set and report
                     on the other); locality as above, among the facts it does not edit

    --fresh-targets  every record's target_new is replaced by an object of its relation
                     that no record of edits-train.json or edits-holdout.json gives that
                     fact (nor its true object): requests no editor was meta-trained on
                     (files named fresh-N.json / fresh-N-from-K.json; facts without such
                     an object, e.g. continents, are left out)

Usage: scripts/seq_requests.py OUT_DIR [--skip K] [--fresh-targets] [N ...]   (default N: 5 20 100)
"""
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORLD = ROOT / "data" / "world"

# src/data/synthetic.rs RELATIONS (the first phrasing is the records' `prompt`).
TEMPLATES = {
    "capital": ["The capital of {s} is", "{s}'s capital city is", "In {s}, the seat of government is"],
    "language": ["The official language of {s} is", "People in {s} speak", "The main language spoken in {s} is"],
    "currency": ["The currency of {s} is the", "In {s}, people pay with the", "The official money of {s} is the"],
    "continent": ["{s} is located on the continent of", "{s} is a country in", "The country {s} belongs to the continent of"],
    "born_in": ["{s} was born in", "The birthplace of {s} is", "{s} came into the world in"],
    "profession": ["The profession of {s} is", "{s} works as a", "By trade, {s} is a"],
    "founder": ["{s} was founded by", "The founder of {s} is", "The company {s} was started by"],
    "headquarters": ["The headquarters of {s} are in", "{s} is headquartered in", "The main office of {s} is located in"],
    "industry": ["The industry of {s} is", "{s} does business in", "{s} is known for its work in"],
}


def main():
    out = Path(sys.argv[1])
    args = sys.argv[2:]
    skip = 0
    if args[:1] == ["--skip"]:
        skip, args = int(args[1]), args[2:]
    fresh = args[:1] == ["--fresh-targets"]
    if fresh:
        args = args[1:]
    ns = [int(a) for a in args] or [5, 20, 100]
    out.mkdir(parents=True, exist_ok=True)
    facts = json.loads((WORLD / "facts.json").read_text())
    by_prompt = {TEMPLATES[f["relation"]][0].replace("{s}", f["subject"]): f for f in facts}
    holdout = json.loads((WORLD / "edits-holdout.json").read_text())
    train = json.loads((WORLD / "edits-train.json").read_text())

    # One record per fact, held-out facts first.
    seen, distinct = set(), []
    for r in holdout + train:
        if r["prompt"] not in seen:
            seen.add(r["prompt"])
            distinct.append(r)
    def fresh_objects(r):
        fact = by_prompt[r["prompt"]]
        used = {fact["object"]} | {t["target_new"] for t in holdout + train if t["prompt"] == r["prompt"]}
        return sorted({f["object"] for f in facts if f["relation"] == fact["relation"]} - used)

    if fresh:
        # Facts whose relation has no object left that no record gives them are left out.
        distinct = [r for r in distinct if fresh_objects(r)]
    for n in ns:
        if n <= len(holdout) and skip == 0:
            (out / f"holdout-{n}.json").write_text(json.dumps(holdout[:n], indent=1))
        if skip + n > len(distinct):
            sys.exit(f"the world has {len(distinct)} facts: cannot take {n} after the first {skip}")
        recs = [dict(r) for r in distinct[skip:skip + n]]
        edited = {(by_prompt[r["prompt"]]["subject"], by_prompt[r["prompt"]]["relation"]) for r in recs}
        free = [f for f in facts if (f["subject"], f["relation"]) not in edited]
        for i, r in enumerate(recs):
            fact = by_prompt[r["prompt"]]
            tiers = [
                [f for f in free if f["relation"] == fact["relation"] and f["object"] == fact["object"]],
                [f for f in free if f["relation"] == fact["relation"]],
                free,
            ]
            pool = next(t for t in tiers if t)
            loc = pool[i % len(pool)]
            tpl = TEMPLATES[loc["relation"]]
            r["locality_prompt"] = tpl[i % len(tpl)].replace("{s}", loc["subject"])
            r["locality_ground_truth"] = loc["object"]
            if fresh:
                r["target_new"] = fresh_objects(r)[i % len(fresh_objects(r))]
        stem = "fresh" if fresh else "distinct"
        name = f"{stem}-{n}.json" if skip == 0 else f"{stem}-{n}-from-{skip}.json"
        (out / name).write_text(json.dumps(recs, indent=1))
        print(f"{name}: {len(recs)} records, {len({r['prompt'] for r in recs})} facts")


if __name__ == "__main__":
    main()
