"""Compute efficiency of the tiled (prefill) kernels against MLX's steel GEMM
at the same shapes (issue 32, point 2): the executor's compute counters
(DispatchStats.matrix_flops, flops_per_device_byte,
flops_per_threadgroup_byte, matrix_slot_fraction; docs/dev/contributing.md,
"Compute efficiency") for fp8_mm_tile and gmm_tiled, beside the same for
MLX's `gemm` kernel (steel/gemm/kernels/steel_gemm_fused.h of the pinned
mlx-metal wheel, tools/metal_corpus.py) run on the executor.

Steel runs as MLX runs it for a matmul on the large device class ('d', the
M3 Ultra of the issue's goals): the tile MLX's GEMM_TPARAM_MACRO picks
(steel_tiles), its function constants fixed as MLX sets them for a plain
product (no batch, no bias, alignment from the shape), `x @ w.T` with w
stored [N, K] as a linear layer's weight (transpose_b). The executor has no
pipeline to take function constants from, so they are written into the
header's text before it compiles (what Metal does when it specialises the
pipeline). fp8 operands have no steel kernel: an fp8 product is compared
with steel in bfloat16, the type the same model runs in without fp8.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import sys
from pathlib import Path

import numpy as np
import torch

import mps_ext_executor as cpu_metal
from benchmarks import bench_scaled_mm

ROOT = Path(__file__).resolve().parent.parent
KERNELS = "mlx/backend/metal/kernels"

# The function constants of steel_gemm_fused.h by index (MLX's matmul.cpp
# sets 10 has_batch, 100 use_out_source, 110 do_axpby, 200-202 align_M/N/K).
_FC_DECL = re.compile(r"constant bool (\w+) \[\[function_constant\((\d+)\)\]\];")
_FC_ATTR = re.compile(r",\s*function_constant\(\w+\)")
_INCLUDE = re.compile(r'^\s*#include "([^"]+)"\s*$', re.M)
_MSL_TYPES = {torch.float32: "float", torch.float16: "half", torch.bfloat16: "bfloat16_t"}


def _mlx_include() -> Path:
    if str(ROOT / "tools") not in sys.path:
        sys.path.insert(0, str(ROOT / "tools"))
    import metal_corpus

    return metal_corpus.fetch_mlx()


# Overloads and specialisations that differ from a `thread` one only in
# their address space: one definition once the executor's run mode erases
# address spaces (check mode keeps them: the corpus test), so all but the
# `thread` one go (the same code).
_ADDRESS_SPACE_TWINS = [
    re.compile(r"template <typename T>\s*struct pointer_element<(?:device|constant|threadgroup) T\*> \{[^}]*\};"),
    re.compile(r"template <typename T>\s*constexpr (?:device|threadgroup) complex_t<T>& operator\S+\([^)]*\)\s*"
               r"\{[^}]*\}"),
]


def _inline(path: str, include: Path, seen: set[str]) -> str:
    """The header with its quoted includes (MLX's own) inlined once each, so
    that the source is self-contained as compile_library takes it."""
    if path in seen:
        return ""
    seen.add(path)
    text = (include / path).read_text().replace("#pragma once", "")
    for twin in _ADDRESS_SPACE_TWINS:
        text = twin.sub("", text)
    return _INCLUDE.sub(lambda m: _inline(m.group(1), include, seen), text)


def steel_tiles(dtype: torch.dtype, m: int, n: int, k: int) -> tuple[int, int, int, int, int]:
    """(bm, bn, bk, wm, wn) MLX picks for `x @ w.T` (nt) on a large device
    ('d'): GEMM_TPARAM_MACRO of mlx/backend/metal/matmul.cpp."""
    half = dtype != torch.float32
    if m * n >= 1 << 20:
        if not half:
            return 64, 64, 16, 2, 2  # float takes the default
        return (64, 64, 16, 1, 2) if 2 * max(m, n) > k else (64, 32, 32, 2, 2)
    return (64, 32, 32, 2, 2) if half else (32, 64, 16, 1, 2)


@functools.lru_cache(maxsize=None)
def _library(dtype: torch.dtype, tiles: tuple, aligned: tuple[bool, bool, bool]) -> cpu_metal.Library:
    include = _mlx_include()
    seen: set[str] = set()
    head = "".join(_inline(f"{KERNELS}/{p}", include, seen) for p in ("utils.h", "steel/gemm/gemm.h"))
    values = {10: False, 100: False, 110: False, 200: aligned[0], 201: aligned[1], 202: aligned[2]}
    fused = _inline(f"{KERNELS}/steel/gemm/kernels/steel_gemm_fused.h", include, seen)
    fused = _FC_DECL.sub(lambda m: f"constant bool {m.group(1)} = {str(values[int(m.group(2))]).lower()};", fused)
    fused = _FC_ATTR.sub("", fused)
    bm, bn, bk, wm, wn = tiles
    t = _MSL_TYPES[dtype]
    inst = f"gemm<{t}, {bm}, {bn}, {bk}, {wm}, {wn}, false, true, float>"
    source = (f"#include <metal_stdlib>\n{head}\n{fused}\n"
              f'template [[host_name("steel_gemm")]] [[kernel]] decltype({inst}) {inst};\n')
    return cpu_metal.compile_library(source, filename="steel_gemm_fused.metal")


def _params(m, n, k, tiles) -> tuple[bytes, bytes]:
    bm, bn, bk, _, _ = tiles
    gemm = np.zeros((), dtype=np.dtype(
        [(f, "<i4") for f in ("M", "N", "K", "lda", "ldb", "ldd", "tiles_n", "tiles_m")]
        + [(f, "<i8") for f in ("batch_stride_a", "batch_stride_b", "batch_stride_d")]
        + [(f, "<i4") for f in ("swizzle_log", "gemm_k_iterations_aligned", "batch_ndim")], align=True))
    tn, tm = -(-n // bn), -(-m // bm)
    for f, v in dict(M=m, N=n, K=k, lda=k, ldb=k, ldd=n, tiles_n=tn, tiles_m=tm, batch_stride_a=m * k,
                     batch_stride_b=n * k, batch_stride_d=m * n, swizzle_log=0,
                     gemm_k_iterations_aligned=k // bk, batch_ndim=1).items():
        gemm[f] = v
    # Read by the kernel's epilogue set-up even without a bias (alpha, beta).
    addmm = np.zeros((), dtype=np.dtype([("ldc", "<i4"), ("fdc", "<i4"), ("batch_stride_c", "<i8"),
                                         ("alpha", "<f4"), ("beta", "<f4")], align=True))
    addmm["alpha"], addmm["beta"] = 1.0, 0.0
    return gemm.tobytes(), addmm.tobytes()


@functools.lru_cache(maxsize=None)
def steel(dtype: torch.dtype, m: int, n: int, k: int, tiles: tuple | None = None) -> cpu_metal.DispatchStats:
    """MLX's steel GEMM D = x @ w.T (x [m, k], w [n, k]) in `dtype` on the
    executor, with counters; `tiles` by default steel_tiles at this shape.
    Checked against the product in float64."""
    tiles = tiles or steel_tiles(dtype, m, n, k)
    bm, bn, bk, wm, wn = tiles
    g = torch.Generator().manual_seed(m * 7 + n * 5 + k)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    d = torch.zeros(m, n, dtype=dtype)
    params, addmm = _params(m, n, k, tiles)
    lib = _library(dtype, tiles, (m % bm == 0, n % bn == 0, k % bk == 0))
    # C and the batch tables are bound as Metal requires every argument to
    # be, though with use_out_source and has_batch false the kernel reads none
    unused = torch.zeros(1, dtype=dtype)
    batch = (np.zeros(1, np.int32).tobytes(), np.zeros(2, np.int64).tobytes())
    s = lib.dispatch("steel_gemm", [x, w, unused, d, params, addmm, *batch],
                     threadgroups=(-(-n // bn), -(-m // bm), 1), threads_per_threadgroup=(32, wn, wm), counters=True)
    want = x.double() @ w.double().T
    err = (d.double() - want).abs().max().item()
    # float accumulation, one rounding to dtype: well within 2^-6 of the scale
    bound = (2.0 ** -6 if dtype != torch.float32 else 1e-4) * max(1.0, want.abs().max().item())
    if err > bound:
        raise AssertionError(f"steel GEMM {dtype} {m}x{n}x{k} on the executor is off by {err} (bound {bound})")
    return s


@dataclasses.dataclass
class Figures:
    """The compute counters of a set of dispatches that together do one
    product of `useful_flops` (2 M N K)."""

    matrix_flops: int
    useful_flops: int
    flops_per_device_byte: float  # matrix FLOPs per byte moved over tensor buffers
    flops_per_threadgroup_byte: float
    matrix_slot_fraction: float
    reuse: dict[str, float]  # per operand: device bytes read over its size (the product's, scaled)
    other_slots_per_mma: float  # issue slots of everything else (loads, addresses, conversions) per MMA

    @property
    def useful_slot_fraction(self) -> float:
        """matrix_slot_fraction counting only the MMAs the product needs
        (a tile padded past the rows it has multiplies zeros)."""
        return self.matrix_slot_fraction * self.useful_flops / self.matrix_flops if self.matrix_flops else 0.0


def figures(stats: list[cpu_metal.DispatchStats], useful_flops: int, operands: dict[str, tuple[str, int]] = None,
            scale: float = 1.0) -> Figures:
    """Figures of the dispatches; `operands`: name -> (buffer parameter,
    bytes of the whole operand), whose reads (times `scale`, for a sample
    block that stands for the whole product) give `reuse`."""
    flops = sum(d.matrix_flops for d in stats)
    moved = sum(d.memory_bytes_moved for d in stats)
    tg = sum(d.threadgroup_bytes for d in stats)
    slots = sum(d.issue_slots for d in stats)
    mma_slots = sum(d.matrix_issue_slots for d in stats)
    reuse = {}
    for name, (param, size) in (operands or {}).items():
        read = sum(d.bytes_read.get(d.buffer(param), 0) for d in stats)
        reuse[name] = read * scale / size
    mmas = sum(d.simdgroup_mmas for d in stats)
    return Figures(flops, useful_flops, flops / moved if moved else 0.0, flops / tg if tg else 0.0,
                   mma_slots / slots if slots else 0.0, reuse, (slots - mma_slots) / mmas if mmas else 0.0)


# ------------------------------------------------- the benchmark's cases --
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
SAMPLE_N_GROUPED = 256  # bench_grouped_mm.SAMPLE_N


@dataclasses.dataclass(frozen=True)
class Shape:
    """What a tiled case computes, as the sample it runs: `groups` products
    of m x n x k (a grouped product: one per expert), standing for
    `full_m` x `full_n` (tile choice, reuse)."""

    dtype: torch.dtype  # steel's: the activation's, bfloat16 for fp8
    m: int
    n: int
    k: int
    groups: int
    full_m: int
    full_n: int
    act_bytes: int  # element sizes of our kernels' operands (fp8: 1)
    weight_bytes: int

    @property
    def useful_flops(self) -> int:
        return 2 * self.groups * self.m * self.n * self.k


def shape_of(op: str, labels: dict[str, str]) -> Shape | None:
    """The Shape of a scaled_mm, grouped_mm or linear benchmark case that runs a
    tiled kernel (prefill: more than 8 rows per product), else None."""
    if op == "scaled_mm":
        rows = int(labels["rows"])
        if rows <= 8:
            return None
        k, n = (int(v) for v in labels["K->N"].split("->"))
        dtype = _DTYPES.get(labels["activation"], torch.bfloat16)
        act = dtype.itemsize if labels["activation"] in _DTYPES else 1
        return Shape(dtype, bench_scaled_mm.SAMPLE_M, min(bench_scaled_mm.SAMPLE_N, n), k, 1, rows, n, act, 1)
    if op == "linear":  # bench_linear's prefill cases: a SAMPLE_M x SAMPLE_N block of gmm_tiled_dense's tiles
        rows = int(labels["rows"])
        if rows <= 8:
            return None
        k, n = (int(v) for v in labels["K->N"].split("->"))
        dtype = _DTYPES[labels["dtype"]]
        return Shape(dtype, bench_scaled_mm.SAMPLE_M, min(bench_scaled_mm.SAMPLE_N, n), k, 1, rows, n,
                     dtype.itemsize, dtype.itemsize)
    if op == "grouped_mm":
        rows = int(labels["tokens / rows"])
        m = re.search(r"(\d+)->(\d+), (\d+) experts", labels["model"])
        k, n, experts = (int(v) for v in m.groups())
        dtype = _DTYPES.get(labels["activation"], torch.bfloat16)
        act = dtype.itemsize if labels["activation"] in _DTYPES else 1
        weight = _DTYPES[labels["experts"]].itemsize if labels["experts"] in _DTYPES else 1
        return Shape(dtype, rows // experts, SAMPLE_N_GROUPED, k, experts, rows // experts, n, act, weight)
    return None


def steel_figures(shape: Shape) -> Figures:
    """MLX's steel GEMM at the shape: one product per group (the groups are
    equal, so one is run and counts for all), with the tile MLX picks for
    the full product."""
    tiles = steel_tiles(shape.dtype, shape.full_m, shape.full_n, shape.k)
    d = steel(shape.dtype, shape.m, shape.n, shape.k, tiles)
    size = shape.dtype.itemsize
    sample_tiles = -(-shape.m // tiles[0]) * -(-shape.n // tiles[1])
    full_tiles = -(-shape.full_m // tiles[0]) * -(-shape.full_n // tiles[1])
    return figures([d], shape.useful_flops // shape.groups,
                   {"activation": ("A", shape.full_m * shape.k * size), "weight": ("B", shape.full_n * shape.k * size)},
                   scale=full_tiles / sample_tiles)


TILED = ("fp8_mm_tile_", "gmm_tiled_")  # the kernels with simdgroup-matrix products
_OPERANDS = {"fp8_mm_tile_": ("x", "w"), "gmm_tiled_": ("a", "w")}  # activation, weight parameters


def tiled(stats: list[cpu_metal.DispatchStats]) -> list[cpu_metal.DispatchStats]:
    return [d for d in stats if d.kernel.startswith(TILED)]


def our_figures(shape: Shape, stats: list[cpu_metal.DispatchStats]) -> Figures:
    """The figures of a case's tiled dispatches."""
    mine = tiled(stats)
    act, weight = next(v for p, v in _OPERANDS.items() if mine[0].kernel.startswith(p))
    threadgroups = sum(d.total_threadgroups for d in mine)
    if shape.groups == 1:  # a sample block of fp8_mm_tile's tiles
        scale = bench_scaled_mm.tiles(shape.full_m, shape.full_n) / threadgroups
    else:  # the grouped products: a sample of the columns
        scale = shape.full_n / shape.n
    return figures(mine, shape.useful_flops,
                   {"activation": (act, shape.groups * shape.full_m * shape.k * shape.act_bytes),
                    "weight": (weight, shape.groups * shape.full_n * shape.k * shape.weight_bytes)}, scale)


