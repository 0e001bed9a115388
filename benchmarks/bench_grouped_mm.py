"""The grouped products of mixture-of-experts model code (F.grouped_mm,
torch._scaled_grouped_mm: the grouped_mm family) at a Qwen3-30B-A3B
expert's down projection (K = 768 -> N = 2048, 8 experts): decode (64
routed rows) in both weight layouts, prefill tiles (128 rows), and operands
16-byte misaligned (the element-load kernels), so that every grouped_mm
kernel is measured; they run on 256 of the 2048 output columns and count
for 8 times that. The cases of `python -m benchmarks grouped_mm`.

    python benchmarks/bench_grouped_mm.py [--quick | --tiny]   (the same)

(A whole MoE layer on mps_ext's own ops, routing included, is the moe
family's: benchmarks/bench_moe.py.)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import Case, Prepared, run_as_script  # noqa: E402


def quantize_rows_zero(shape):
    """fp8 zeros and unit row scales (values do not change the counters)."""
    return torch.zeros(shape, dtype=torch.float8_e4m3fn), torch.ones(shape[:-1])


SAMPLE_N = 256  # output columns the grouped products run on (of N)


def grouped(kind, dtype, rows, k, n, experts, layout, misaligned=0) -> Prepared:
    """One grouped product of `rows` rows spread evenly over `experts`
    experts of [N, K] (layout "nk": F.grouped_mm's W[E, N, K] transposed;
    "kn": W[E, K, N] stored as is). kind "_grouped_mm"; "_scaled_grouped_mm"
    (fp8 operands, row-wise scales); "moe_experts" (bf16 rows, fp8 weights).
    It runs on SAMPLE_N of the N output columns and counts for N / SAMPLE_N
    times that: the kernels split N evenly over threadgroups, each doing the
    same work."""
    g = torch.Generator().manual_seed(rows + k + n)
    counts = [rows // experts + (1 if i < rows % experts else 0) for i in range(experts)]
    offs = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    act = torch.float8_e4m3fn if kind == "_scaled_grouped_mm" else dtype
    a = torch.randn(rows * k + misaligned, generator=g).to(act)[misaligned:].view(rows, k)
    m = SAMPLE_N
    ops = torch.ops.mps_ext
    if kind == "_grouped_mm":
        shape = (experts, m, k) if layout == "nk" else (experts, k, m)
        w = torch.randn(experts * m * k + misaligned, generator=g).to(dtype)[misaligned:].view(shape)
        b = w.transpose(-2, -1) if layout == "nk" else w
        run = lambda: ops._grouped_mm(a, b, offs)  # noqa: E731
        minimum = a.nbytes + experts * n * k * a.element_size() + rows * n * a.element_size()
    elif kind == "_scaled_grouped_mm":
        w, sa, sb = torch.randn(experts, m, k, generator=g).to(act), torch.ones(rows), torch.ones(experts, m)
        run = lambda: ops._scaled_grouped_mm(a, w.transpose(-2, -1), sa, sb, offs)  # noqa: E731
        minimum = a.nbytes + experts * n * k + sa.nbytes + experts * n * 4 + rows * n * 2
    else:
        w, scale = quantize_rows_zero((experts, m, k))
        run = lambda: ops.moe_experts(a, w, scale, offs, None, 1, False)  # noqa: E731
        minimum = a.nbytes + experts * n * k + experts * n * 4 + rows * n * a.element_size()
    return Prepared(run, minimum, scale=n / m)


EXPERT_DOWN = (768, 2048)  # Qwen3-30B-A3B: an expert's down projection, K -> N


def grouped_case(kind, dtype, rows, layout, misaligned=0, op="grouped_mm", shape=EXPERT_DOWN, experts=8) -> Case:
    """The Case of grouped(kind, ...) at `shape` (K, N)."""
    k, n = shape
    labels = {"case": kind, "model": f"Qwen3-30B-A3B expert down {k}->{n}, {experts} experts",
              "experts": "fp8" if kind != "_grouped_mm" else str(dtype)[6:],
              "activation": "float8_e4m3fn" if kind == "_scaled_grouped_mm" else str(dtype)[6:],
              "tokens / rows": str(rows), "weight": f"[E,{layout.upper()}]" + (" misaligned" if misaligned else "")}
    id_ = f"{kind} {labels['experts']} {labels['activation']} rows={rows} {layout}" + (
        " misaligned" if misaligned else "")
    return Case(op, id_, labels, lambda: grouped(kind, dtype, rows, k, n, experts, layout, misaligned))


def cases(size: str) -> list[Case]:
    if size == "tiny":
        return [grouped_case("_grouped_mm", torch.bfloat16, 8, "nk", shape=(128, 256), experts=2)]
    out = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for layout in ("nk", "kn"):
            out.append(grouped_case("_grouped_mm", dtype, 64, layout))
            out.append(grouped_case("_grouped_mm", dtype, 64, layout, misaligned=1))
        out.append(grouped_case("_grouped_mm", dtype, 128, "nk"))
    out.append(grouped_case("_scaled_grouped_mm", None, 64, "nk"))
    out.append(grouped_case("_scaled_grouped_mm", None, 64, "nk", misaligned=1))
    out.append(grouped_case("_scaled_grouped_mm", None, 128, "nk"))
    return out


if __name__ == "__main__":
    run_as_script("grouped_mm")
