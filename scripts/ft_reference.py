"""A reference for how far many edits can generalise on a model: direct fine-tuning of the
weights the many-edit editor changes (GPT-2 `mlp.c_proj` of LAYERS), on the N requests'
prompts only (never their rephrases), held by a KL penalty (weight KL) to the unedited
model on keep lines (the world's corpus without the lines stating an edited fact, or
KEEP= for zsRE). Scored as `dualedit eval` scores: teacher-forced token accuracy of the
new answer after the prompt / the rephrase, locality as agreement with the unedited
model's argmax tokens on the locality answer; drift = NLL of lines naming no edited
subject. docs/notebook/many-edits.md, "Many edits, part 8". Needs transformers (the fixtures'
folders):

    PYTHONPATH=... .venv/bin/python scripts/ft_reference.py N KL STEPS [L2] [LAYERS]
    # zsRE: MODEL=Z DATA=zall.json KEEP=keep-all.txt DRIFT=drift.txt KEEP_SAMPLE=128 EDIT_BATCH=250 LR=5e-3
    # from edited weights: INIT=DIR (the KL stays to MODEL)
"""
import json, sys, torch, random
import reference_pad
from transformers import GPT2LMHeadModel, PreTrainedTokenizerFast
torch.manual_seed(0); random.seed(0)
N = int(sys.argv[1]); KLW = float(sys.argv[2]); STEPS = int(sys.argv[3]); NORMW = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
LAYERS = [int(x) for x in (sys.argv[5] if len(sys.argv) > 5 else "1,2,3").split(",")]
import os
MODEL = os.environ.get('MODEL', 'data/model'); DATA = os.environ.get('DATA', 'tests/fixtures/many/fresh-100.json')
m = GPT2LMHeadModel.from_pretrained(MODEL).eval()
for p in m.parameters(): p.requires_grad_(False)
tok = PreTrainedTokenizerFast(tokenizer_file=MODEL + '/tokenizer.json'); enc = tok.encode
recs = json.load(open(DATA))[:N]
if 'src' in recs[0]:
    recs = [dict(prompt=r['src'], rephrase_prompt=r['rephrase'], target_new=r['alt'], locality_prompt=r['loc'], locality_ground_truth=r['loc_ans'], subject=r['subject'], ground_truth=r['answers'][0] if r['answers'] else r['pred']) for r in recs]
    keep = open(os.environ['KEEP']).read().splitlines(); unrel = open(os.environ['DRIFT']).read().splitlines()
    unrel = [l for l in unrel if not any(r['subject'] in l for r in recs)]
else:
    lines = open('data/world/corpus.txt').read().splitlines()
    keep = [l for l in lines if not any(r['subject'] in l and r['ground_truth'] in l for r in recs)]
    unrel = [l for l in lines if not any(r['subject'] in l for r in recs)]
recs = [r for r in recs if len(enc(r['prompt'] + ' ' + r['target_new'])) <= m.config.n_positions and len(enc(r['rephrase_prompt'] + ' ' + r['target_new'])) <= m.config.n_positions and len(enc(r['locality_prompt'] + ' ' + r['locality_ground_truth'])) <= m.config.n_positions]
print('records', len(recs))
KS = int(os.environ.get('KEEP_SAMPLE', '0'))
def pad(seqs): return reference_pad.pad(seqs, m.config.n_positions)
def items(prompts, targets):
    out = []
    for p, t in zip(prompts, targets):
        a = enc(p); b = enc(p + " " + t)[len(a):]; out.append((a, b))
    return out
E = items([r['prompt'] for r in recs], [r['target_new'] for r in recs])
G = items([r['rephrase_prompt'] for r in recs], [r['target_new'] for r in recs])
Lc = items([r['locality_prompt'] for r in recs], [r['locality_ground_truth'] for r in recs])
def acc(its):
    ids, mask = pad([a + b for a, b in its])
    with torch.no_grad(): lg = m(ids, attention_mask=mask).logits
    res = []
    for i, (a, b) in enumerate(its):
        res.append(lg[i, len(a)-1:len(a)-1+len(b)].argmax(-1).tolist())
    return res
def score(its): return sum(sum(x == y for x, y in zip(p, b)) / len(b) for p, (a, b) in zip(acc(its), its)) / len(its)
pre_loc = acc(Lc)
kids, kmask = pad([enc(l) for l in keep])
W = [m.transformer.h[l].mlp.c_proj.weight for l in LAYERS]; W0 = [w.clone() for w in W]
if os.environ.get('INIT'):  # start from another model's weights (e.g. a `dualedit edit --save`), the KL still to MODEL
    init = GPT2LMHeadModel.from_pretrained(os.environ['INIT'])
    with torch.no_grad():
        for w, l in zip(W, LAYERS): w.copy_(init.transformer.h[l].mlp.c_proj.weight)
    print('init from', os.environ['INIT'], 'reliability', score(E), flush=True)
for w in W: w.requires_grad_(True)
opt = torch.optim.Adam(W, lr=float(os.environ.get('LR', '1e-3')))
EB = int(os.environ.get('EDIT_BATCH', '0')) or len(E)
def answer_lp(its, idx):
    ids, mask = pad([its[i][0] + its[i][1] for i in idx])
    h = m.transformer(ids, attention_mask=mask).last_hidden_state
    rows, tg = [], []
    for j, i in enumerate(idx):
        a, b = its[i]
        for k, t in enumerate(b): rows.append(h[j, len(a) - 1 + k]); tg.append(t)
    lg = torch.log_softmax(m.lm_head(torch.stack(rows)), -1)
    return lg[range(len(tg)), tg].mean()
for s in range(STEPS):
    opt.zero_grad()
    idx = torch.randperm(len(E))[:EB].tolist()
    nll = -answer_lp(E, idx)
    sel = torch.randperm(kids.shape[0])[:KS] if KS else torch.arange(kids.shape[0])
    km = kmask[sel]
    with torch.no_grad():
        for w, w0 in zip(W, W0): w.data, w0.data = w0.data, w.data
        b0 = torch.log_softmax(m(kids[sel], attention_mask=km).logits, -1)
        for w, w0 in zip(W, W0): w.data, w0.data = w0.data, w.data
    cur = torch.log_softmax(m(kids[sel], attention_mask=km).logits, -1)
    kl = ((b0.exp() * (b0 - cur)).sum(-1) * km).sum() / km.sum()
    reg = sum(((w - w0) ** 2).sum() for w, w0 in zip(W, W0))
    loss = nll + KLW * kl + NORMW * reg; loss.backward(); opt.step()
    if s % 10 == 0 or s == STEPS - 1: print(s, f"nll {nll.item():.3f} kl {kl.item():.4f}", flush=True)
rel = score(E); gen = score(G)
post = acc(Lc); loc = sum(sum(x == y for x, y in zip(p, q)) / len(q) for p, q in zip(post, pre_loc)) / len(Lc)
uids, umask = pad([enc(l) for l in unrel])
with torch.no_grad():
    lg = torch.log_softmax(m(uids, attention_mask=umask).logits, -1)
    tgt = uids[:, 1:]; lp = lg[:, :-1].gather(2, tgt.unsqueeze(-1)).squeeze(-1); mk = umask[:, 1:]
    drift = -(lp * mk).sum() / mk.sum()
print(f"FT N={N} kl={KLW} steps={STEPS} layers={LAYERS}: rel {rel:.3f} gen {gen:.3f} loc {loc:.3f} drift {drift.item():.3f}")
