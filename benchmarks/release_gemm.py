"""The release's own prefill GEMM kernels, counted (issue 32, goals; the
grouped_mm evidence of docs/dev/policy.md): torch 2.15's `_grouped_mm_mps`
simdgroup-matrix tile (grouped_mm_rows_<dtype>_bm{16,32,64}_u32 of
aten/src/ATen/native/mps/kernels/GroupedMM.metal) run on the executor with
counters, launched as GroupedMM.mm's host code launches it, checked against
the grouped product in float64, and its useful MMA share of issue slots
(benchmarks.efficiency.figures) beside MLX's steel GEMM's and mps_ext's
gmm_tiled's at the same shapes.

Where the text comes from. The macOS wheel ships GroupedMM.h (the tile
constants and GroupedMMParams) but not the .metal file (it is compiled into
the wheel's metallib), so the kernel text is read at run time from
TORCH_SOURCES (~/.cache/mps_ext/torch-sources/<commit>/, or the
MPS_EXT_TORCH_SOURCES directory): pytorch/pytorch's GroupedMM.metal at
SOURCE_COMMIT, the stored version whose simdgroup kernel uses exactly the 2.15
header's names (kGroupedMMTileN = 64, kGroupedMMTileK = 16,
grouped_mm_simdgroups, GroupedMMParams<idx_t> with one batch_stride); the
header itself comes from the 2.15 wheel (tools/torch_matrix.fetch). That
version predates the few-rows kernel (grouped_mm_few_rows_<dtype>, 2.15's
decode path: total rows <= min(32, groups)), which a prefill never takes,
and its matmul2d (MPP) kernels are compiled only with Metal Performance
Primitives, which an M3 Ultra lacks. Nothing of torch's text is stored in
this repository; without the file every function here raises
SourceMissing, and tests skip with its reason.

Launch (GroupedMM.mm, grouped_mm_out_mps, jagged rows: a [M, K] x b [G, K, N]):
BM = grouped_mm_tile_rows(M / G) (64 above 48 rows a group, 32 above 24, else
16); grouped_mm_simdgroups(BM, 64) simdgroups of 32 threads; a grid of
(ceil(N / 64), ceil(M / BM) + G, 1) threadgroups (the jagged axis sized for
one partial tile per group: the excess threadgroups look their tile up and
leave); uint32 indices when the offsets fit (`_u32`).

Dense products: torch 2.15's mm, addmm and linear on MPS stay on MPSGraph for
float, half and bfloat16 (LinearAlgebra.mm mm_out_mps_impl: `if
(use_metal_mm(self, other, output)) return do_metal_mm(...)`, where
use_metal_mm is true only for PYTORCH_MPS_PREFER_METAL, integer or wide
complex operands or macOS before 14.4 with a dimension or stride above 32768;
otherwise do_mm's `[graph matrixMultiplicationWithPrimaryTensor:...]`), and
the 2.15 wheel's kernel headers hold GEMV parameters only
(kernels/LinearAlgebra.h GemvDims, kernels/Gemv.h: rank-1 products), no GEMM
tile. So there is no dense torch kernel to count: prefill.py keeps the
MPSGraph assumption for torch's mm/linear/addmm.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from pathlib import Path

import numpy as np
import torch

import mps_ext_executor as cpu_metal

from . import efficiency, release_sdpa

RELEASE = "2.15.0"
# pytorch/pytorch's GroupedMM.metal whose simdgroup kernel matches the 2.15 header (see the module's text).
SOURCE_COMMIT = "88fcbef8449f237f9fc8d7c32fe307c2b704a325"
SOURCE_PATH = "aten/src/ATen/native/mps/kernels/GroupedMM.metal"
HEADER = "ATen/native/mps/kernels/GroupedMM.h"
TILE_N, TILE_K = 64, 16  # the 2.15 header's kGroupedMMTileN, kGroupedMMTileK (checked in `library`)
_MSL = {torch.float32: "float", torch.float16: "half", torch.bfloat16: "bfloat"}
_INCLUDE = re.compile(r"^\s*#include <((?:ATen|c10/metal)/[^>]+)>\s*$", re.M)
# The file instantiates every dtype, tile and index width (36 kernels); the executor compiles the one it runs,
# through the file's own INSTANTIATE_GROUPED_MM_MODE macro.
_EVERY_DTYPE = re.compile(r"^INSTANTIATE_GROUPED_MM_DTYPE\(\w+\);\s*$", re.M)
_HEADER_CONSTANTS = ("kGroupedMMTileN = 64;", "kGroupedMMTileK = 16;", "tile_rows >= 64 ? 4 : 2;")


class SourceMissing(RuntimeError):
    """torch's GroupedMM.metal is not in the sources cache."""


def torch_sources() -> Path:
    d = os.environ.get("MPS_EXT_TORCH_SOURCES")
    return Path(d) if d else Path.home() / ".cache" / "mps_ext" / "torch-sources" / SOURCE_COMMIT


