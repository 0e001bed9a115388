"""The release's own decode attention, counted (issue 32, point 6): torch's
SDPA kernels for one to eight query rows, `sdpa_vector` (one pass) and
`sdpa_vector_2pass_1` + `sdpa_vector_2pass_2` (32 blocks of keys, then their
combination), from ATen/native/mps/kernels/DecodeAttention.h of the
release's macOS wheel (tools/torch_matrix.fetch; 2.14.1 and 2.15.0 ship the
same file), run on the executor with counters, launched as their text
requires (threadgroups of 32 simdgroups, 8 for the first pass; one per query
head and row, times 32 blocks in the first pass) and checked against the
attention in float64.

What it counts that the census's formula does not: every query head reads
its key-value head's keys and values itself (`kv_head_idx = head_idx /
gqa_factor`), so the kernels request gqa_factor times the cache's bytes
(GQA_REREADS). Whether the GPU's caches serve the repeats (the query heads
of one key-value head run side by side, reading the same rows) decides if
the memory reads them once or gqa_factor times; the executor does not model
those caches, and no Mac was at hand to time it. census.sdpa_dispatches is
checked against the path the kernels' launch takes here.

Beside them, mps_ext's own decode attention (torch.ops.mps_ext.kv_decode_attention,
kernels_metal/kv_cache.metal; mps_ext.optimize's attention pass runs it at
decode): a threadgroup per key-value head and block of keys, each key and
value row loaded once into threadgroup memory for the gqa query heads that
share it, the blocks merged in a second dispatch (`ours`: its bytes and
dispatches by the op's launch rule, `OursGeometry`; tests/test_release_sdpa.py
checks the rule against what the executor counts).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import sys
from pathlib import Path

import numpy as np
import torch

import mps_ext_executor as cpu_metal

from . import census

ROOT = Path(__file__).resolve().parent.parent
RELEASE = "2.15.0"  # 2.14.1's DecodeAttention.h is the same file
HEADER = "ATen/native/mps/kernels/DecodeAttention.h"
BLOCKS = 32  # sdpa_vector_2pass_1's blocks of keys (its `constexpr int blocks`)
_MSL = {torch.float32: "float", torch.float16: "half", torch.bfloat16: "bfloat"}
_C10_INCLUDE = re.compile(r"^\s*#include <(c10/metal/[^>]+)>\s*$", re.M)
# The header instantiates every dtype and head size (108 kernels); the executor compiles the three it runs.
# In sdpa_vector_2pass_1 all 32 lanes of simdgroup 0 store the block's sum and maximum to the same address
# (the same values): the executor's race rule (two lanes writing a byte with no barrier between them) stops
# the run there. One lane stores them here; the rest of the kernel is torch's text.
_SAME_VALUE_STORE = ("  if (simd_gid == 0) {\n    sums[0] = sum_exp_score;",
                     "  if (simd_gid == 0 && simd_lid == 0) {\n    sums[0] = sum_exp_score;")
_EVERY_HEAD = re.compile(r"^INSTANTIATE_SDPA_VECTOR_HEADS\(\w+\);\s*$", re.M)


def _torch_include(release: str) -> Path:
    if str(ROOT / "tools") not in sys.path:
        sys.path.insert(0, str(ROOT / "tools"))
    import torch_matrix

    return torch_matrix.fetch(release) / "torch" / "include"


def _inline(rel: str, include: Path, seen: set[str]) -> str:
    """The header with c10/metal's headers it includes inlined once each (compile_library takes one text)."""
    if rel in seen:
        return ""
    seen.add(rel)
    text = (include / rel).read_text().replace("#pragma once", "")
    return _C10_INCLUDE.sub(lambda m: _inline(m.group(1), include, seen), text)


