"""One-thread f32 GEMM rates of MKL (torch's default CPU matmul) and oneDNN at the shapes of
a MEND edit of the 143 M Qwen2-VL bench model (docs/notebook/mend-step.md, "The f32 edit at 143 M: a
floor, measured"): the editor's products, the tower's and the text blocks' projections.

    taskset -c 1 .venv/bin/python scripts/gemm_shapes.py

Prints, per shape `m x k x n`, the median CPU time of `linear` (MKL) and of
`torch.ops.mkldnn._linear_pointwise` (oneDNN), their GFLOP/s and largest difference.
"""
import time

import torch

torch.set_num_threads(1)


def median_cpu(f, n=5):
    f()
    ts = []
    for _ in range(n):
        s = time.process_time()
        f()
        ts.append(time.process_time() - s)
    return sorted(ts)[len(ts) // 2]


SHAPES = [
    (300, 3840, 1920), (300, 1920, 3840),  # the editor's U/V products, 273-300 rows
    (1024, 512, 1536), (1024, 512, 2048), (1024, 2048, 512),  # the tower at 448 px
    (300, 1024, 2816), (300, 2816, 1024), (300, 1024, 1024),  # text MLP and attention
    (256, 2048, 2048), (1024, 1024, 1024),  # the merger; the bench's peak shape
]
print(torch.__version__, "oneDNN:", torch.backends.mkldnn.is_available())
for m, k, n in SHAPES:
    x, w = torch.randn(m, k), torch.randn(n, k)
    mkl = median_cpu(lambda: torch.nn.functional.linear(x, w))
    dnn = median_cpu(lambda: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""))
    diff = (torch.nn.functional.linear(x, w) - torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")).abs().max().item()
    gf = 2 * m * k * n / 1e9
    print(f"{m}x{k}x{n}: MKL {mkl * 1e3:.1f} ms {gf / mkl:.0f} GFLOP/s, oneDNN {dnn * 1e3:.1f} ms {gf / dnn:.0f} GFLOP/s ({dnn / mkl:.2f}x), max diff {diff:.1e}")
