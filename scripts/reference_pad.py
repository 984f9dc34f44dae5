"""Right-padding of token-id lists for the reference scripts (ft_reference.py, memit_reference.py)."""
import torch


def pad(seqs, max_len=None):
    """`(ids [B, T] long, mask [B, T] float)` for lists of token ids, each cut to `max_len`."""
    if max_len is not None:
        seqs = [s[:max_len] for s in seqs]
    t = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), t, dtype=torch.long)
    mask = torch.zeros(len(seqs), t)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
    return ids, mask