@functools.lru_cache(maxsize=None)
def library(dtype: torch.dtype, head_dim: int, release: str = RELEASE) -> cpu_metal.Library:
    """The release's three decode kernels for `dtype` and `head_dim`, without a mask, as torch instantiates them."""
    include = _torch_include(release)
    seen: set[str] = set()
    head = _inline("c10/metal/utils.h", include, seen)
    t = _MSL[dtype]
    kernels = _EVERY_HEAD.sub("", _inline(HEADER, include, seen))
    if kernels.count(_SAME_VALUE_STORE[0]) != 1:
        raise RuntimeError(f"torch {release}'s {HEADER} has changed: its pass-1 store of the sums is not where "
                           "benchmarks/release_sdpa.py expects it")
    kernels = kernels.replace(*_SAME_VALUE_STORE)
    source = (f"#include <metal_stdlib>\n{head}\nusing namespace metal;\n{kernels}\n"
              f"INSTANTIATE_SDPA_VECTOR_ONE({t}, {head_dim}, {head_dim}, false, false, float, \"_masknone\")\n"
              f"INSTANTIATE_SDPA_VECTOR_2PASS_1_ONE({t}, {head_dim}, {head_dim}, false, false, float, \"_masknone\")\n"
              f"INSTANTIATE_SDPA_VECTOR_AGGREGATION({t}, {head_dim})\n")
    return cpu_metal.compile_library(source, filename=f"torch-{release}-DecodeAttention.metal")


@dataclasses.dataclass(frozen=True)
class Shape:
    """One decode step's attention of one layer: `queries` rows (one per sequence token decoded)."""

    q_heads: int
    kv_heads: int
    head_dim: int
    keys: int
    queries: int = 1

    @property
    def gqa(self) -> int:
        return self.q_heads // self.kv_heads

    def cache_bytes(self, dtype_bytes: int = 2) -> int:
        """The keys and values of the layer's cache: what attention must read at least."""
        return 2 * self.kv_heads * self.keys * self.head_dim * dtype_bytes


def run(shape: Shape, dtype: torch.dtype = torch.bfloat16, release: str = RELEASE, seed: int = 0
        ) -> tuple[torch.Tensor, list[cpu_metal.DispatchStats]]:
    """torch's decode SDPA of `shape` on the executor (q [1, H, q, D], k and v [1, Hkv, keys, D]), the path
    torch takes at that length (census.sdpa_dispatches), with counters: (output, dispatches). Raises if the
    output is not the attention (float64) within the dtype's rounding."""
    g = torch.Generator().manual_seed(seed)
    h, hk, d, n, ql = shape.q_heads, shape.kv_heads, shape.head_dim, shape.keys, shape.queries
    if h % hk or d % 32 or not 1 <= ql <= census.SDPA_VECTOR_MAX_QUERIES:
        raise ValueError(f"not a shape torch's decode kernels take: {shape} (query heads a multiple of the "
                         f"key-value heads, head_dim a multiple of 32, 1 to {census.SDPA_VECTOR_MAX_QUERIES} queries)")
    q = torch.randn(1, h, ql, d, generator=g).to(dtype)
    k = torch.randn(1, hk, n, d, generator=g).to(dtype)
    v = torch.randn(1, hk, n, d, generator=g).to(dtype)
    out = torch.zeros(1, h, ql, d, dtype=dtype)
    scale = 1.0 / math.sqrt(d)
    u32 = np.uint32
    head_strides = np.array([ql * d, n * d, n * d], u32).tobytes()  # uint3: 16 bytes in a constant buffer
    head_strides += bytes(4)
    seq_strides = np.array([d, d, d, 0], u32).tobytes()
    batch_strides_heads = np.array([h * ql * d, hk * n * d, hk * n * d, h], u32).tobytes()
    common = [u32(shape.gqa).tobytes(), u32(n).tobytes(), head_strides, seq_strides, np.float32(scale).tobytes(),
              torch.zeros(1), np.zeros(4, u32).tobytes(), batch_strides_heads]
    lib = library(dtype, d, release)
    t = _MSL[dtype]
    if census.sdpa_dispatches(n, ql) == 1:
        stats = [lib.dispatch(f"sdpa_vector_{t}_{d}_{d}_masknone", [q, k, v, out, *common],
                              threadgroups=(h, ql, 1), threads_per_threadgroup=(1024, 1, 1), counters=True)]
    else:
        partials = torch.zeros(1, h, ql, BLOCKS, d, dtype=dtype)
        sums = torch.zeros(h * ql * BLOCKS)
        maxs = torch.zeros(h * ql * BLOCKS)
        stats = [lib.dispatch(f"sdpa_vector_2pass_1_{t}_{d}_{d}_masknone", [q, k, v, partials, sums, maxs, *common],
                              threadgroups=(h, ql, BLOCKS), threads_per_threadgroup=(256, 1, 1), counters=True),
                 lib.dispatch(f"sdpa_vector_2pass_2_{t}_{d}", [partials, sums, maxs, out],
                              threadgroups=(h, ql, 1), threads_per_threadgroup=(1024, 1, 1), counters=True)]
    kk = k.double().repeat_interleave(shape.gqa, dim=1)
    vv = v.double().repeat_interleave(shape.gqa, dim=1)
    want = torch.softmax(q.double() @ kk.transpose(-1, -2) * scale, dim=-1) @ vv
    err = (out.double() - want).abs().max().item()
    # float accumulation; the output rounded to dtype once (twice on the two-pass path: the partials)
    bound = 1e-5 if dtype == torch.float32 else 3 * 2.0 ** -8 * max(1.0, want.abs().max().item())
    if err > bound:
        raise AssertionError(f"torch {release}'s decode SDPA on the executor is off by {err} at {shape} "
                             f"(bound {bound}): the launch here is not the one its text requires")
    return out, stats


