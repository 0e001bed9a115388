"""The fp8 matrix products (the scaled_mm family): the cases of `python -m
benchmarks scaled_mm`.

    python benchmarks/bench_scaled_mm.py [--quick | --tiny] [--check]   (the same; --check: below)

_scaled_mm (fp8 activations and weights, row-wise and 128x128 block-wise
scales) at the GEMV benchmark's shapes, decode (1, 2, 4, 8 rows) and prefill
(128, 512, 2048 rows); fp8_linear (FP8Linear: fp32, fp16 or bf16
activations, fp8 weights, row-wise scales; at 128 rows in 16 bits also
128 x 128 block scales, which keep fp8_mm_tile where row-wise ones run
gmm_tiled_dense_<act>_e4m3w) and a 16-byte-misaligned activation (the
element-load kernels) at an MoE expert's shape;
rms_norm_fp8_linear (a decoder layer's input norm in its fused fp8 q/k/v
GEMV) at LFM2.5's attention, one bf16 row. On a Mac,
stock torch's bf16 F.linear against FP8Linear. (The conversions to and from
fp8 are the fp8 family's: benchmarks/bench_fp8.py.)

Prefill on the executor would take hours at these shapes, so it is measured
on a block of 1 x 4 tiles (64 rows, 256 columns, the full K) and scaled by
the number of tiles: every 64 x 64 tile of fp8_mm_tile (and of the dense
gmm_tiled) does the same work
(it reads 64 activation rows and 64 weight rows over all of K, and the
scales of those, and writes its outputs), and every shape here is a whole
number of tiles. --check measures one prefill shape in full and compares.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_linear import SHAPES  # noqa: E402
from benchmarks.common import Case, Prepared, measure, run_as_script  # noqa: E402

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
DECODE_ROWS = [1, 2, 4, 8]
PREFILL_ROWS = [128, 512, 2048]
# fp8_mm_tile's outputs a threadgroup, FP8_TILE_M x FP8_TILE_N of the header the kernel and the host share
TILE_M, TILE_N = (int(re.search(rf"#define FP8_TILE_{d} (\d+)", (Path(__file__).resolve().parents[1] / "kernels_metal"
                                                                  / "fp8_params.h").read_text()).group(1))
                  for d in "MN")
SAMPLE_M, SAMPLE_N = TILE_M, 4 * TILE_N  # the block prefill is measured on
EXPERT = (2048, 768, "Qwen3-30B-A3B expert up")
NOTES = """\
w read / size: bytes read from the fp8 weight over its size; bound: what the product may read (decode <= 1.02,
prefill <= rows / 64: each 64-row tile reads the weight once). 16-byte loads: share of the weight bytes read with
16-byte loads. act read / w size: activation bytes read over the weight's size (decode: every threadgroup stages the
activation rows once for its simdgroups, from the GPU's caches; prefill: every 64 x 64 tile reads its 64 rows, N / 64 times). bytes / min
counts every read, re-reads included; us @chip counts the weight bytes as read and every other operand once (the
re-read activations and scales stay in the caches). Prefill rows (rows > 8) are scaled from a 64 x 256 sample block
(1 x 4 tiles, full K) by the tile count. Times (stock bf16 F.linear against FP8Linear) only on a Mac."""  # noqa: E501


def tiles(rows, n):
    return -(-rows // TILE_M) * -(-n // TILE_N)


def fp8(*shape, misaligned=0):
    """A random fp8 tensor; misaligned: one byte off 16-byte alignment."""
    n = 1
    for s in shape:
        n *= s
    return torch.randn(n + misaligned).to(E4)[misaligned:].view(shape)


def scaled_mm(rows, k, n, recipe, misaligned=0):
    """A call of _scaled_mm_v2 on fp8 operands (recipe: row-wise or 128x128
    block-wise scales), bf16 out."""
    x, w = fp8(rows, k, misaligned=misaligned), fp8(n, k)
    kb, nb = -(-k // 128), -(-n // 128)
    scales = ([torch.ones(rows, 1)], [1], [], [torch.ones(1, n)], [1], []) if recipe == "row" else (
        [torch.ones(rows, kb)], [4], [], [torch.ones((kb + 3) // 4 * 4, nb)], [5], [])
    return lambda: torch.ops.mps_ext._scaled_mm_v2(x, w.t(), *scales, None, torch.bfloat16, [], False)


def product(kind, act, rows, k, n, recipe, misaligned) -> Prepared:
    """kind "scaled_mm": fp8 activations; "fp8_linear": activations of dtype
    `act`, weight scales of granularity `recipe` ("row", or "block": 128 x
    128, which keeps 16-bit prefill on fp8_mm_tile, where row-wise scales
    take gmm_tiled_dense_<act>_e4m3w). Prefill runs a SAMPLE_M x SAMPLE_N block."""
    prefill = rows > 8
    run_rows, run_n = (SAMPLE_M, min(SAMPLE_N, n)) if prefill else (rows, n)
    if kind == "scaled_mm":
        run = scaled_mm(run_rows, k, run_n, recipe, misaligned)
        kb, nb = -(-k // 128), -(-n // 128)
        minimum = rows * k + n * k + ((rows + n) * 4 if recipe == "row" else (rows * kb + kb * nb) * 4) + rows * n * 2
    elif kind == "fp8_linear":
        x = torch.randn(run_rows * k + misaligned).to(act)[misaligned:].view(run_rows, k)
        w = fp8(run_n, k)
        ws = torch.rand(run_n) / 100 if recipe == "row" else torch.rand(-(-run_n // 128), -(-k // 128)) / 100
        run = lambda: torch.ops.mps_ext.fp8_linear(x, w, ws, recipe, None)  # noqa: E731
        minimum = (rows * k + rows * n) * x.element_size() + n * k + (n if recipe == "row" else -(-n // 128) *
                                                                       -(-k // 128)) * 4
    else:  # rms_norm_fp8_linear: fp8_linear of a decode row's input norm, which the GEMV computes
        x, nw = (torch.randn(rows, k) * 3).to(act), (torch.randn(k) * 0.2 + 1).to(act)
        w, ws = fp8(n, k), torch.rand(n) / 100
        run = lambda: torch.ops.mps_ext.rms_norm_fp8_linear(x, nw, 1e-6, "weight", w, ws, "row", None)  # noqa: E731
        # fp8_linear's, with the norm's weight read and the normed row written once
        minimum = (2 * rows * k + k + rows * n) * x.element_size() + n * k + n * 4

    def scale(stats):
        return tiles(rows, n) / stats[0].total_threadgroups if prefill else 1

    def read(stats, name):
        (d,) = stats
        return d.bytes_read.get(d.buffer(name), 0) * scale(stats)

    def extras(stats):
        (d,) = stats
        wi = d.buffer("w")
        act = "a" if d.kernel.startswith("gmm_tiled") else "x"  # (gmm_tiled_dense_<act>_e4m3w's name for it)
        return {"w read / size": f"{read(stats, 'w') / (n * k):.3f}",
                "bound": f"{rows / TILE_M:.0f}" if prefill else "1.02",
                "16-byte loads": f"{d.read_widths[wi].get(16, 0) * 16 / d.bytes_read[wi]:.0%}",
                "act read / w size": f"{read(stats, act) / (n * k):.3f}"}

    def mac():
        import mps_ext

        layer = torch.nn.Linear(k, n, bias=False, device="mps", dtype=torch.bfloat16)
        q = mps_ext.FP8Linear.from_linear(layer, recipe)
        xm = torch.randn(rows, k, dtype=torch.bfloat16, device="mps")
        if kind == "rms_norm_fp8_linear":
            nwm = torch.ones(k, dtype=torch.bfloat16, device="mps")
            return ((lambda: layer(torch.nn.functional.rms_norm(xm, (k,), nwm, 1e-6))),
                    (lambda: torch.ops.mps_ext.rms_norm_fp8_linear(xm, nwm, 1e-6, "weight", q.weight, q.weight_scale,
                                                                   recipe, None)))
        return (lambda: layer(xm)), (lambda: q(xm))

    return Prepared(run, minimum, mac, extras, scale,
                    dram_bytes=lambda stats: read(stats, "w") + minimum - n * k)


def name(dtype):
    return str(dtype)[6:]


def cases(size: str) -> list[Case]:
    out = []

    def add(kind, act, k, n, model, rows, recipe, misaligned=0):
        labels = {"op": kind, "K->N": f"{k}->{n}", "layer": model, "activation": name(act), "rows": str(rows),
                  "scales": recipe}
        id_ = f"{kind} {k}->{n} {name(act)} rows={rows} {recipe}" + (" misaligned" if misaligned else "")
        out.append(Case("scaled_mm", id_, labels, lambda: product(kind, act, rows, k, n, recipe, misaligned)))

    if size == "tiny":
        add("scaled_mm", E4, 256, 128, "tiny", 1, "row")
        add("fp8_linear", torch.bfloat16, 256, 128, "tiny", 2, "row")
        add("fp8_linear", torch.float16, 256, 128, "tiny", 128, "block")  # fp8_mm_tile
        return out
    for k, n, model in SHAPES:
        if size == "quick" and n * k > 4096 * 4096:
            continue
        for rows in DECODE_ROWS + PREFILL_ROWS:
            for recipe in ("row", "block"):
                add("scaled_mm", E4, k, n, model, rows, recipe)
    k, n, model = EXPERT
    # 16-bit activations' prefill: row-wise scales on gmm_tiled_dense_<act>_e4m3w, block scales on fp8_mm_tile
    sixteen = (torch.float16, torch.bfloat16)
    for act in (torch.float32, torch.float16, torch.bfloat16):
        for rows in DECODE_ROWS + PREFILL_ROWS[:1]:
            add("fp8_linear", act, k, n, model, rows, "row")
        if act in sixteen:
            add("fp8_linear", act, k, n, model, PREFILL_ROWS[0], "block")
    for act in (E4, torch.float32, torch.float16, torch.bfloat16):
        for rows in DECODE_ROWS + PREFILL_ROWS[:1]:
            add("scaled_mm" if act == E4 else "fp8_linear", act, k, n, model + ", misaligned activation", rows, "row",
                misaligned=1)
        if act in sixteen:
            add("fp8_linear", act, k, n, model + ", misaligned activation", PREFILL_ROWS[0], "block", misaligned=1)
    # A decoder layer's input norm in its fused fp8 q/k/v GEMV (mps_ext.optimize after quantize_fp8, decode)
    add("rms_norm_fp8_linear", torch.bfloat16, 2048, 3072, "LFM2.5-8B-A1B attention q + k + v, with its input norm",
        1, "row")
    return out


def check():
    """One prefill shape measured in full against its scaling from tiles."""
    k, n, rows = 768, 2048, 128
    for recipe in ("row", "block"):
        scaled = measure(Case("scaled_mm", "sampled", {}, lambda: product("scaled_mm", E4, rows, k, n, recipe, 0)),
                         mac=False)
        whole = measure(Case("scaled_mm", "whole", {}, lambda: Prepared(scaled_mm(rows, k, n, recipe), 1)),
                        mac=False)
        print(f"check {k}->{n} rows={rows} {recipe}: measured threadgroups {whole.threadgroups}, bytes "
              f"{whole.memory_bytes:.0f}; scaled from tiles {scaled.threadgroups}, {scaled.memory_bytes:.0f}")


if __name__ == "__main__":
    if "--check" in sys.argv:
        check()
    else:
        run_as_script("scaled_mm")
