"""Decode-time linear layers: the cases of `python -m benchmarks linear`.

    python benchmarks/bench_linear.py [--quick | --tiny]   (the same)

1, 2, 4 and 8 activation rows against the weights of real models, fp16 and
bf16: F.linear's [N, K] weight (gemv_rows) at every shape, x @ W with W
stored [K, N] (gemv_cols) at the shapes below the vocabulary size; fp32 at
an MoE expert's shapes, and a weight 16-byte misaligned (the element-load
kernels) at the MoE router's and an expert's (2 outputs per simdgroup). --quick leaves out the vocabulary-sized shapes and the 4096 x 14336
ones. rms_norm_linear (the input norm in the GEMV that reads it) at the
decoder layers' fused projections of Qwen3.6 and LFM2.5 (NORMED_SHAPES); sigmoid_gate_linear (the
attention's output gate in its o_proj's GEMV) at Qwen3.6's (GATED_SHAPES). On a Mac, each timed call starts with the weight out of the
system-level cache (common.mac_times).

Prefill (PREFILL): F.linear past 8 rows in fp16 and bf16 (gmm_tiled_dense, a 64 x 64 tile a threadgroup), measured
on one 64-row strip of 4 tiles (bench_scaled_mm's SAMPLE_M x SAMPLE_N block), which every other strip of the product
repeats: the case stands for the whole product (its scale).
"""  # noqa: E501

from __future__ import annotations

import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import Case, Prepared, run_as_script  # noqa: E402

SHAPES = [  # (K -> N, model)
    (4096, 4096, "Llama-3-8B q/o proj"),
    (4096, 14336, "Llama-3-8B up/gate"),
    (14336, 4096, "Llama-3-8B down"),
    (4096, 128256, "Llama-3-8B lm_head"),
    (2048, 768, "Qwen3-30B-A3B expert up"),
    (768, 2048, "Qwen3-30B-A3B expert down"),
    (2048, 151936, "Qwen3 lm_head"),
]  # and (2048 -> 128, the Qwen3-30B-A3B router) misaligned
VOCABULARY = 100000  # N beyond this: a vocabulary-sized lm_head (no x @ W)
ROWS = [1, 2, 4, 8]
NOTES = (
    "weight read / size: bytes the kernel read from the weight over its size. 16-byte loads: the share of "
    "weight bytes read by 16-byte loads. activation reads: times the activation was read (from cache on a GPU: the projected times count it once)."  # noqa: E501
)


def weight_columns(stats, w: torch.Tensor, x: torch.Tensor) -> dict[str, str]:
    d = stats[0]  # the weight's dispatch (x @ W with K split: gemv_cols_finish adds the splits' sums after it)
    i = d.buffer("w")
    read = d.bytes_read[i]
    return {"weight read / size": f"{read / w.nbytes:.3f}",
            "16-byte loads": f"{d.read_widths[i].get(16, 0) * 16 / read:.0%}",
            "activation reads": f"{d.bytes_read[d.buffer('x')] / x.nbytes:.0f}"}


def dram_bytes(stats, x: torch.Tensor) -> int:
    """Bytes moved, with the activation read once: every threadgroup reads
    it (at most 8 rows, a few hundred KB) at the same time, so a GPU serves the
    re-reads from its cache."""
    moved = sum(d.memory_bytes_moved for d in stats)
    return moved - stats[0].bytes_read[stats[0].buffer("x")] + x.nbytes


def prepare(k, n, rows, dtype, layout, misaligned) -> Prepared:
    """layout "[N,K]": F.linear(x, w); "[K,N]": x @ w with w stored [K, N]."""
    shape = (n, k) if layout == "[N,K]" else (k, n)
    # One element more in front puts the weight 2 or 4 bytes off 16-byte alignment.
    w = torch.randn(n * k + misaligned).to(dtype)[misaligned:].view(shape)
    x = torch.randn(rows, k).to(dtype)
    minimum = w.nbytes + x.nbytes + rows * n * w.element_size()

    def run():
        return torch.ops.mps_ext.linear(x, w, None) if layout == "[N,K]" else torch.ops.mps_ext.mm(x, w)

    def mac():
        wm, xm = w.to("mps"), x.to("mps")

        def step():
            return torch.nn.functional.linear(xm, wm) if layout == "[N,K]" else xm @ wm

        return step, step

    return Prepared(run, minimum, mac, lambda stats: weight_columns(stats, w, x),
                    dram_bytes=lambda stats: dram_bytes(stats, x))