@dataclasses.dataclass(frozen=True)
class Counted:
    shape: Shape
    dispatches: int
    cache_bytes_read: int  # the keys' and values' device bytes the kernels request
    other_bytes: int  # queries, partials, sums and maxima, read and written

    @property
    def cache_reads(self) -> float:
        """Requested cache bytes over the cache's size: gqa_factor for torch's kernels."""
        return self.cache_bytes_read / self.shape.cache_bytes()


def _counted(shape: Shape, dispatches, cache_buffers: tuple[str, str]) -> Counted:
    """The dispatches' bytes: read from the buffers named `cache_buffers`
    (the kernel's key and value parameters), and every other read and write
    but the constant buffers."""
    cache = other = 0
    for s in dispatches:
        for i, b in s.bytes_read.items():
            if s.buffer_names.get(i) in cache_buffers:
                cache += b
            elif i not in s.constant_buffers:
                other += b
        other += sum(s.bytes_written.values())
    return Counted(shape, len(dispatches), cache, other)


def count(shape: Shape, release: str = RELEASE) -> Counted:
    _, stats = run(shape, torch.bfloat16, release)
    return _counted(shape, stats, ("keys", "values"))


# ------------------------------------------------------------ mps_ext's own --
# csrc/ops/kv_cache.cpp's launch of kv_decode_attention (kDecodeThreadgroups, kDecodeMinBlockKeys,
# KV_DECODE_TILE_ELEMS and KV_DECODE_STREAM_SIMDGROUPS of kernels_metal/kv_cache_params.h), one sequence,
# without a lower pipeline limit.
OURS_THREADGROUPS, OURS_MIN_BLOCK_KEYS, OURS_TILE_ELEMS, OURS_STREAM_SIMDGROUPS = 256, 128, 2048, 8