def _kernel_text() -> str:
    path = torch_sources() / SOURCE_PATH
    if not path.is_file():
        raise SourceMissing(f"torch's {SOURCE_PATH} is not at {path}: the macOS wheel ships only its header; put "
                            f"pytorch/pytorch's file at commit {SOURCE_COMMIT} there (not committed here)")
    return path.read_text()


def _inline(rel: str, include: Path, seen: set[str], text: str | None = None) -> str:
    """`rel`'s text with the ATen and c10/metal headers it includes inlined once each."""
    if text is None:
        if rel in seen:
            return ""
        seen.add(rel)
        text = (include / rel).read_text().replace("#pragma once", "")
    return _INCLUDE.sub(lambda m: _inline(m.group(1), include, seen), text)


def tile_rows(rows_per_group: float) -> int:
    """GroupedMM.mm's grouped_mm_tile_rows: the largest tile the typical group keeps 75% busy."""
    return 64 if rows_per_group > 48 else 32 if rows_per_group > 24 else 16


def simdgroups(bm: int, bn: int = TILE_N) -> int:
    """GroupedMM.h's grouped_mm_simdgroups."""
    return 8 if bn >= 256 else 4 if bm >= 64 else 2


def kernel_name(dtype: torch.dtype, bm: int) -> str:
    return f"grouped_mm_rows_{_MSL[dtype]}_bm{bm}_u32"


@functools.lru_cache(maxsize=None)
def library(dtype: torch.dtype, bm: int) -> cpu_metal.Library:
    """torch's jagged-rows simdgroup kernel for `dtype` and `bm`, uint32 indices, as GroupedMM.metal instantiates it."""
    include = release_sdpa._torch_include(RELEASE)
    header = (include / HEADER).read_text()
    missing = [c for c in _HEADER_CONSTANTS if c not in header]
    if missing:
        raise RuntimeError(f"torch {RELEASE}'s {HEADER} is not the one release_gemm.py's launch follows: {missing}")
    text = _kernel_text()
    if len(_EVERY_DTYPE.findall(text)) != 3 or "kernel void grouped_mm(" not in text:
        raise RuntimeError(f"{SOURCE_PATH} at {torch_sources()} is not the version release_gemm.py expects "
                           f"(commit {SOURCE_COMMIT}: grouped_mm<T, BM, MODE, idx_t>, three dtype instantiations)")
    body = _inline(SOURCE_PATH, include, set(), _EVERY_DTYPE.sub("", text))
    source = f"{body}\nINSTANTIATE_GROUPED_MM_MODE({_MSL[dtype]}, {bm}, uint32_t, u32, rows);\n"
    return cpu_metal.compile_library(source, filename=f"torch-{RELEASE}-GroupedMM.metal")