def compare(op: str, labels: dict[str, str], stats: list[cpu_metal.DispatchStats]) -> tuple[Figures, Figures] | None:
    """(ours, steel's) for a case whose dispatches include a tiled kernel."""
    shape = shape_of(op, labels)
    if shape is None or not tiled(stats):
        return None
    return our_figures(shape, stats), steel_figures(shape)


def _cells(f: Figures) -> list[str]:
    return [f"{f.useful_slot_fraction:.3f}", f"{f.matrix_slot_fraction:.3f}", f"{f.flops_per_device_byte:.1f}",
            f"{f.flops_per_threadgroup_byte:.2f}", ", ".join(f"{k} {v:.1f}" for k, v in f.reuse.items()),
            f"{f.other_slots_per_mma:.1f}"]


COLUMNS = ["MMA slots (useful)", "MMA slots", "FLOPs / device byte", "FLOPs / tg byte", "reads / size",
           "other slots / MMA"]
NOTES = """\
Compute efficiency (docs/dev/contributing.md, "Compute efficiency"): per tiled case, ours against MLX's steel GEMM
(steel_gemm_fused.h of the mlx-metal wheel tools/metal_corpus.py pins) at the same shape and dtype (bfloat16 for fp8),
with the tile MLX picks on a large device. MMA slots: the multiply-accumulates' share of the estimated issue slots
(useful: only the MMAs the product needs); FLOPs / device byte: matrix FLOPs per byte moved over tensor buffers,
re-reads included; FLOPs / tg byte: per threadgroup-memory byte; reads / size: each operand's device bytes read over
its size, for the whole product; other slots / MMA: the estimated issue slots of everything but the MMAs (loads,
addresses, conversions), per MMA. The goal (issue 32): useful MMA slots within 10% of steel's or above."""


def table(results) -> str:
    """A markdown table of the tiled cases of `results` (common.Result)."""
    from benchmarks.common import markdown

    rows = []
    for r in results:
        pair = compare(r.case.op, r.case.labels, r.stats)
        if pair is None:
            continue
        ours, theirs = pair
        row = {"op": r.case.op, "case": r.case.id, "kernel": " ".join(dict.fromkeys(d.kernel for d in tiled(r.stats)))}
        for prefix, f in (("", ours), ("steel ", theirs)):
            row.update({prefix + c: v for c, v in zip(COLUMNS, _cells(f))})
        row["useful vs steel"] = f"{ours.useful_slot_fraction / theirs.useful_slot_fraction:.2f}"
        rows.append(row)
    if not rows:
        return ""
    return markdown(rows, ["op", "case", "kernel", *COLUMNS, *("steel " + c for c in COLUMNS), "useful vs steel"])