@dataclasses.dataclass(frozen=True)
class OursGeometry:
    blocks: int
    streams: int  # simdgroups per query head

    @classmethod
    def of(cls, shape: Shape, batch: int = 1) -> "OursGeometry":
        tile = OURS_TILE_ELEMS // shape.head_dim
        want = max(1, -(-OURS_THREADGROUPS // (batch * shape.kv_heads)))
        per_block = -(-max(OURS_MIN_BLOCK_KEYS, -(-shape.keys // want)) // tile) * tile
        return cls(-(-shape.keys // per_block), max(1, OURS_STREAM_SIMDGROUPS // shape.gqa))


def ours(shape: Shape, dtype_bytes: int = 2) -> Counted:
    """kv_decode_attention's dispatches and requested bytes at `shape` (one
    sequence) by its launch rule: the cache once; each simdgroup's query
    head (blocks x streams reads of q); the output, or the blocks' float
    partial sums, maxima and sums written and read back by the merge."""
    geo = OursGeometry.of(shape)
    h, d = shape.q_heads, shape.head_dim
    other = h * geo.blocks * geo.streams * d * dtype_bytes + h * d * dtype_bytes
    if geo.blocks > 1:
        other += 2 * h * geo.blocks * (d * 4 + 8)
    return Counted(shape, 1 + (geo.blocks > 1), shape.cache_bytes(dtype_bytes), other)


def count_ours(shape: Shape, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> Counted:
    """kv_decode_attention at `shape` on the executor, counted as `count`
    counts torch's (cache: the k and v buffers). Raises if its output is
    not the attention (float64) within the dtype's rounding."""
    from . import common  # noqa: F401  (installs the executor as mps_ext's backend of CPU tensors)

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, shape.q_heads, 1, shape.head_dim, generator=g).to(dtype)
    k, v = (torch.randn(1, shape.kv_heads, shape.keys, shape.head_dim, generator=g).to(dtype) for _ in range(2))
    scale = shape.head_dim ** -0.5
    with cpu_metal.record() as rec, cpu_metal.request():
        out = torch.ops.mps_ext.kv_decode_attention(q, k, v, scale)
    kk, vv = (t.double().repeat_interleave(shape.gqa, dim=1) for t in (k, v))
    want = torch.softmax(q.double() @ kk.transpose(-1, -2) * scale, dim=-1) @ vv
    bound = 1e-5 if dtype == torch.float32 else 2.0 ** -7 * max(1.0, want.abs().max().item())
    if (out.double() - want).abs().max().item() > bound:
        raise AssertionError(f"kv_decode_attention is not the attention at {shape}")
    return _counted(shape, rec.dispatches, ("k", "v"))


# The census's models' attention layers (their configs, benchmarks/census.py MODELS), one sequence.
def shape_of(spec: census.Spec, keys: int) -> Shape:
    c = spec.config()
    return Shape(c.num_attention_heads, c.num_key_value_heads, getattr(c, "head_dim", None)
                 or c.hidden_size // c.num_attention_heads, keys)


CONTEXTS = (1024, 4096, 32768, 131072)


def table(contexts=CONTEXTS) -> str:
    """Per model, one decoded token of one sequence: the attention layers'
    key-value cache (what attention must read), what torch's decode
    kernels request (gqa_factor times it: counted at small shapes by
    tests/test_release_sdpa.py, the same at every length since each query
    head walks its whole key-value head) and what mps_ext's
    kv_decode_attention requests (`ours`: the cache once, plus its queries
    and partial sums), in MB and in ms at the sustained bandwidth
    (timeline.BANDWIDTH, its highest figure); and the dispatches of all
    attention layers, torch's / ours."""
    from .common import markdown
    from .timeline import BANDWIDTH

    rows = []
    for name, spec in census.MODELS.items():
        layers = sum(k.startswith("full_attention") for k in census.layer_kinds(spec.config()))
        row = {"model": name, "attention layers": layers}
        def mb(b):
            return f"{b / 1e6:,.0f} ({b / BANDWIDTH.high * 1e3:.2f})"

        for n in contexts:
            s = shape_of(spec, n)
            once = layers * s.cache_bytes()
            mine = ours(s)
            row["heads (q / kv)"] = f"{s.q_heads} / {s.kv_heads}"
            row[f"{n // 1024}k: cache MB (ms)"] = mb(once)
            row[f"{n // 1024}k: torch requests MB (ms)"] = mb(s.gqa * once)
            row[f"{n // 1024}k: ours requests MB (ms)"] = mb(layers * (mine.cache_bytes_read + mine.other_bytes))
            row[f"{n // 1024}k: dispatches torch / ours"] = (f"{layers * census.sdpa_dispatches(n)} / "
                                                            f"{layers * mine.dispatches}")
        rows.append(row)
    columns = ["model", "attention layers", "heads (q / kv)"] + [c for n in contexts for c in (
        f"{n // 1024}k: cache MB (ms)", f"{n // 1024}k: torch requests MB (ms)",
        f"{n // 1024}k: ours requests MB (ms)", f"{n // 1024}k: dispatches torch / ours")]
    return markdown(rows, columns)


DOC_COMMAND = "python -m benchmarks.release_sdpa --write-docs"
DOCS = {"docs/decode.md": ["long context"]}


def main(argv: list[str] | None = None) -> None:
    import argparse

    from . import bench_decode

    parser = argparse.ArgumentParser(prog="python -m benchmarks.release_sdpa", description=__doc__.split("\n\n")[0])
    parser.add_argument("--write-docs", action="store_true", help="rewrite the long-context table of docs/decode.md")
    args = parser.parse_args(argv)
    text = table()
    print(text)
    if args.write_docs:
        changed = bench_decode.write_docs({"long context": "\n" + text + "\n"}, docs=DOCS, command=DOC_COMMAND)
        print("rewrote", ", ".join(changed) or "nothing (the docs were up to date)")


if __name__ == "__main__":
    main()