@dataclasses.dataclass(frozen=True)
class Shape:
    """A jagged-rows grouped product: `groups` experts of `rows` rows each,
    a [groups * rows, k] x b [groups, k, n]; `nk`: b is a weight stored
    [groups, n, k] and transposed (F.grouped_mm(x, w.transpose(-2, -1)))."""

    rows: int
    k: int
    n: int
    groups: int
    nk: bool = True
    full_n: int = 0  # the model's output columns `n` samples (a label; 0: n itself)

    @property
    def m(self) -> int:
        return self.rows * self.groups

    @property
    def bm(self) -> int:
        return tile_rows(self.m / self.groups)

    @property
    def threadgroups(self) -> tuple[int, int, int]:
        return -(-self.n // TILE_N), -(-self.m // self.bm) + self.groups, 1


def _params(shape: Shape) -> bytes:
    """GroupedMMParams<uint32_t> as grouped_mm_params fills it (strides of a, b and out)."""
    k, n = shape.k, shape.n
    b_stride_k, b_stride_n = (1, k) if shape.nk else (n, 1)
    u32 = np.uint32
    return np.array([shape.m, n, k, shape.groups, k, 1, b_stride_k, b_stride_n, n, 1, n * k], u32).tobytes()


def run(shape: Shape, dtype: torch.dtype = torch.bfloat16, seed: int = 0
        ) -> tuple[torch.Tensor, cpu_metal.DispatchStats]:
    """torch 2.15's _grouped_mm of `shape` on the executor, launched as
    GroupedMM.mm launches it, with counters: (output, dispatch). Raises if
    the output is not the grouped product (float64) within the dtype's
    rounding."""
    if shape.rows < 1 or shape.groups < 1 or shape.m <= min(32, shape.groups):
        raise ValueError(f"{shape}: torch runs the tiles for more than min(32, groups) rows in all (fewer take its "
                         f"few-rows kernel), at least one row a group")
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(shape.m, shape.k, generator=g).to(dtype)
    w = torch.randn((shape.groups, shape.n, shape.k) if shape.nk else (shape.groups, shape.k, shape.n),
                    generator=g).to(dtype)
    offsets = torch.arange(1, shape.groups + 1, dtype=torch.int32) * shape.rows
    out = torch.zeros(shape.m, shape.n, dtype=dtype)
    stats = library(dtype, shape.bm).dispatch(
        kernel_name(dtype, shape.bm), [a, w, offsets, out, _params(shape)], threadgroups=shape.threadgroups,
        threads_per_threadgroup=(simdgroups(shape.bm) * 32, 1, 1), counters=True)
    b = (w.transpose(-2, -1) if shape.nk else w).double()
    want = torch.cat([a[i * shape.rows:(i + 1) * shape.rows].double() @ b[i] for i in range(shape.groups)])
    err = (out.double() - want).abs().max().item()
    # float accumulation, one rounding to dtype
    bound = (2.0 ** -6 if dtype != torch.float32 else 1e-4) * max(1.0, want.abs().max().item())
    if err > bound:
        raise AssertionError(f"torch {RELEASE}'s grouped_mm tile on the executor is off by {err} at {shape} "
                             f"(bound {bound}): the launch here is not the one its host code makes")
    return out, stats


def figures(shape: Shape, dtype: torch.dtype = torch.bfloat16) -> efficiency.Figures:
    """The compute counters of torch's tile at `shape` (every threadgroup it launches, the excess ones included)."""
    _, stats = run(shape, dtype)
    size = dtype.itemsize
    return efficiency.figures([stats], 2 * shape.m * shape.n * shape.k,
                              {"activation": ("mat_a", shape.m * shape.k * size),
                               "weight": ("mat_b", shape.groups * shape.n * shape.k * size)})


def our_figures(shape: Shape) -> efficiency.Figures:
    """mps_ext's _grouped_mm (gmm_tiled_<dtype>, bf16) at `shape` on the
    executor, as bench_grouped_mm runs it (SAMPLE_N columns), counted as the
    budgets count it (efficiency.our_figures)."""
    from . import bench_grouped_mm, common  # noqa: F401  (common installs the executor as mps_ext's backend)

    if not shape.nk or shape.n != bench_grouped_mm.SAMPLE_N:
        raise ValueError(f"{shape}: bench_grouped_mm runs [E, N, K] weights on {bench_grouped_mm.SAMPLE_N} columns")
    full_n = shape.full_n or shape.n
    prepared = bench_grouped_mm.grouped("_grouped_mm", torch.bfloat16, shape.m, shape.k, full_n, shape.groups, "nk")
    with cpu_metal.record() as rec, cpu_metal.request():
        prepared.run()
    return efficiency.our_figures(efficiency.Shape(torch.bfloat16, shape.rows, shape.n, shape.k, shape.groups,
                                                   shape.rows, full_n, 2, 2), rec.dispatches)


# The shapes the answer rests on (n: efficiency.SAMPLE_N_GROUPED of the output columns, as the budget case runs):
# the grouped_mm budget case (Qwen3-30B-A3B expert down 768->2048, 8 experts, 16 rows each; its gmm_tiled_bf16 and
# steel figures are prefill._COUNTED's) and Qwen3.6's experts (2048->512 gate/up, 512->2048 down) at 16, 32 and 64
# rows an expert (torch's three tiles).
BUDGET_CASE = Shape(16, 768, efficiency.SAMPLE_N_GROUPED, 8, full_n=2048)
QWEN36 = tuple(Shape(r, k, efficiency.SAMPLE_N_GROUPED, 8, full_n=n) for k, n in ((2048, 512), (512, 2048))
               for r in (16, 32, 64))


def table(shapes=(BUDGET_CASE, *QWEN36)) -> str:
    """Per shape: torch 2.15's tile, its useful MMA share of issue slots,
    beside mps_ext's gmm_tiled_bf16's and steel's at the same product
    (MLX's tile for the full product, every row used)."""
    from .common import markdown

    rows = []
    for s in shapes:
        mine, ours = figures(s), our_figures(s)
        steel = efficiency.steel_figures(efficiency.Shape(torch.bfloat16, s.rows, s.n, s.k, s.groups, s.rows,
                                                          s.full_n or s.n, 2, 2))
        rows.append({"k->n": f"{s.k}->{s.full_n or s.n}", "rows / expert": s.rows,
                     "torch tile": kernel_name(torch.bfloat16, s.bm),
                     "torch useful MMA slots": f"{mine.useful_slot_fraction:.3f}",
                     "torch other slots / MMA": f"{mine.other_slots_per_mma:.1f}",
                     "gmm_tiled_bf16 useful MMA slots": f"{ours.useful_slot_fraction:.3f}",
                     "steel MMA slots (every row)": f"{steel.matrix_slot_fraction:.3f}",
                     "torch / steel": f"{mine.useful_slot_fraction / steel.matrix_slot_fraction:.2f}",
                     "ours / steel": f"{ours.useful_slot_fraction / steel.matrix_slot_fraction:.2f}"})
    return markdown(rows, list(rows[0]))


if __name__ == "__main__":
    print(table())
