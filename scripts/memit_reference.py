"""MEMIT (Meng et al., ICLR 2023) on the embedded default, as a reference for many edits: the
target v* of each request optimised at the subject's last token of block L = max(LAYERS)
(NLL of the new answer after the prompt and NPRE corpus-line prefixes, KL on "{subject} is",
norm clamped to CLAMP x the residual's), keys averaged over the prefixes, spread over the
`mlp.c_proj` of LAYERS against the second moment of the keep lines (weight LAM). Scored as
scripts/ft_reference.py. docs/notebook/many-edits.md, "Many edits, part 8". Needs transformers:

    PYTHONPATH=... NPRE=0 STEPS=40 .venv/bin/python scripts/memit_reference.py N LAYERS LAM
"""
import json, sys, os, torch, random
from transformers import GPT2LMHeadModel, PreTrainedTokenizerFast
torch.manual_seed(0); random.seed(0)
N = int(sys.argv[1]); LAYERS = [int(x) for x in sys.argv[2].split(",")]; LAM = float(sys.argv[3])
NPRE = int(os.environ.get('NPRE', '5')); STEPS = int(os.environ.get('STEPS', '25')); CLAMP = float(os.environ.get('CLAMP', '0.75'))
m = GPT2LMHeadModel.from_pretrained('data/model').eval()
for p in m.parameters(): p.requires_grad_(False)
tok = PreTrainedTokenizerFast(tokenizer_file='data/model/tokenizer.json'); enc = tok.encode
recs = json.load(open('tests/fixtures/many/fresh-100.json'))[:N]
lines = open('data/world/corpus.txt').read().splitlines()
keep = [l for l in lines if not any(r['subject'] in l and r['ground_truth'] in l for r in recs)]
unrel = [l for l in lines if not any(r['subject'] in l for r in recs)]
L = max(LAYERS)
prefixes = [""] + [tok.decode(enc(l)[:4]) + ". " for l in random.sample(keep, NPRE)]
def subj_pos(text, subject):
    i = text.index(subject); return len(enc(text[:i + len(subject)])) - 1
from reference_pad import pad
def acc(prompts, targets):
    out = []
    for p, t in zip(prompts, targets):
        a = enc(p); b = enc(p + " " + t)[len(a):]
        with torch.no_grad(): lg = m(torch.tensor([a + b])).logits[0]
        out.append((lg[len(a)-1:len(a)-1+len(b)].argmax(-1).tolist(), b))
    return out
pre_loc = acc([r['locality_prompt'] for r in recs], [r['locality_ground_truth'] for r in recs])
# covariance of c_proj inputs over the keep lines
def grab(layer):
    st = {}
    h = m.transformer.h[layer].mlp.c_proj.register_forward_pre_hook(lambda mod, inp: st.__setitem__('k', inp[0]))
    return st, h
C = {}
for l in LAYERS:
    st, h = grab(l); S = torch.zeros(512, 512); n = 0
    with torch.no_grad():
        for line in keep:
            m(torch.tensor([enc(line)])); k = st['k'][0]; S += k.T @ k; n += k.shape[0]
    h.remove(); C[l] = S / n
# v*: delta at layer L's output, subject-last position
hook_state = {}
def add_delta(mod, inp, out):
    if 'delta' not in hook_state: return out
    out = out.clone(); 
    for b, p in enumerate(hook_state['pos']): out[b, p] = out[b, p] + hook_state['delta']
    return out
hd = m.transformer.h[L].register_forward_hook(add_delta)
Z = []; losses = []
for r in recs:
    seqs, pos, tg = [], [], []
    for pf in prefixes:
        tx = pf + r['prompt']; a = enc(tx); b = enc(tx + " " + r['target_new'])[len(a):]
        seqs.append(a + b); pos.append(subj_pos(tx, r['subject'])); tg.append((len(a), b))
    ess = r['subject'] + " is"; ea = enc(ess); seqs.append(ea); pos.append(subj_pos(ess, r['subject']))
    ids, mask = pad(seqs)
    with torch.no_grad():
        hook_state.pop('delta', None)
        out = m(ids, attention_mask=mask, output_hidden_states=True)
        h0 = out.hidden_states[L + 1][0, pos[0]].clone()
        ess0 = torch.log_softmax(out.logits[-1, len(ea) - 1], -1)
    delta = torch.zeros(128, requires_grad=True); opt = torch.optim.Adam([delta], lr=0.5)
    hook_state['pos'] = pos
    for s in range(STEPS):
        opt.zero_grad(); hook_state['delta'] = delta
        lg = torch.log_softmax(m(ids, attention_mask=mask).logits, -1)
        nll = 0
        for i, (la, b) in enumerate(tg): nll = nll - lg[i, range(la - 1, la - 1 + len(b)), b].mean() / len(tg)
        kl = torch.nn.functional.kl_div(lg[-1, len(ea) - 1], ess0, log_target=True, reduction='sum')
        loss = nll + 0.0625 * kl + 0.5 * delta.norm() / h0.norm() ** 2
        if nll.item() < 5e-2: break
        loss.backward(); opt.step()
        with torch.no_grad():
            mx = CLAMP * h0.norm()
            if delta.norm() > mx: delta.mul_(mx / delta.norm())
    hook_state.pop('delta', None); losses.append(nll.item()); Z.append(h0 + delta.detach())
hd.remove()
Z = torch.stack(Z)
print("v* nll mean %.3f" % (sum(losses) / len(losses)), flush=True)
def keys_h(layer):
    st, h = grab(layer); K = []; H = []
    with torch.no_grad():
        for r in recs:
            ks = []
            for j, pf in enumerate(prefixes):
                tx = pf + r['prompt']; p = subj_pos(tx, r['subject'])
                out = m(torch.tensor([enc(tx)]), output_hidden_states=True); ks.append(st['k'][0, p])
                if j == 0: H.append(out.hidden_states[L + 1][0, p])
            K.append(torch.stack(ks).mean(0))
    h.remove(); return torch.stack(K), torch.stack(H)
for i, l in enumerate(LAYERS):
    K, H = keys_h(l)
    R = (Z - H) / (len(LAYERS) - i)
    W = m.transformer.h[l].mlp.c_proj.weight
    dW = torch.linalg.solve((LAM * C[l] + K.T @ K).double(), (K.T @ R).double()).float()
    with torch.no_grad(): W += dW
rel = sum(sum(x == y for x, y in zip(p, b)) / len(b) for p, b in acc([r['prompt'] for r in recs], [r['target_new'] for r in recs])) / N
gen = sum(sum(x == y for x, y in zip(p, b)) / len(b) for p, b in acc([r['rephrase_prompt'] for r in recs], [r['target_new'] for r in recs])) / N
post = acc([r['locality_prompt'] for r in recs], [r['locality_ground_truth'] for r in recs])
loc = sum(sum(x == y for x, y in zip(p, q[0])) / len(q[0]) for (p, _), q in zip(post, pre_loc)) / N
tot = n = 0
with torch.no_grad():
    for line in unrel:
        ids = torch.tensor([enc(line)]); o = m(ids, labels=ids); k = ids.shape[1] - 1; tot += o.loss.item() * k; n += k
print(f"MEMIT N={N} layers={LAYERS} lam={LAM} npre={NPRE} clamp={CLAMP}: rel {rel:.3f} gen {gen:.3f} loc {loc:.3f} drift {tot/n:.3f}")
