"""NLL of the world's corpus lines that name an edited subject but not its old answer (the
subjects' other facts) and of the lines naming no edited subject, under the unedited model
and models saved by `dualedit edit --requests tests/fixtures/many/fresh-100.json --save DIR`
(docs/notebook/many-edits.md, "Many edits, part 7"). Needs transformers (the fixtures' folders):

    .venv/bin/python scripts/subject_drift.py data/model DIR...
"""
import json, sys, torch
from transformers import GPT2LMHeadModel, PreTrainedTokenizerFast
recs = json.load(open('tests/fixtures/many/fresh-100.json'))
lines = open('data/world/corpus.txt').read().splitlines()
other = [l for l in lines if any(r['subject'] in l for r in recs) and not any(r['subject'] in l and r['ground_truth'] in l for r in recs)]
unrel = [l for l in lines if not any(r['subject'] in l for r in recs)]
tok = PreTrainedTokenizerFast(tokenizer_file='data/model/tokenizer.json')
def nll(d, ls):
    m = GPT2LMHeadModel.from_pretrained(d).eval(); tot = n = 0
    with torch.no_grad():
        for l in ls:
            ids = torch.tensor([tok.encode(l)])
            if ids.shape[1] < 2: continue
            out = m(ids, labels=ids); k = ids.shape[1]-1; tot += out.loss.item()*k; n += k
    return tot/n
print(len(other), 'same-subject other-fact lines;', len(unrel), 'unrelated lines')
for d in sys.argv[1:]:
    print(d, 'same-subject other facts NLL %.3f' % nll(d, other), 'unrelated %.3f' % nll(d, unrel))