# Prefill: (K -> N, model, rows), a dense projection's product past 8 rows.
PREFILL = [(2048, 768, "a 2048-wide model's projection (Qwen3.6, Qwen3-30B-A3B: hidden 2048)", 128)]


def prepare_prefill(k, n, rows, dtype) -> Prepared:
    from benchmarks import bench_scaled_mm
    run_rows, run_n = bench_scaled_mm.SAMPLE_M, min(bench_scaled_mm.SAMPLE_N, n)
    w = (torch.randn(run_n, k) * k ** -0.5).to(dtype)
    x = torch.randn(run_rows, k).to(dtype)
    minimum = (rows * k + n * k + rows * n) * w.element_size()

    def scale(stats):
        return bench_scaled_mm.tiles(rows, n) / stats[0].total_threadgroups

    def extras(stats):
        (d,) = stats
        wi = d.buffer("w")
        return {"weight read / size": f"{d.bytes_read[wi] * scale(stats) / (n * k * w.element_size()):.3f}",
                "16-byte loads": f"{d.read_widths[wi].get(16, 0) * 16 / d.bytes_read[wi]:.0%}",
                "activation reads": f"{d.bytes_read[d.buffer('a')] * scale(stats) / (rows * k * x.element_size()):.0f}"}

    def mac():
        wm, xm = torch.randn(n, k, dtype=dtype, device="mps"), torch.randn(rows, k, dtype=dtype, device="mps")

        def step():
            return torch.nn.functional.linear(xm, wm)

        return step, step

    return Prepared(lambda: torch.ops.mps_ext.linear(x, w, None), minimum, mac, extras, scale)


# A decoder layer's input norm in the GEMV of the projections that read it
# (torch.ops.mps_ext.rms_norm_linear: mps_ext.optimize's decoder layers at
# decode): (K -> N, model), bf16, one row, zero-centred norms (Qwen3.6) or
# weight ones (LFM2.5). Its minimum is the linear's plus the norm's weight
# read and the normed row written once.
NORMED_SHAPES = [
    (2048, 9216, "zero_centred", "Qwen3.6-35B-A3B attention q (with its gate) + k + v"),
    (2048, 12352, "zero_centred", "Qwen3.6-35B-A3B Gated DeltaNet in_proj qkv + z + b + a"),
    (2048, 3072, "weight", "LFM2.5-8B-A1B attention q + k + v"),
]


def prepare_normed(k, n, variant, dtype) -> Prepared:
    from mps_ext.passes.norm import rms_norm_reference
    w = (torch.randn(n, k) * k ** -0.5).to(dtype)
    x = (torch.randn(1, k) * 3).to(dtype)
    nw = (torch.randn(k) * 0.2 + (1 if variant == "weight" else 0)).to(dtype)
    minimum = w.nbytes + 2 * x.nbytes + nw.nbytes + n * w.element_size()

    def run():
        return torch.ops.mps_ext.rms_norm_linear(x, nw, 1e-6, variant, w, None)

    def mac():
        wm, xm, nwm = w.to("mps"), x.to("mps"), nw.to("mps")
        return (lambda: torch.nn.functional.linear(rms_norm_reference(xm, nwm, 1e-6, variant), wm),
                lambda: torch.ops.mps_ext.rms_norm_linear(xm, nwm, 1e-6, variant, wm, None))

    return Prepared(run, minimum, mac, lambda stats: weight_columns(stats, w, x),
                    dram_bytes=lambda stats: dram_bytes(stats, x))


# An attention layer's output gate in the GEMV of its o_proj
# (torch.ops.mps_ext.sigmoid_gate_linear: mps_ext.optimize's gated attention
# at decode): (heads, head_dim, N, model), bf16, one row. Its minimum is the
# linear's plus the gate's read (x's bytes again).
GATED_SHAPES = [(16, 256, 2048, "Qwen3.6-35B-A3B attention o_proj")]


def prepare_gated(heads, d, n, dtype) -> Prepared:
    k = heads * d
    w = (torch.randn(n, k) * k ** -0.5).to(dtype)
    x = torch.randn(1, k).to(dtype)
    gate = torch.chunk((torch.randn(1, heads, 2 * d) * 3).to(dtype), 2, dim=-1)[1]  # q_proj's second halves
    minimum = w.nbytes + 2 * x.nbytes + n * w.element_size()

    def run():
        return torch.ops.mps_ext.sigmoid_gate_linear(x, gate, w, None)

    def mac():
        wm, xm, gm = w.to("mps"), x.to("mps"), gate.to("mps")
        return (lambda: torch.nn.functional.linear(xm * torch.sigmoid(gm.reshape(xm.shape)), wm),
                lambda: torch.ops.mps_ext.sigmoid_gate_linear(xm, gm, wm, None))

    def moved(stats):  # x and the gate once (dram_bytes: every threadgroup reads them from the caches)
        d = stats[0]
        return dram_bytes(stats, x) - d.bytes_read[d.buffer("gate")] + x.nbytes

    return Prepared(run, minimum, mac, lambda stats: weight_columns(stats, w, x), dram_bytes=moved)


def cases(size: str) -> list[Case]:
    plan = []  # (k, n, model, dtypes, layouts, misaligned)
    if size == "tiny":
        plan = [(256, 128, "tiny", [torch.float16], ["[N,K]", "[K,N]"], 0)]
    else:
        for k, n, model in SHAPES:
            if size == "quick" and n * k > 4096 * 4096:
                continue
            layouts = ["[N,K]"] + (["[K,N]"] if n <= VOCABULARY else [])
            plan.append((k, n, model, [torch.float16, torch.bfloat16], layouts, 0))
        plan.append((768, 2048, "Qwen3-30B-A3B expert down", [torch.float32], ["[N,K]", "[K,N]"], 0))
        plan.append((2048, 768, "Qwen3-30B-A3B expert up", [torch.float32], ["[N,K]"], 0))
        plan.append((2048, 128, "Qwen3-30B-A3B router, misaligned weight",
                     [torch.float32, torch.float16, torch.bfloat16], ["[N,K]", "[K,N]"], 1))
        plan.append((768, 2048, "Qwen3-30B-A3B expert down, misaligned weight",
                     [torch.float32, torch.float16, torch.bfloat16], ["[N,K]"], 1))
    out = []
    for k, n, model, dtypes, layouts, misaligned in plan:
        for layout in layouts:
            for dtype in dtypes:
                for rows in ROWS if size != "tiny" else [1, 2]:
                    labels = {"K->N": f"{k}->{n}", "layer": model, "weight": layout, "dtype": str(dtype)[6:],
                              "rows": str(rows)}
                    id_ = f"{k}->{n} {layout} {labels['dtype']} rows={rows}" + (" misaligned" if misaligned else "")
                    out.append(Case("linear", id_, labels,
                                    lambda a=(k, n, rows, dtype, layout, misaligned): prepare(*a)))
    for k, n, model, rows in PREFILL if size != "tiny" else []:
        for dtype in (torch.float16, torch.bfloat16):
            labels = {"K->N": f"{k}->{n}", "layer": model, "weight": "[N,K]", "dtype": str(dtype)[6:],
                      "rows": str(rows)}
            out.append(Case("linear", f"prefill {k}->{n} [N,K] {labels['dtype']} rows={rows}", labels,
                            lambda a=(k, n, rows, dtype): prepare_prefill(*a)))
    for k, n, variant, model in NORMED_SHAPES if size != "tiny" else [(256, 128, "weight", "tiny")]:
        labels = {"K->N": f"{k}->{n}", "layer": f"{model}, with its input norm", "weight": "[N,K]",
                  "dtype": "bfloat16", "rows": "1"}
        out.append(Case("linear", f"rms_norm_linear {k}->{n} {variant} bfloat16 rows=1", labels,
                        lambda a=(k, n, variant, torch.bfloat16): prepare_normed(*a)))
    for heads, d, n, model in GATED_SHAPES if size != "tiny" else [(2, 64, 128, "tiny")]:
        labels = {"K->N": f"{heads * d}->{n}", "layer": f"{model}, with its output gate", "weight": "[N,K]",
                  "dtype": "bfloat16", "rows": "1"}
        out.append(Case("linear", f"sigmoid_gate_linear {heads * d}->{n} bfloat16 rows=1", labels,
                        lambda a=(heads, d, n, torch.bfloat16): prepare_gated(*a)))
    return out


if __name__ == "__main__":
    run_as_script("linear")
