"""Budgets: what every kernel of kernels_metal/ may cost an Apple GPU beyond
its bytes (issue 11), measured by the executor's counters at the benchmark
shapes (benchmarks/bench_*.py):

- coalescing: each device buffer at most 1.1 times the fewest 128-byte lines
  per simdgroup memory instruction (the inputs of every case here are
  contiguous tensors);
- no 64-bit integer division or remainder in a 32-bit-index kernel (Apple
  GPUs run them in software);
- registers: a streaming kernel fits cpu_metal.FULL_OCCUPANCY_REGISTERS (52,
  1024 threads per core; the figure's sources are in executor/mps_ext_executor),
  every kernel fits MAX_REGISTERS (128; beyond, the compiler spills) and the
  registers that let a core hold the threadgroup size the host launches
  (cpu_metal.registers_for: a pipeline allows no larger threadgroup, and the
  op would fall back to torch);
- no thread-private array in stack memory;
- no threadgroup-memory bank conflicts (reductions and staging);
- (issue 21) no device load that waits behind a threadgroup barrier in a
  loop (loads_after_barrier: issue it a step ahead, before the barrier);
- (issue 21) residency: a core holds at least 2 threadgroups of a kernel (1
  of a 1024-thread one; cpu_metal.threadgroups_per_core, threadgroup memory
  and registers both), and a streaming kernel's threadgroup memory never
  holds it below what its registers allow;
- (issue 21) re-reads: a decode kernel's threadgroups read at most as many
  activation bytes, cache hits included, as weight bytes;
- (issue 21) divisions: 32-bit integer divisions by a run-time value and
  IEEE float divisions per thread (the busiest), each at most the kernel's
  figure (DIVISIONS; 0 unless listed), so that none sits in a loop that
  grows with the problem.
  These measured ones cover every reached kernel, but where a budget does
  not apply to a kind of kernel: the threadgroup-memory residency budget
  only the streaming kernels (as full occupancy above: a per-matrix or
  prefill kernel's threadgroup memory is its design, and it meets the
  2-threadgroups-a-core one); the re-read budget only the decode kernels
  that have an activation (Budget.activation: GEMV, fp8_gemv,
  gmm_decode), because elsewhere a threadgroup reads its own slice of the
  large inputs (softmax, pad, norms, conversions, routing, the per-matrix
  kernels; every threadgroup re-reads only small shared ones: softmax's
  split partials, a norm's weight, the routing weights), or re-reads by
  design, each operand once per tile of the other dimension (the prefill
  tiles, docs/dev/kernel_counters_occupancy.md).

Which kernels need full occupancy: those that stream, each thread keeping a
few loads in flight and the core hiding their latency with other threads:
GEMV (FP8 and grouped too), softmax, pad, lu_unpack, FP8 conversions, MoE
routing and combining, RMSNorm (and q/k norms with RoPE). The
small-matrix kernels (lu_small_*) load a thread's whole matrix at once, n^2
loads in flight, and keep it in registers by design; the per-matrix kernels
(lu_panel_*, lu_solve_*) run one threadgroup per matrix, limited by their
threadgroup size and barriers, not by how many threads a core holds; the
prefill tiles (fp8_mm_tile_*, gmm_tiled_*) are bound by arithmetic. They have the
MAX_REGISTERS budget.

Each kernel is measured in the cheapest benchmark cases that reach it
(BUDGET_CASES, run once per op: `-k softmax` runs only softmax's);
test_every_reachable_kernel_is_measured fails if a kernel is left out. A kernel that does not meet a budget yet is an xfail(strict=True)
that says why (NOT_YET): the test flips when the fix lands, and then the
entry must go.
"""  # noqa: E501

from __future__ import annotations

import dataclasses
import functools
import math
import re

import numpy as np
import pytest
import torch

from benchmarks import bench_grouped_mm, bench_linear_attention, bench_moe, census, common, efficiency, prefill
from benchmarks.__main__ import OPS, op_cases
import mps_ext_executor as cpu_metal


# ------------------------------------------------------------ the kernels --
def names(pattern: str, **axes) -> list[str]:
    """The pattern with each {axis} replaced, over the product of the axes' values."""
    out = [pattern]
    for axis, values in axes.items():
        out = [p.replace("{" + axis + "}", str(v)) for p in out for v in values]
    return out


GEMV_ROWS = [k for k in names("gemv_rows_{t}_r{r}_q{q}_{path}", t=("f32", "f16", "bf16"), r=(1, 2, 4, 8), q=(1, 2),
                               path=("vec", "scalar")) if "_r4_q1_" not in k and "_r8_q1_" not in k]
RMS_GEMV_ROWS = ["rms_norm_" + k for k in GEMV_ROWS]  # the norm in the GEMV (linear.metal), gemv_rows' variants
ADD_RMS_GEMV_ROWS = ["add_" + k for k in RMS_GEMV_ROWS]  # with the residual add: a MoE layer's router
ADD_RMS_GEMV_MEASURED = ("add_rms_norm_gemv_rows_bf16_r1_q1_vec", "add_rms_norm_gemv_rows_bf16_r1_q2_vec")
GATE_GEMV_ROWS = ["sigmoid_gate_" + k for k in GEMV_ROWS]  # the output gate in the GEMV: an attention's o_proj
GEMV_COLS = names("gemv_cols_{t}_r{r}_{path}", t=("f32", "f16", "bf16"), r=(1, 2, 4, 8), path=("vec", "scalar"))
GEMV_COLS_FINISH = names("gemv_cols_finish_{t}", t=("f32", "f16", "bf16"))
# Softmax kernels come with 16-byte accesses (_i32_vec), element accesses
# (_i32) and 64-bit indices (_i64); strided has no vector variant.
SOFTMAX_SHAPES = (names("softmax_{shape}_{types}", shape=("segment", "block", "finish"),
                        types=("f32_f32", "f16_f16", "bf16_bf16", "f16_f32"))
                  + names("softmax_partial_{t}", t=("f32", "f16", "bf16"))
                  + names("softmax_backward_{shape}_{types}", shape=("segment", "block", "finish"),
                          types=("f32_f32", "f16_f16", "bf16_bf16", "f32_f16"))
                  + names("softmax_backward_partial_{t}", t=("f32", "f16", "bf16")))
SOFTMAX_STRIDED = (names("softmax_strided_{types}", types=("f32_f32", "f16_f16", "bf16_bf16", "f16_f32"))
                   + names("softmax_backward_strided_{types}", types=("f32_f32", "f16_f16", "bf16_bf16", "f32_f16")))
SOFTMAX_VEC = [k + "_i32_vec" for k in SOFTMAX_SHAPES]
SOFTMAX_ELEMENTS = [k + "_i32" for k in SOFTMAX_SHAPES + SOFTMAX_STRIDED]
SOFTMAX_64 = [k + "_i64" for k in SOFTMAX_SHAPES + SOFTMAX_STRIDED]
PAD_32 = names("constant_pad_{n}_i32", n=(1, 2, 4, 8))
PAD_64 = names("constant_pad_{n}_i64", n=(1, 2, 4, 8))
LU_SMALL = names("lu_small_{t}_{n}", t=("f32", "c64"), n=(1, 2, 3, 4))
LU_PANEL = names("lu_panel_{t}", t=("f32", "c64"))
LU_SOLVE = names("lu_solve_{t}_{c}", t=("f32", "c64"), c=(1, 4, 16))
LU_UNPACK = names("lu_unpack_{t}", t=("f32", "c64"))
_FLOATS, _FP8 = ("f32", "f16", "bf16"), ("e4m3", "e5m2")
FP8_CONVERT = names("fp8_convert_{layout}_{pair}", layout=("dense", "strided"),
                    pair=[f"{a}_{b}" for a in _FLOATS for b in _FP8] + [f"{a}_{b}" for a in _FP8 for b in _FLOATS]
                    + ["e4m3_e5m2", "e5m2_e4m3"])
FP8_GEMV = names("fp8_gemv_{a}_r{r}_{path}", a=("f32", "f16", "bf16", "fp8"), r=(1, 2, 4, 8), path=("vec", "scalar"))
# the norm in the GEMV (scaled_mm.metal), fp8_gemv's variants of floating activations
RMS_FP8_GEMV = ["rms_norm_" + k for k in FP8_GEMV if not k.startswith("fp8_gemv_fp8_")]
FP8_TILE = names("fp8_mm_tile_{a}_{path}", a=("f32", "f16", "bf16", "fp8"), path=("vec", "scalar"))
GMM_DECODE = names(
    "gmm_decode_rows_{t}_{path}", t=("f32", "f16", "bf16", "e4m3", "bf16_e4m3w"), path=("vec", "scalar")
) + names("gmm_decode_cols_{t}_{path}", t=("f32", "f16", "bf16"), path=("vec", "scalar"))
# (the layer's gate/up product is moe_gate_up_routed: gmm_decode_rows' float variants are measured by the
# grouped products' decode cases, its fp8-weight ones by moe_experts' cases)
_GMM_ROWS_OF_THE_LAYER = re.compile(r"gmm_decode_rows_bf16_e4m3w_")
GMM_TILED = names("gmm_tiled_{t}", t=("f32", "f16", "bf16", "e4m3"))
GMM_TILED_DENSE = names("gmm_tiled_dense_{t}", t=("f16", "bf16"))  # linear's prefill: gmm_tiled, one group
# fp8_linear's prefill (16-bit activations, e4m3 weights, tensor-wise or row-wise scales): the same tile
GMM_TILED_DENSE_FP8 = names("gmm_tiled_dense_{t}_e4m3w", t=("f16", "bf16"))
MOE_ROUTE_COMBINE = names("moe_{step}_{t}", step=("route", "combine"), t=("f32", "f16", "bf16"))
# moe_layer's gate/up product with the routing in its dispatch (the layer's three dispatches)
MOE_GATE_UP_ROUTED = names("moe_gate_up_routed_{t}_vec", t=("f32", "f16", "bf16", "bf16_e4m3w"))
MOE_DOWN_COMBINE = names("moe_down_combine_{t}_{path}", t=("f32", "f16", "bf16", "bf16_e4m3w"),
                         path=("vec", "scalar"))
RMS_NORM = names("rms_norm_{t}", t=("f32", "f16", "bf16"))
ADD_RMS_NORM = names("add_rms_norm_{t}", t=("f32", "f16", "bf16"))
QK_NORM_ROPE = names("{op}_{t}", op=("qk_norm_rope", "qk_norm_rope_append"), t=("f32", "f16", "bf16"))
ATTENTION = names("{op}_{t}", op=("sigmoid_gate", "kv_append"), t=("f32", "f16", "bf16"))
KV_DECODE = names("kv_decode_attention_{t}_{d}", t=("f32", "f16", "bf16"), d=(64, 128, 256))
KV_DECODE_MERGE = names("kv_decode_merge_{t}", t=("f32", "f16", "bf16"))
# bench_kv_cache's decode cases (a model's heads each) take bf16 at 128, fp16 at 256 and float32 at 64, and the
# merge in each dtype
KV_DECODE_MEASURED = {"kv_decode_attention_bf16_128", "kv_decode_attention_f16_256", "kv_decode_attention_f32_64"}
KV_DECODE_UNREACHED = ("a dtype and head dimension no benchmark case takes (tests/ops/test_kv_cache_decode.py runs "
                       "every one against float64); the same template as the three measured")
LINEAR_ATTENTION = names("linear_attention_decode_{t}", t=("f32", "f16", "bf16"))
DELTANET_PREP = names("linear_attention_chunk_prep_{t}", t=("f32", "f16", "bf16"))
DELTANET_STATE = names("linear_attention_chunk_state_{t}", t=("f32", "f16", "bf16"))
SHORT_CONV = names("short_conv_decode_{t}", t=("f32", "f16", "bf16"))


@dataclasses.dataclass(frozen=True)
class Budget:
    op: str  # the benchmark (benchmarks/bench_<op>.py) whose cases measure it
    full_occupancy: bool  # FULL_OCCUPANCY_REGISTERS, else MAX_REGISTERS
    index32: bool = True  # a 32-bit-index kernel: no 64-bit division
    lines: float = 1.1  # the most lines per instruction over the fewest, per device buffer
    # Why no benchmark case reaches the kernel ("" if one does): its measured
    # budgets are then not checked, only its static ones.
    unreached: str = ""
    # A decode kernel's activation buffer (the re-read budget: its bytes read
    # by the threadgroups against the weight buffer "w"), "" for others.
    activation: str = ""


WIDE_PAD = ("the 64-bit-index variant runs past 2^31 elements or offsets, gigabytes the executor does not run at "
            "benchmark cost (tests/ops/test_pad.py runs constant_pad_1_i64 once); its code is the i32 variant's with "
            "a wider index")
WIDE_SOFTMAX = ("the 64-bit-index variant runs where an offset passes 2^31, gigabytes the executor does not run at "
                "benchmark cost (tests/ops/test_softmax.py runs every one on small tensors, forced by "
                "_set_index_limit); its code is the _i32 variant's with a wider index")
# Element-access softmax kernels of the dtype pairs the benchmark's unaligned
# cases do not take (they take bf16 segment, fp16 block, fp32 split, and
# strided in fp32 and bf16): tests/ops/test_softmax.py runs every one.
SOFTMAX_UNREACHED = ("an element-access variant in a dtype pair no benchmark case takes (tests/ops/test_softmax.py "
                     "runs it); the same template as the measured ones")
SOFTMAX_ELEMENTS_MEASURED = {
    "softmax_segment_bf16_bf16_i32", "softmax_backward_segment_bf16_bf16_i32",
    "softmax_block_f16_f16_i32", "softmax_backward_block_f16_f16_i32",
    "softmax_partial_f32_i32", "softmax_finish_f32_f32_i32",
    "softmax_backward_partial_f32_i32", "softmax_backward_finish_f32_f32_i32",
    "softmax_strided_f32_f32_i32", "softmax_backward_strided_f32_f32_i32",
    "softmax_strided_bf16_bf16_i32", "softmax_backward_strided_bf16_bf16_i32",
}
SOFTMAX_VEC_UNREACHED = ("the bf16 block kernels: no benchmark row of bf16 has 129 to 8192 elements (the same "
                         "template as the fp16 and fp32 ones measured; tests/ops/test_softmax.py runs them)")
# The element-load GEMV kernels serve operands that are not 16-byte aligned
# (the cases: 1 to 4 bytes off). The 64 or 128 contiguous bytes of a
# simdgroup's access then straddle a line boundary whatever the kernel does:
# at most one line more than the fewest.
MISALIGNED_LINES = 2.0


# moe_layer fuses the combine into the down product (moe_down_combine), so
# the benchmark's layers no longer reach moe_combine; FusedMoE's and
# FP8Experts' grouped paths (mps_ext/passes/moe.py, fp8.py) still call it.
MOE_COMBINE_UNREACHED = ("moe_layer, the benchmark's layer, sums the slots in moe_down_combine; moe_combine serves the "
                         "grouped paths of FusedMoE and FP8Experts (tests/ops/test_moe.py runs each dtype)")
MOE_DOWN_COMBINE_SCALAR = ("the element-load variant, for expert rows not a multiple of 16 bytes (no benchmark model "
                           "has such a width; tests/ops/test_moe_layer.py test_down_combine_kernels runs each); the "
                           "same template as the _vec ones measured")


# rms_norm_linear runs where a decoder layer's input norm feeds its fused projection at decode: one
# row of a hidden state in the model's dtype, a weight aligned as nn.Linear allocates it.
RMS_GEMV_UNREACHED = ("a row count, dtype or weight alignment of rms_norm_linear that no decode benchmark case "
                      "takes (tests/ops/test_rms_norm_linear.py runs each, bit for bit rms_norm then gemv_rows); "
                      "gemv_rows' template after the norm the measured bf16 r1 q2 vec variant runs")

# add_rms_norm_gemv_rows runs where a MoE decoder layer's residual add and post-attention norm feed its router
# (add_rms_norm_moe_layer): a decode token's row, a router of 128 experts (BUDGET_LAYER's, Qwen3-30B's).
ADD_RMS_GEMV_UNREACHED = ("a row count, dtype or router alignment of add_rms_norm_moe_layer that no budget case takes "
                          "(tests/ops/test_add_rms_norm_moe_layer.py runs each, bit for bit add_rms_norm then "
                          "moe_layer); rms_norm_gemv_rows' template with the residual added, as the measured bf16 r1 "
                          "variants")

# sigmoid_gate_gemv_rows runs where a gated attention's output gate feeds its o_proj at decode
# (sigmoid_gate_linear): a decode token's heads, Qwen3.6's 16 of 256 in bfloat16 (bench_linear.GATED_SHAPES).
GATE_GEMV_UNREACHED = ("a row count, dtype or weight alignment of sigmoid_gate_linear that no decode benchmark case "
                       "takes (tests/ops/test_sigmoid_gate_linear.py runs each, bit for bit sigmoid_gate then "
                       "gemv_rows); gemv_rows' template after the gate the measured bf16 r1 q2 vec variant runs")

RMS_FP8_GEMV_UNREACHED = ("a row count, dtype or weight alignment of rms_norm_fp8_linear that no decode benchmark "
                          "case takes (tests/ops/test_rms_norm_fp8_linear.py runs each, bit for bit rms_norm then "
                          "fp8_gemv); fp8_gemv's template after the norm the measured bf16 r1 vec variant runs")


def lines(kernel):
    return MISALIGNED_LINES if kernel.endswith("_scalar") else 1.1


BUDGETS: dict[str, Budget] = {
    **{k: Budget("linear", full_occupancy=True, lines=lines(k), activation="x") for k in GEMV_ROWS},
    **{k: Budget("linear", full_occupancy=True, lines=lines(k), activation="x") for k in GEMV_COLS},
    **{k: Budget("linear", full_occupancy=True) for k in GEMV_COLS_FINISH},
    # gemv_rows after the norm of its rows into threadgroup memory: the decode shape of a decoder
    # layer's input norm and fused q/k/v (bench_linear.NORMED_SHAPES) measures the one the models run.
    **{k: Budget("linear", full_occupancy=True, lines=lines(k), activation="x",
                 unreached="" if k == "rms_norm_gemv_rows_bf16_r1_q2_vec" else RMS_GEMV_UNREACHED)
       for k in RMS_GEMV_ROWS},
    # ... with the residual added first (a MoE layer's router): BUDGET_LAYER's add_norm case measures the
    # bf16 one-row variants it takes on the 80-core (one output a simdgroup) and the 8-core GPU (two).
    **{k: Budget("moe", full_occupancy=True, lines=lines(k), activation="x",
                 unreached="" if k in ADD_RMS_GEMV_MEASURED else ADD_RMS_GEMV_UNREACHED)
       for k in ADD_RMS_GEMV_ROWS},
    # ... after the attention's output gate of its rows into threadgroup memory: the decode shape of
    # Qwen3.6's o_proj (bench_linear.GATED_SHAPES) measures the one the model runs.
    **{k: Budget("linear", full_occupancy=True, lines=lines(k), activation="x",
                 unreached="" if k == "sigmoid_gate_gemv_rows_bf16_r1_q2_vec" else GATE_GEMV_UNREACHED)
       for k in GATE_GEMV_ROWS},
    **{k: Budget("softmax", full_occupancy=True, unreached=SOFTMAX_VEC_UNREACHED if "_block_bf16" in k else "")
       for k in SOFTMAX_VEC},
    # The element-access softmax kernels serve rows that do not start
    # 16-byte aligned: like the misaligned GEMV weights, one line more than
    # the fewest (the strided ones read columns: 1.1, as aligned rows).
    **{k: Budget("softmax", full_occupancy=True, lines=1.1 if "strided" in k else MISALIGNED_LINES,
                 unreached="" if k in SOFTMAX_ELEMENTS_MEASURED else SOFTMAX_UNREACHED)
       for k in SOFTMAX_ELEMENTS},
    **{k: Budget("softmax", full_occupancy=True, index32=False, unreached=WIDE_SOFTMAX) for k in SOFTMAX_64},
    **{k: Budget("pad", full_occupancy=True) for k in PAD_32},
    **{k: Budget("pad", full_occupancy=True, index32=False, unreached=WIDE_PAD) for k in PAD_64},
    **{k: Budget("linalg", full_occupancy=True) for k in LU_UNPACK},
    **{k: Budget("linalg", full_occupancy=False) for k in LU_SMALL + LU_PANEL + LU_SOLVE},
    **{k: Budget("fp8", full_occupancy=True) for k in FP8_CONVERT},
    **{k: Budget("scaled_mm", full_occupancy=True, lines=lines(k), activation="x") for k in FP8_GEMV},
    # fp8_gemv after the norm of its rows into threadgroup memory: the decode shape of a decoder layer's
    # input norm and fused fp8 q/k/v (bench_scaled_mm) measures the one the models run.
    **{k: Budget("scaled_mm", full_occupancy=True, lines=lines(k), activation="x",
                 unreached="" if k == "rms_norm_fp8_gemv_bf16_r1_vec" else RMS_FP8_GEMV_UNREACHED)
       for k in RMS_FP8_GEMV},
    # Prefill tiles: simdgroup-matrix products that reuse each operand 32 or
    # 64 times, bound by arithmetic, not by how many threads hide latency.
    **{k: Budget("scaled_mm", full_occupancy=False, lines=lines(k)) for k in FP8_TILE},
    # Measured by the MoE layer's cases where it reaches them (its experts' rows in each dtype, bf16 under
    # fp8 weights), by the grouped products' elsewhere (fp8 activations, misaligned rows, the cols layout)
    **{k: Budget("moe" if _GMM_ROWS_OF_THE_LAYER.match(k) else "grouped_mm", full_occupancy=True, lines=lines(k),
                 activation="a") for k in GMM_DECODE},
    **{k: Budget("moe", full_occupancy=True, lines=lines(k),
                 unreached=MOE_COMBINE_UNREACHED if "_combine_" in k else "") for k in MOE_ROUTE_COMBINE},
    # moe_layer's gate/up product routing its own rows: gmm_decode_rows' GEMV after the routing
    **{k: Budget("moe", full_occupancy=True, activation="a") for k in MOE_GATE_UP_ROUTED},
    # moe_layer's down product with the combine fused: a decode GEMV of the experts' rows, as gmm_decode_rows
    **{k: Budget("moe", full_occupancy=True, lines=lines(k), activation="a",
                 unreached=MOE_DOWN_COMBINE_SCALAR if k.endswith("_scalar") else "") for k in MOE_DOWN_COMBINE},
    **{k: Budget("grouped_mm", full_occupancy=False) for k in GMM_TILED},  # prefill tiles, as FP8's
    **{k: Budget("linear", full_occupancy=False) for k in GMM_TILED_DENSE},  # the same tile, linear's prefill
    **{k: Budget("scaled_mm", full_occupancy=False) for k in GMM_TILED_DENSE_FP8},  # and fp8_linear's
    **{k: Budget("norm", full_occupancy=True) for k in RMS_NORM},  # streams a row through registers
    **{k: Budget("norm", full_occupancy=True) for k in ADD_RMS_NORM},  # rms_norm's rows, with the residual added
    **{k: Budget("norm", full_occupancy=True) for k in QK_NORM_ROPE},  # streams heads through registers, as RMSNorm
    # the attention's output gate and cache append: each element moved once, a thread per element
    **{k: Budget("attention_gate" if k.startswith("sigmoid_gate_") else "kv_cache", full_occupancy=True)
       for k in ATTENTION},
    # decode attention over the cache: each key and value row read once, staged in threadgroup memory for the
    # query heads sharing it; the merge reads the blocks' partial sums once
    **{k: Budget("kv_cache", full_occupancy=True, unreached="" if k in KV_DECODE_MEASURED else KV_DECODE_UNREACHED)
       for k in KV_DECODE},
    **{k: Budget("kv_cache", full_occupancy=True) for k in KV_DECODE_MERGE},
    # Gated DeltaNet decode: streams the recurrent state once, 1024 threads a group.
    **{k: Budget("linear_attention", full_occupancy=True) for k in LINEAR_ATTENTION},
    # Gated DeltaNet prefill (issue 32): the chunk-parallel prep and the state pass, per-chunk products on
    # simdgroup matrices, bound by arithmetic, as the prefill tiles. The prep reads a head's g and beta, 64
    # values strided by v_heads (the layer's [batch, tokens, v_heads] layout): v_heads lines for a column, 4
    # at the budget case's 4 heads, a few hundred bytes of the chunk's ~100 KB. Both move float32 scratch rows
    # as 8 x 8 fragments (the prep stores w and u, the state pass loads w, u, q and k decayed and the intra
    # attention): a fragment's 8 rows of 32 bytes are 8 lines for 2 lines' bytes (4.0), and the same
    # simdgroup's next 3 fragments along the row take the rest of those lines.
    **{k: Budget("linear_attention", full_occupancy=False, lines=4.0) for k in DELTANET_PREP},
    **{k: Budget("linear_attention", full_occupancy=False, lines=4.0) for k in DELTANET_STATE},
    # LFM2's conv decode: streams its windows and in_proj's row once.
    **{k: Budget("short_conv", full_occupancy=True) for k in SHORT_CONV},
}

# ------------------------------------------------ cases that measure them --
# The cheapest benchmark cases (by id, of `python -m benchmarks`, or of
# BUDGET_ONLY) that between them reach every kernel not marked unreached.
_LINEAR_SMALL = [f"{shape} {layout} {t} rows={r}{extra}"
                 for shape, types, extra in (("2048->768", ("float16", "bfloat16"), ""),
                                             ("768->2048", ("float16", "bfloat16", "float32"), ""),
                                             ("2048->128", ("float32", "float16", "bfloat16"), " misaligned"))
                 for layout in ("[N,K]", "[K,N]") for t in types for r in (1, 2, 4, 8)]
# fp32 with one output per simdgroup; misaligned with two
_LINEAR_SMALL += [f"{shape} [N,K] {t} rows={r}{extra}"
                  for shape, types, extra in (("2048->768", ("float32",), ""),
                                              ("768->2048", ("float32", "float16", "bfloat16"), " misaligned"))
                  for t in types for r in (1, 2, 4, 8)]
# A decode MoE layer for the budgets only (no model has it): Qwen3-30B-A3B's
# routing (128 experts, top 8: the route kernel's input as the model's), a
# 640-wide hidden state and 320-wide experts, 1/7.7 of the model's expert
# weights (its layer took 15 to 100 s of CPU a run, 90% of the moe budgets'
# time). Its expert products take the model's launch decisions on the 8-core
# GPU (decode_geometry's most, 16 simdgroups a threadgroup, as the model's
# layer gets on both GPUs), and on the 80-core one 8 simdgroups, every
# threadgroup whole; it reaches the same route, gate/up, down and combine
# kernels in each dtype.
BUDGET_LAYER = bench_moe.Model("budget", hidden=640, experts=128, top_k=8, shared=0, ffn=320)
BUDGET_ONLY = [bench_moe.layer_case(BUDGET_LAYER, 1, fp8, dtype)
               for fp8, dtype in ((False, torch.bfloat16), (True, torch.bfloat16), (False, torch.float32),
                                  (False, torch.float16))]
# ... and with the decoder layer's residual (moe_layer's residual=), which moe_down_combine reads as it
# stores: those loads meet the budgets too.
BUDGET_ONLY += [bench_moe.layer_case(BUDGET_LAYER, 1, fp8, torch.bfloat16, residual=True) for fp8 in (False, True)]
# ... and with the layer's residual add and post-attention norm in the router's dispatch (add_rms_norm_moe_layer)
BUDGET_ONLY += [bench_moe.layer_case(BUDGET_LAYER, 1, False, torch.bfloat16, add_norm=True)]
# moe_layer routes in its gate/up dispatch (moe_gate_up_routed); moe_route's own dispatch serves the layers past
# that kernel's limits and FusedMoE's grouped path: BUDGET_LAYER's routing (one token, 128 experts, top 8) in each
# dtype, and moe_experts with fp8 weights on aligned rows (its misaligned case is bench_moe's).


def _route_case(dtype) -> common.Case:
    def prepare():
        g = torch.Generator().manual_seed(0)
        logits = torch.randn(1, BUDGET_LAYER.experts, generator=g).to(dtype)
        k = BUDGET_LAYER.top_k
        return common.Prepared(lambda: torch.ops.mps_ext.moe_route(logits, k, True, False),
                               logits.nbytes + k * 4 + BUDGET_LAYER.experts * 4 + 2 * k * 4)
    labels = {"case": "moe_route", "model": "budget", "experts": str(BUDGET_LAYER.experts),
              "activation": str(dtype)[6:], "tokens / rows": "1", "weight": ""}
    return common.Case("moe", f"moe_route budget {str(dtype)[6:]} tokens=1", labels, prepare)


BUDGET_ONLY += [_route_case(dtype) for dtype in (torch.float32, torch.float16, torch.bfloat16)]
BUDGET_ONLY += [bench_grouped_mm.grouped_case("moe_experts", torch.bfloat16, 64, "nk", op="moe")]
BUDGET_CASES = {
    "softmax": [c.id for c in op_cases("softmax", "quick")],  # all but the 4096 x 4096 attention scores
    "linear": _LINEAR_SMALL + ["rms_norm_linear 2048->3072 weight bfloat16 rows=1",
                               "sigmoid_gate_linear 4096->2048 bfloat16 rows=1"]
    + [f"prefill 2048->768 [N,K] {t} rows=128" for t in ("float16", "bfloat16")],
    "pad": ["1x320x64x64 float32 [1, 1, 1, 1]", "1x512x64x64 bfloat16 [0, 1, 0, 1]",
            "1x3x1024x1024 uint8 [16, 16, 16, 16]", "8x4000 int64 [0, 96]"],
    # batched small inverses and every 32 x 32 case (128 x 128 ones take a minute each)
    "linalg": [c.id for c in op_cases("linalg", "quick") if c.id.startswith("inv 100000 ") or " x 32x32 " in c.id],
    "fp8": [c.id for c in op_cases("fp8", "quick")],  # the conversions, at an MoE expert's weight shape
    # the MoE expert's shape; prefill at 128 rows only: every prefill case runs the same 64 x 256 sample
    # block (bench_scaled_mm.product), which 512 and 2048 rows only scale
    "scaled_mm": [c.id for c in op_cases("scaled_mm", "quick")
                  if "2048->768" in c.id and not re.search(r" rows=(512|2048) ", c.id)]
    # ... and one at 2048 rows, the same sample block, for the steel comparison: MLX picks another tile there
    + ["scaled_mm 2048->768 float8_e4m3fn rows=2048 row"]
    # ... and a decoder layer's input norm in its fused fp8 q/k/v GEMV (rms_norm_fp8_gemv)
    + ["rms_norm_fp8_linear 2048->3072 bfloat16 rows=1 row"],
    "grouped_mm": [c.id for c in op_cases("grouped_mm", "quick")],  # the grouped products, on 256 columns
    # one decode token of a small MoE layer in each dtype (BUDGET_LAYER), and moe_experts misaligned
    "moe": [c.id for c in op_cases("moe", "quick") if not c.id.startswith("layer ")] + [c.id for c in BUDGET_ONLY],
    "norm": [c.id for c in op_cases("norm", "quick")],  # decode rows, a few KiB each
    # one decode token's each, in each dtype: a few KiB to a few MiB
    **{op: [c.id for c in op_cases(op, "quick")]
       for op in ("attention_gate", "kv_cache", "linear_attention", "short_conv")},
}


# The decode kernels' launch geometry follows the GPU (decode_geometry in
# csrc/dispatch/kernel_choice.h): their ops' cases run as on a large and on a
# small Mac (cpu_metal.set_gpu), the others' on the executor's default, the
# large one.
SMALL_GPU, LARGE_GPU = cpu_metal.GPU(cores=8, family=7), cpu_metal.GPU(cores=80, family=9)
GPUS = {op: (LARGE_GPU, SMALL_GPU) for op in ("linear", "scaled_mm", "grouped_mm", "moe")}
# The kernels whose launch the GPU changes: those the host sizes by
# target_threadgroups (csrc/dispatch/kernel_choice.h: decode_geometry, and
# linear.cpp's split of gemv_cols; the norm-first variants take their GEMV's
# geometry). Every other launch is the same on each GPU, so after the first
# GPU of GPUS a case runs again only if it reached one of these (the
# conversions, prefill tiles, routing and DeltaNet cases run once).
FOLLOWS_THE_GPU = ("gemv_rows_", "gemv_cols_", "fp8_gemv_", "gmm_decode_rows_", "moe_gate_up_routed_",
                   "rms_norm_gemv_rows_", "add_rms_norm_gemv_rows_", "rms_norm_fp8_gemv_", "sigmoid_gate_gemv_rows_")


@functools.lru_cache(maxsize=None)
def measured(op: str) -> dict[str, list[tuple[str, cpu_metal.DispatchStats]]]:
    """kernel -> [(case, its dispatch)] over the op's budget cases, run on
    the first GPU of GPUS[op], and on the others where it follows the GPU."""
    by_id = {c.id: c for size in ("full", "quick") for c in op_cases(op, size)}
    by_id.update((c.id, c) for c in BUDGET_ONLY if c.op == op)
    out: dict[str, list] = {}
    ids = BUDGET_CASES[op]
    for gpu in GPUS.get(op, (LARGE_GPU,)):
        before = cpu_metal.set_gpu(gpu)
        follows = []
        try:
            for id_ in ids:
                case = by_id.get(id_)
                assert case is not None, (f"BUDGET_CASES names {op} case {id_!r}, which benchmarks/bench_{op}.py no "
                                          "longer has")
                stats = common.measure(case, mac=False).stats
                for d in stats:
                    out.setdefault(d.kernel, []).append((f"{op} {id_} ({gpu.cores} cores)", d))
                if any(d.kernel.startswith(FOLLOWS_THE_GPU) for d in stats):
                    follows.append(id_)
        finally:
            cpu_metal.set_gpu(before)
        ids = follows
    return out


def library_infos() -> dict[str, cpu_metal.KernelInfo]:
    return {k: info for lib in common.library_kernels().values() for k, info in lib.items()}


# ------------------------------------------- decode registers (issue 20) --
# The one decode template (kernels_metal/decode.h) costs no more registers
# than the kernels it replaced: each variant at most what the kernel of that
# name used at d22396b (issue 11's kernels, before the template), counted by
# today's estimator (issue 11's table, docs/dev/kernel_counters_before_after.md,
# counted the CPU IR's 64-bit pointers and indices as 2 words each:
# docs/dev/kernel_counters_occupancy.md). (gemv_rows_*_r4_q1 and _r8_q1 are gone:
# at 3 to 8 rows decode_geometry always gives a simdgroup 2 outputs.)
DECODE_REGISTERS_BEFORE = {
    "fp8_gemv_bf16_r1_scalar": 21, "fp8_gemv_bf16_r1_vec": 39, "fp8_gemv_bf16_r2_scalar": 24,
    "fp8_gemv_bf16_r2_vec": 42, "fp8_gemv_bf16_r4_scalar": 19, "fp8_gemv_bf16_r4_vec": 35,
    "fp8_gemv_bf16_r8_scalar": 27, "fp8_gemv_bf16_r8_vec": 47, "fp8_gemv_f16_r1_scalar": 21,
    "fp8_gemv_f16_r1_vec": 39, "fp8_gemv_f16_r2_scalar": 24, "fp8_gemv_f16_r2_vec": 42, "fp8_gemv_f16_r4_scalar": 19,
    "fp8_gemv_f16_r4_vec": 35, "fp8_gemv_f16_r8_scalar": 27, "fp8_gemv_f16_r8_vec": 47, "fp8_gemv_f32_r1_scalar": 21,
    "fp8_gemv_f32_r1_vec": 39, "fp8_gemv_f32_r2_scalar": 24, "fp8_gemv_f32_r2_vec": 40, "fp8_gemv_f32_r4_scalar": 19,
    "fp8_gemv_f32_r4_vec": 35, "fp8_gemv_f32_r8_scalar": 27, "fp8_gemv_f32_r8_vec": 47, "fp8_gemv_fp8_r1_scalar": 22,
    "fp8_gemv_fp8_r1_vec": 39, "fp8_gemv_fp8_r2_scalar": 26, "fp8_gemv_fp8_r2_vec": 42, "fp8_gemv_fp8_r4_scalar": 21,
    "fp8_gemv_fp8_r4_vec": 34, "fp8_gemv_fp8_r8_scalar": 29, "fp8_gemv_fp8_r8_vec": 47,
    "gemv_cols_bf16_r1_scalar": 37, "gemv_cols_bf16_r1_vec": 40, "gemv_cols_bf16_r2_scalar": 38,
    "gemv_cols_bf16_r2_vec": 43, "gemv_cols_bf16_r4_scalar": 40, "gemv_cols_bf16_r4_vec": 48,
    "gemv_cols_bf16_r8_scalar": 44, "gemv_cols_bf16_r8_vec": 45, "gemv_cols_f16_r1_scalar": 37,
    "gemv_cols_f16_r1_vec": 40, "gemv_cols_f16_r2_scalar": 38, "gemv_cols_f16_r2_vec": 43,
    "gemv_cols_f16_r4_scalar": 40, "gemv_cols_f16_r4_vec": 48, "gemv_cols_f16_r8_scalar": 44,
    "gemv_cols_f16_r8_vec": 45, "gemv_cols_f32_r1_scalar": 37, "gemv_cols_f32_r1_vec": 42,
    "gemv_cols_f32_r2_scalar": 38, "gemv_cols_f32_r2_vec": 36, "gemv_cols_f32_r4_scalar": 40,
    "gemv_cols_f32_r4_vec": 39, "gemv_cols_f32_r8_scalar": 44, "gemv_cols_f32_r8_vec": 45, "gemv_cols_finish_bf16": 5,
    "gemv_cols_finish_f16": 5, "gemv_cols_finish_f32": 5, "gemv_rows_bf16_r1_q1_scalar": 27,
    "gemv_rows_bf16_r1_q1_vec": 31, "gemv_rows_bf16_r1_q2_scalar": 29, "gemv_rows_bf16_r1_q2_vec": 33,
    "gemv_rows_bf16_r2_q1_scalar": 28, "gemv_rows_bf16_r2_q1_vec": 32, "gemv_rows_bf16_r2_q2_scalar": 32,
    "gemv_rows_bf16_r2_q2_vec": 37, "gemv_rows_bf16_r4_q1_scalar": 30, "gemv_rows_bf16_r4_q1_vec": 34,
    "gemv_rows_bf16_r4_q2_scalar": 36, "gemv_rows_bf16_r4_q2_vec": 41, "gemv_rows_bf16_r8_q1_scalar": 34,
    "gemv_rows_bf16_r8_q1_vec": 29, "gemv_rows_bf16_r8_q2_scalar": 32, "gemv_rows_bf16_r8_q2_vec": 38,
    "gemv_rows_f16_r1_q1_scalar": 27, "gemv_rows_f16_r1_q1_vec": 31, "gemv_rows_f16_r1_q2_scalar": 29,
    "gemv_rows_f16_r1_q2_vec": 33, "gemv_rows_f16_r2_q1_scalar": 28, "gemv_rows_f16_r2_q1_vec": 32,
    "gemv_rows_f16_r2_q2_scalar": 32, "gemv_rows_f16_r2_q2_vec": 37, "gemv_rows_f16_r4_q1_scalar": 30,
    "gemv_rows_f16_r4_q1_vec": 34, "gemv_rows_f16_r4_q2_scalar": 36, "gemv_rows_f16_r4_q2_vec": 41,
    "gemv_rows_f16_r8_q1_scalar": 34, "gemv_rows_f16_r8_q1_vec": 29, "gemv_rows_f16_r8_q2_scalar": 32,
    "gemv_rows_f16_r8_q2_vec": 38, "gemv_rows_f32_r1_q1_scalar": 27, "gemv_rows_f32_r1_q1_vec": 29,
    "gemv_rows_f32_r1_q2_scalar": 29, "gemv_rows_f32_r1_q2_vec": 31, "gemv_rows_f32_r2_q1_scalar": 28,
    "gemv_rows_f32_r2_q1_vec": 30, "gemv_rows_f32_r2_q2_scalar": 32, "gemv_rows_f32_r2_q2_vec": 34,
    "gemv_rows_f32_r4_q1_scalar": 30, "gemv_rows_f32_r4_q1_vec": 32, "gemv_rows_f32_r4_q2_scalar": 36,
    "gemv_rows_f32_r4_q2_vec": 38, "gemv_rows_f32_r8_q1_scalar": 34, "gemv_rows_f32_r8_q1_vec": 27,
    "gemv_rows_f32_r8_q2_scalar": 32, "gemv_rows_f32_r8_q2_vec": 35,
    "gmm_decode_cols_bf16_scalar": 26, "gmm_decode_cols_bf16_vec": 38, "gmm_decode_cols_f16_scalar": 26,
    "gmm_decode_cols_f16_vec": 38, "gmm_decode_cols_f32_scalar": 26, "gmm_decode_cols_f32_vec": 26,
    "gmm_decode_rows_bf16_e4m3w_scalar": 38, "gmm_decode_rows_bf16_e4m3w_vec": 50, "gmm_decode_rows_bf16_scalar": 38,
    "gmm_decode_rows_bf16_vec": 44, "gmm_decode_rows_e4m3_scalar": 38, "gmm_decode_rows_e4m3_vec": 50,
    "gmm_decode_rows_f16_scalar": 38, "gmm_decode_rows_f16_vec": 44, "gmm_decode_rows_f32_scalar": 38,
    "gmm_decode_rows_f32_vec": 41,
}
# Raised on purpose: the figure allowed, and what the registers buy.
FP8_F32_R8_TWO_OUTPUTS = ("float activations at 8 rows: 2 outputs a simdgroup (16 accumulators), so that a "
                          "threadgroup of 16 simdgroups has the 32 outputs whose weight bytes cover the 8 x 4 bytes "
                          "of activations it stages per element of K: activation bytes from the caches 3.58 -> 1.00 "
                          "times the weight's (fp8_linear 2048->768, 80 cores)")
DECODE_REGISTERS_RAISED = {
    "fp8_gemv_f32_r8_vec": (52, FP8_F32_R8_TWO_OUTPUTS),  # 52: the full-occupancy budget
    "fp8_gemv_f32_r8_scalar": (40, FP8_F32_R8_TWO_OUTPUTS),
}
DECODE_KERNELS = [k for k in BUDGETS if k.startswith(("gemv_rows_", "gemv_cols_", "fp8_gemv_", "gmm_decode_"))]

# --------------------------------------------- budgets not yet met (xfail) --
# The misses left, each with its measured figure and why it stays.
PAD_SHORT_ROWS = ("pad: a simdgroup fills a segment of one output row, its vector stores aligned to 16 bytes; an "
                  "output row of 264 bytes (66 floats) starts 8 bytes into a piece, so its interior, 256 bytes, "
                  "spans 3 lines: 1.22 over the fewest. Only segments of the flattened output, across rows, would "
                  "meet the budget, at the price of an integer division per element to find its row; the extra "
                  "line is one partial line per row end, which a neighbouring simdgroup writes too")
SOFTMAX_STRIDED_BACKWARD = ("softmax backward over a strided dimension: a thread holds 16 gradient and 16 output "
                            "elements (32 of each would be 64 registers, over the full-occupancy budget), so a "
                            "threadgroup of 512 takes fewer contiguous inner rows than a line holds: fp32 at "
                            "D = 1024 8 of 16, bf16 at D = 512 16 of 64, 32-byte pieces, 2 lines over the fewest. "
                            "1024-thread threadgroups would take twice as many, but a pipeline whose registers "
                            "Apple's compiler counts higher than the executor would then refuse the launch")
LU_SOLVE_VECTOR = ("lu_solve with one right-hand side: x at 32 (f32) / 16 (c64) lines per instruction in the batched "
                   "solve (1 rhs) cases, because torch gives a batch of vector solutions the strides of a column-major "
                   "(batch, n) matrix (batched_matrix_contiguous_strides), so x[b, i] is at b + batch * i and a "
                   "matrix's rows, one per lane, are a line apart; lanes over matrices instead would read the factors "
                   "(n^2 elements a matrix against x's n) a line per lane")
# Issue 21's budgets on the kernels beyond linear (figures at the budget
# cases, tests/test_budgets.measured; docs/dev/kernel_counters_occupancy.md).
DIVISIONS_UNEXAMINED = ("{} 32-bit integer and {} float divisions per thread (the busiest) at the budget cases, not "
                        "yet traced to their source: whether each is a fixed number per thread or sits in a loop "
                        "that grows with the problem is not known, so no DIVISIONS entry allows them")
RMS_NORM_DIVISIONS = ("rms_norm: 2 IEEE float divisions per row (ss / n, torch's mean, and 1 / sqrt(...)), inside "
                      "the loop over the rows a team takes (p.iterations), so they grow with the rows once those "
                      "exceed the teams launched: 2 per thread at f32 and f16, 16 at bf16 (8 rows a team). Per "
                      "element of a row they are 2 / n; rsqrt or a reciprocal of n would change the rounding "
                      "against torch's, not a small fix")
# kernel -> (32-bit integer, float) divisions per thread measured, busiest thread over the cases
UNEXAMINED_FIGURES: dict[str, tuple[int, int]] = {
    **{k: (16, 0) for k in FP8_GEMV},
    # (after the norm: fp8_gemv's, and the norm's 2 per row, ss / n and 1 / sqrt(...))
    **{k: (16, 2) for k in RMS_FP8_GEMV},
    # (gmm_decode_rows_*_vec: 1 and 1 where moe_layer's gate/up product ran it, the gather's i / slots among
    # them; the cases that measure them now, the grouped products and moe_experts, gather nothing: none)
    **{k: (1, 0) for k in names("gmm_decode_cols_{t}_{path}", t=("f32", "f16", "bf16"), path=("vec", "scalar"))},
    **{k: (0, 16) for k in MOE_ROUTE_COMBINE if k.startswith("moe_route_")},
    **{k: (16, 6) for k in LINEAR_ATTENTION},
    "lu_small_f32_1": (4, 1), "lu_small_f32_2": (16, 6), "lu_small_f32_3": (36, 12), "lu_small_f32_4": (64, 20),
    "lu_small_c64_1": (4, 7), "lu_small_c64_2": (16, 20), "lu_small_c64_3": (36, 39), "lu_small_c64_4": (64, 64),
    "lu_panel_f32": (128, 32), "lu_panel_c64": (128, 128),
    "lu_solve_f32_1": (2, 2), "lu_solve_f32_4": (10, 4), "lu_solve_f32_16": (2, 16),
    "lu_solve_c64_1": (2, 3), "lu_solve_c64_4": (10, 12), "lu_solve_c64_16": (2, 48),
    **{k: (8, 0) for k in LU_UNPACK},
}
# fp8_mm_tile's 64 x 64 tile (issue 32): its 128 threads hold each operand's next 128-byte line (whole lines a load
# instruction: the coalescing budget) in registers until its last stage is staged, then load the next one after
# that stage's first barrier. A second set of registers loaded before the barrier (a prefetch) took 129 to 159
# registers, over MAX_REGISTERS; one set is 108 to 123.
FP8_TILE_LOADS_AFTER_BARRIER = ("fp8_mm_tile: the next line's loads follow the stage's first barrier (104 to 156 "
                                "device loads of the stage loop's iteration, executor estimate): prefetched into a "
                                "second set of registers they took 129 to 159 registers; 256-thread tiles (half the "
                                "registers a thread) would allow both, not done yet")
# gmm_tiled's stages (issue 32 point 4): a thread's 16-byte pieces at one column of the 32-wide stage, consecutive
# lanes on one row's pieces: a 16-bit row of a stage is 64 bytes, an e4m3 one 32, so a load instruction's 32 lanes
# touch 8 or 16 rows' half or quarter lines (2.0 and 4.0 lines over the minimum; the 16-bit-staged kernel it replaced,
# 32 lanes on one row's 32 elements, met the budget). Not yet: fp8_mm_tile's whole 128-byte lines kept in registers
# across the stages that use them.
GMM_TILED_HALF_LINES = ("gmm_tiled: a 32-wide stage's rows are 64 (16-bit) or 32 (e4m3) bytes, and a load "
                        "instruction's lanes take 8 or 16 rows of it: 2.0 / 4.0 lines over the minimum; whole lines "
                        "across stages (fp8_mm_tile's) not done yet")
GMM_TILED_LOADS_AFTER_BARRIER = ("gmm_tiled: the next stage's pieces load after the stage's first barrier, inside "
                                 "`if (next < k1)`, so their values reach the next iteration through that branch's "
                                 "merge, not straight to the loop header (4 to 40 loads, executor analysis); "
                                 "unconditional loads (zeros past K) not done yet")
# moe_gate_up_routed (the routing in moe_layer's gate/up dispatch): what threadgroup (0, 0) adds to write
# moe_route's outputs, as moe_route computes them.
MOE_ROUTED_LOADS_AFTER_BARRIER = ("moe_gate_up_routed: threadgroup (0, 0) reads, after the token's ranking barriers, "
                                  "the logits again for the softmax sums in moe_route's order, each chosen expert's "
                                  "logit and the shared expert's gate (3 loads, executor analysis; the other "
                                  "threadgroups none): the keys in threadgroup memory could serve the first two "
                                  "(softmax), a score array the sigmoid weights; not done yet")
MOE_ROUTED_DIVISIONS = ("moe_gate_up_routed: gmm_decode_rows' 1 32-bit division (a slot's token, i / slots) and 1 "
                        "float, plus moe_route's 16 float divisions in thread 0 of threadgroup (0, 0): each chosen "
                        "expert's exp / sum and its renormalisation, top_k each per token (1 and 17 at the budget "
                        "layer, one token of top 8), so they grow with the tokens as moe_route's do")
NOT_YET: dict[str, dict[str, str]] = {  # budget -> {kernel: why it is not met yet}
    # (issue 32) the prefill tiles' useful MMA slots against MLX's steel GEMM's at the same shapes: all met
    # (docs/dev/compute_efficiency.md has the whole table)
    "steel": {},
    "coalescing": {
        **{k: GMM_TILED_HALF_LINES for k in ("gmm_tiled_f16", "gmm_tiled_bf16", "gmm_tiled_e4m3", *GMM_TILED_DENSE)},
        **{k: GMM_TILED_HALF_LINES for k in GMM_TILED_DENSE_FP8},
        # The layer hands q, k, v over as a transposed view of its convolution's output ([batch, channels,
        # tokens] transposed: a channel's tokens are contiguous, a token's channels are `tokens` apart), and the
        # prep kernel's lanes read along dk: every lane its own line (32.0 on q in the benchmark case, which
        # takes the layer's layout). Not yet: lanes along tokens for that layout (or one copy to [tokens,
        # channels] before the op).
        **{k: "linear_attention_chunk_prep reads the layer's transposed q, k, v along dk: 32 lines an access "
              "(lanes along tokens for that layout not yet written)" for k in DELTANET_PREP},
        "constant_pad_4_i32": PAD_SHORT_ROWS,
        **{k: SOFTMAX_STRIDED_BACKWARD for k in ("softmax_backward_strided_f32_f32_i32",
                                                 "softmax_backward_strided_bf16_bf16_i32")},
        **{k: LU_SOLVE_VECTOR for k in names("lu_solve_{t}_1", t=("f32", "c64"))},
    },
    "no_64_bit_division": {},
    # gmm_decode_rows with fp8 experts at 8 rows was 58 registers (issue 11); 51 since the estimate leaves
    # out the CPU IR's 64-bit pointers and indices (issue 21), within the budget.
    "registers": {},
    "registers_fit_threadgroup": {},
    "no_private_memory": {},
    "no_bank_conflicts": {
        # 72 extra cycles a threadgroup (of ~12,000 threadgroup-memory instructions) at the budget case, since
        # the products moved to simdgroup matrices (24 before, with A's strictly-lower mask; the Gram
        # staging's 4,096 of the first MMA version went with rows 4 apart): not yet traced further.
        **{k: "linear_attention_chunk_prep: 72 bank-conflict cycles a threadgroup (not yet traced)"
           for k in DELTANET_PREP},
    },
    "decode_registers": {},
    "no_load_after_barrier": {
        **{k: MOE_ROUTED_LOADS_AFTER_BARRIER for k in MOE_GATE_UP_ROUTED},
        **{k: FP8_TILE_LOADS_AFTER_BARRIER for k in FP8_TILE},
        **{k: GMM_TILED_LOADS_AFTER_BARRIER for k in GMM_TILED + GMM_TILED_DENSE},
        **{k: GMM_TILED_LOADS_AFTER_BARRIER for k in GMM_TILED_DENSE_FP8},
    },
    "threadgroups_per_core": {},
    "threadgroup_memory_residency": {},
    "activation_rereads": {},
    "divisions": {
        **{k: DIVISIONS_UNEXAMINED.format(*UNEXAMINED_FIGURES[k]) for k in UNEXAMINED_FIGURES},
        **{k: MOE_ROUTED_DIVISIONS for k in MOE_GATE_UP_ROUTED},
        **{k: RMS_NORM_DIVISIONS for k in RMS_NORM},
    },
}

def softmax_elements_a_thread(k):
    """The forward's float divisions a thread: the elements it holds (the
    backward divides none)."""
    if "backward" in k:
        return 0
    if "_segment_" in k:  # 16 bytes a lane of the widest of input and output, 4 floats on the element path
        return 4 if "f32" in k or k.endswith("_i32") else 8
    return 16 if "_block_" in k else 8 if "_finish_" in k else 32  # strided


# Divisions per thread allowed beyond 0 (32-bit integer, float), each with
# what they are: a fixed number per thread, none in a loop over the problem.
# (DIVISIONS) Qwen3.6's 4096-element row over the 80-core GPU's 96 threads a threadgroup (3 simdgroups of
# 2 outputs: decode_geometry for N = 2048), ceil(4096 / 96); 8 on the 8-core's 512
GATE_GEMV_SIGMOIDS = 43

DIVISIONS: dict[str, tuple[int, int]] = {
    # decode attention: a simdgroup's query head and stream (sg % gqa, sg / gqa), and one block's 1 / l, once a
    # thread; the merge's acc / l once a thread (neither grows with the keys)
    **{k: (2, 1) for k in KV_DECODE},
    **{k: (0, 1) for k in KV_DECODE_MERGE},
    # the DeltaNet prefill kernels: the prep's key head (h / ratio), the state pass's column and row of its
    # thread in the tile (t % tile, t / tile and 256 / tile: a power of two the CPU's IR keeps as a division),
    # once a thread
    **{k: (1, 0) for k in DELTANET_PREP},
    **{k: (4, 0) for k in DELTANET_STATE},
    # the split's K range: k_begin and k_end, each a division by the split count, once a thread
    **{k: (2, 0) for k in GEMV_COLS},
    # softmax: the one 32-bit division of where a thread's pieces of the row start (whole pieces over the
    # threadgroup's step, softmax.metal's `d / s.step`); and the forward's v / sum for each element a thread
    # holds, J x C, fixed by the kernel's template (4 to 32), not by the row's length
    **{k: (1, softmax_elements_a_thread(k)) for k in SOFTMAX_VEC + SOFTMAX_ELEMENTS if "_partial_" not in k},
    # pad: a simdgroup's task, once a thread (no loop over tasks): its output row, task / segments_per_row,
    # and the row's coordinates, a division and a remainder per outer dimension (pad.metal), so a number
    # set by the tensor's rank (4 at the cases' 4-D tensors; a 5-D one would need more), not its size
    **{k: (4, 0) for k in PAD_32},
    # fp8_convert_strided: a threadgroup's tile (group / tiles, group % tiles), once a thread
    **{k: (2, 0) for k in FP8_CONVERT if "_strided_" in k},
    # fp8_mm_tile: each lane's 4 weight rows' scale row n / sb_n_group, once a thread
    # (docs/dev/kernel_counters_occupancy.md)
    **{k: (4, 0) for k in FP8_TILE},
    # qk_norm_rope (and qk_norm_rope_append, whose value rows divide nothing): torch's mean (ss / D) and
    # 1 / sqrt(...) per head row a simdgroup normalises; a simdgroup
    # takes its share of one token's head group (p.iterations rows, set by the head count, never by the
    # tokens): 2 at every decode case, where each simdgroup has one head
    **{k: (0, 2) for k in QK_NORM_ROPE},
    # sigmoid_gate: torch's sigmoid, 1 / (1 + exp(-g)), for the one element a thread takes
    **{k: (0, 1) for k in ATTENTION if k.startswith("sigmoid_gate_")},
    # add_rms_norm: rms_norm's 2 per row (torch's mean, ss / n, and 1 / sqrt(...)); its cases are a decode
    # token's one row, so 2 a thread. Unlike rms_norm's, no case here gives a team several rows: the
    # layer's residual stream at prefill would (RMS_NORM_DIVISIONS), 2 per row a team takes
    **{k: (0, 2) for k in ADD_RMS_NORM},
    # rms_norm_gemv_rows: rms_norm's 2 per row (ss / n and 1 / sqrt(...)), by every thread of each
    # threadgroup for each of its 1 to 8 activation rows (the decode case: one)
    **{k: (0, 2) for k in RMS_GEMV_ROWS},
    # add_rms_norm_gemv_rows: the same, with the residual added first
    **{k: (0, 2) for k in ADD_RMS_GEMV_ROWS},
    # sigmoid_gate_gemv_rows: where a thread's first staged element and its step fall in a head (two
    # divisions, once a thread; the compiled kernel has a third, once a thread too: measured 3 at both
    # GPUs' geometries, the same at any K), and torch's sigmoid, 1 / (1 + exp(-g)), for each element of
    # the gated rows a thread stages: rows * K / threads, by every threadgroup (the GEMV's work a thread
    # is K * N / (threads * threadgroups) multiply-adds, far more); GATE_GEMV_SIGMOIDS at the measured case
    **{k: (3, GATE_GEMV_SIGMOIDS) for k in GATE_GEMV_ROWS},
}


def params(budget: str, kernels) -> list:
    return [pytest.param(k, id=k, marks=pytest.mark.xfail(strict=True, reason=NOT_YET[budget][k]))
            if k in NOT_YET[budget] else pytest.param(k, id=k) for k in kernels]


REACHED = [k for k, b in BUDGETS.items() if not b.unreached]


# ------------------------------------------------------------------ tests --
def test_every_kernel_is_budgeted():
    have = set(library_infos())
    assert not have - set(BUDGETS), f"kernels without a budget (add them to BUDGETS): {sorted(have - set(BUDGETS))}"
    assert not set(BUDGETS) - have, f"budgets of kernels that no longer exist: {sorted(set(BUDGETS) - have)}"
    for budget, kernels in NOT_YET.items():
        assert set(kernels) <= set(BUDGETS), (budget, sorted(set(kernels) - set(BUDGETS)))


@pytest.mark.parametrize("op", OPS)
def test_every_reachable_kernel_is_measured(op):
    missing = [k for k in REACHED if BUDGETS[k].op == op and k not in measured(op)]
    assert not missing, f"no {op} budget case reaches {missing}: add the benchmark case that does to BUDGET_CASES"
    # (A case may reach another op's kernels, such as a MoE layer's router
    # GEMV: that op's cases measure them.)
    unbudgeted = [k for k in measured(op) if k not in BUDGETS]
    assert not unbudgeted, f"{op} cases reach {unbudgeted}, which have no budget"


def dispatches(kernel):
    return measured(BUDGETS[kernel].op)[kernel]


@pytest.mark.parametrize("kernel", params("coalescing", REACHED))
def test_coalescing(kernel):
    worst = {}
    for case, d in dispatches(kernel):
        for buffer, ratio in common.device_coalescing(d).items():
            if ratio > worst.get(buffer, (0.0, ""))[0]:
                worst[buffer] = (ratio, case)
    limit = BUDGETS[kernel].lines
    over = {b: w for b, w in worst.items() if w[0] > limit}
    assert not over, f"{kernel}: lines per instruction over the minimum above {limit} (ratio, case): {over}"


@pytest.mark.parametrize("kernel", params("no_64_bit_division", [k for k in REACHED if BUDGETS[k].index32]))
def test_no_64_bit_division(kernel):
    per_thread = {case: d.int64_divisions_per_thread for case, d in dispatches(kernel) if d.int64_divisions}
    assert not per_thread, f"{kernel}: 64-bit divisions per thread: {per_thread}"


@pytest.mark.parametrize("kernel", params("registers", list(BUDGETS)))
def test_registers(kernel):
    info = library_infos()[kernel]
    budget = cpu_metal.FULL_OCCUPANCY_REGISTERS if BUDGETS[kernel].full_occupancy else cpu_metal.MAX_REGISTERS
    assert info.registers <= budget, (
        f"{kernel}: {info.registers} registers, over its budget of {budget} "
        f"({cpu_metal.occupancy(info.registers)} threads per core instead of 1024)")


@pytest.mark.parametrize("kernel", params("registers_fit_threadgroup", REACHED))
def test_registers_fit_the_threadgroup(kernel):
    for case, d in dispatches(kernel):
        x, y, z = d.threads_per_threadgroup
        limit = cpu_metal.registers_for(x * y * z)
        assert d.kernel_info.registers <= limit, (
            f"{kernel}: {d.kernel_info.registers} registers; a pipeline allows {x * y * z} threads "
            f"(as {case} launches) up to {limit}")


@pytest.mark.parametrize("kernel", params("no_private_memory", list(BUDGETS)))
def test_no_private_memory(kernel):
    assert library_infos()[kernel].private_bytes == 0, f"{kernel}: thread-private arrays in stack memory"


@pytest.mark.parametrize("kernel", params("no_bank_conflicts", REACHED))
def test_no_bank_conflicts(kernel):
    cycles = {case: (d.bank_conflict_cycles, d.threadgroup_memory_instructions)
              for case, d in dispatches(kernel) if d.bank_conflict_cycles}
    assert not cycles, f"{kernel}: bank-conflict cycles over threadgroup-memory instructions: {cycles}"


@pytest.mark.parametrize("kernel", params("no_load_after_barrier", list(BUDGETS)))
def test_no_load_after_barrier(kernel):
    n = library_infos()[kernel].loads_after_barrier
    assert n == 0, f"{kernel}: {n} device loads of a loop's iteration wait behind its threadgroup barrier"


# ------------------------------------------------ issue 21's counters --
# Each check takes one dispatch and says what misses its budget ("" if
# met); test_issue21_budgets_fail_on_planted_kernels shows each can fail.
def threads_of(d) -> int:
    x, y, z = d.threads_per_threadgroup
    return x * y * z


def residency_miss(d) -> str:
    """At least 2 threadgroups a core (1 of 1024 threads, a core's most),
    by threadgroup memory and registers both."""
    threads = threads_of(d)
    least = min(2, 1024 // threads)
    got = d.threadgroups_per_core
    return "" if got >= least else (
        f"{got} threadgroup(s) of {threads} threads per core ({d.threadgroup_memory} bytes of threadgroup memory, "
        f"{d.kernel_info.registers} registers), fewer than {least}")


def memory_residency_miss(d, cores: int | None = None) -> str:
    """Threadgroup memory holds no fewer threadgroups a core than the
    registers do, or than the dispatch gives a core of `cores` (None: as
    many as the registers allow)."""
    by_threads = cpu_metal.occupancy(d.kernel_info.registers) // threads_of(d)
    by_memory = cpu_metal.THREADGROUP_MEMORY_PER_CORE // d.threadgroup_memory if d.threadgroup_memory else by_threads
    need = by_threads if cores is None else min(by_threads, -(-math.prod(d.threadgroups) // cores))
    return "" if by_memory >= need else (
        f"{d.threadgroup_memory} bytes of threadgroup memory per {threads_of(d)} threads: {by_memory} threadgroups "
        f"per core, where its registers allow {by_threads} and the dispatch gives a core {need}")


def cores_of(case: str) -> int:
    """The GPU a budget case was measured on: '... (8 cores)', else the
    executor's default."""
    m = re.search(r"\((\d+) cores\)", case)
    return int(m.group(1)) if m else cpu_metal.gpu().cores


def reread_miss(d, reread: str, against: str, most: float = 1.0) -> str:
    """The bytes of buffer `reread` that the threadgroups read (each
    threadgroup's distinct bytes, cache hits included) at most `most` times
    the bytes the dispatch read of buffer `against`."""
    got = d.threadgroup_bytes_read_distinct.get(d.buffer(reread), 0)
    base = d.unique_bytes_read.get(d.buffer(against), 0)
    return "" if got <= most * base else (
        f"threadgroups read {got} bytes of {reread}, {got / max(base, 1):.2f} times the {base} bytes of {against}")


def divisions_miss(d, int32: int, floats: int) -> str:
    """32-bit integer divisions by a run-time value and IEEE float divisions
    per thread (the busiest) at most `int32` and `floats`."""
    got = (d.max_int32_divisions_per_thread, d.max_float_divisions_per_thread)
    return "" if got[0] <= int32 and got[1] <= floats else (
        f"{got[0]} 32-bit integer and {got[1]} float divisions per thread, over {int32} and {floats}")


def misses(kernel, check, *args) -> dict[str, str]:
    return {case: why for case, d in dispatches(kernel) if (why := check(d, *args))}


# Every reached kernel is measured against these four (they read the
# dispatches measured() already holds), except where the budget does not
# apply to a kind of kernel, as the module's docstring says.
@pytest.mark.parametrize("kernel", params("threadgroups_per_core", REACHED))
def test_threadgroups_per_core(kernel):
    over = misses(kernel, residency_miss)
    assert not over, f"{kernel}: {over}"


@pytest.mark.parametrize("kernel", params("threadgroup_memory_residency",
                                          [k for k in REACHED if BUDGETS[k].full_occupancy]))
def test_threadgroup_memory_does_not_limit_residency(kernel):
    over = {case: why for case, d in dispatches(kernel) if (why := memory_residency_miss(d, cores_of(case)))}
    assert not over, f"{kernel}: {over}"


@pytest.mark.parametrize("kernel", params("activation_rereads", [k for k in REACHED if BUDGETS[k].activation]))
def test_decode_activation_rereads(kernel):
    over = misses(kernel, reread_miss, BUDGETS[kernel].activation, "w")
    assert not over, f"{kernel}: {over}"


@pytest.mark.parametrize("kernel", params("divisions", REACHED))
def test_divisions(kernel):
    over = misses(kernel, divisions_miss, *DIVISIONS.get(kernel, (0, 0)))
    assert not over, f"{kernel}: {over}"


def test_issue21_budgets_fail_on_planted_kernels():
    # The executor's counter test kernels (tests/cpu_metal/kernels/counters.metal),
    # each bad on purpose, through the same checks.
    from pathlib import Path
    source = Path(__file__).parent / "cpu_metal" / "kernels" / "counters.metal"
    lib = cpu_metal.compile_library(source.read_text(), filename="counters.metal")
    x = torch.arange(1024, dtype=torch.float32)

    def run(name, args, threads=128, group=64):
        return lib.dispatch(name, args, threads=threads, threads_per_threadgroup=group, counters=True)

    # 65 registers: 768 threads a core, one threadgroup of 512.
    rows = torch.ones(1024 * 64)  # 64 floats a thread
    d = run("hold_64_floats", [torch.empty(1024), rows], threads=1024, group=512)
    assert "fewer than 2" in residency_miss(d)
    assert not residency_miss(run("hold_64_floats", [torch.empty(1024), rows], threads=1024, group=256))
    # 24 KiB per 64 threads: 2 threadgroups a core, where the registers allow 16.
    d = run("threadgroup_24k", [torch.empty(128)])
    assert "2 threadgroups per core, where its registers allow 16" in memory_residency_miss(d)
    assert not residency_miss(d)
    # Each of 2 threadgroups reads the whole of `in`: 2 times its bytes.
    d = run("every_group_reads_all", [torch.empty(128), x])
    assert "2.00 times" in reread_miss(d, "in", "in")
    assert not reread_miss(d, "in", "in", most=2.0)
    # One 32-bit division and remainder by a run-time value per thread; an IEEE division.
    divisor = np.array([(7, 5, 7, 0)], dtype=[("divisor", "<u8"), ("factor", "<u8"), ("divisor32", "<u4"),
                                              ("pad", "<u4")])[0]
    d = run("div_mod_32", [torch.empty(256, dtype=torch.int32), torch.arange(256, dtype=torch.int32), divisor])
    assert divisions_miss(d, 0, 0) and not divisions_miss(d, d.max_int32_divisions_per_thread, 0)
    d = run("divide_floats", [torch.empty(128), x, x + 1])
    assert divisions_miss(d, 0, 0) and not divisions_miss(d, 0, d.max_float_divisions_per_thread)


@pytest.mark.parametrize("kernel", params("decode_registers", DECODE_KERNELS))
def test_decode_registers_hold_the_kernels_they_replaced(kernel):
    before = DECODE_REGISTERS_BEFORE[kernel]
    allowed, why = DECODE_REGISTERS_RAISED.get(kernel, (before, ""))
    registers = library_infos()[kernel].registers
    assert registers <= allowed, (f"{kernel}: {registers} registers, over the {before} of the kernel it replaced"
                                  + (f" (raised to {allowed}: {why})" if why else ""))


# ------------------------------------------ compute efficiency (issue 32) --
# The prefill tiles' counted matrix efficiency (benchmarks/efficiency.py):
# the multiply-accumulates the product needs, as a share of the estimated
# issue slots (DispatchStats.matrix_slot_fraction, docs/dev/contributing.md,
# "Compute efficiency"), at least 90% of MLX's steel GEMM's at the same
# shape and dtype, run on the executor from MLX's own source.
STEEL_SHARE = 0.9


def case_labels(op: str, id_: str) -> dict[str, str]:
    return next(c.labels for size in ("full", "quick") for c in op_cases(op, size) if c.id == id_)


def steel_share(op: str, steel) -> float:
    """Steel's useful MMA slots to hold a tiled kernel to. grouped_mm's
    cases give each expert 16 rows, where MLX's 64-row tile spends 3/4 of
    its MMAs on padding rows; a prompt's experts get 16 rows and more, and
    steel's tiles are full from 64, so the grouped products are held to
    steel with every row of its tile used (its matrix_slot_fraction), as
    benchmarks/prefill.py's _COUNTED counts it, not to its padded share."""
    return steel.matrix_slot_fraction if op == "grouped_mm" else steel.useful_slot_fraction


def steel_miss(d, op: str, case: str) -> str:
    id_ = re.fullmatch(rf"{op} (.*) \(\d+ cores\)", case).group(1)
    ours, steel = efficiency.compare(op, case_labels(op, id_), [d])
    theirs = steel_share(op, steel)
    if ours.useful_slot_fraction >= STEEL_SHARE * theirs:
        return ""
    return (f"useful MMA slots {ours.useful_slot_fraction:.3f} against steel's {theirs:.3f} "
            f"({ours.useful_slot_fraction / theirs:.2f}x; other slots per MMA "
            f"{ours.other_slots_per_mma:.1f} against {steel.other_slots_per_mma:.1f}; FLOPs / device byte "
            f"{ours.flops_per_device_byte:.1f} against {steel.flops_per_device_byte:.1f})")


@pytest.mark.parametrize("kernel", params("steel", [k for k in FP8_TILE + GMM_TILED + GMM_TILED_DENSE
                                                   + GMM_TILED_DENSE_FP8 if not BUDGETS[k].unreached]))
def test_matrix_efficiency_against_steel(kernel):
    op = BUDGETS[kernel].op
    miss = {case: m for case, d in dispatches(kernel) for m in [steel_miss(d, op, case)] if m}
    assert not miss, f"{kernel}: {miss}"


# In linear_attention's xdist group (parametrized by one of its kernels), on the measurement its budgets made.
@pytest.mark.parametrize("kernel", [DELTANET_STATE[-1]])
def test_prefill_delta_rule_figure_is_the_counter(kernel):
    """benchmarks/prefill.py's counted efficiency of the chunked delta rule
    (DELTA_RULE_COUNTED, the projection's linear_attention_chunk) is the
    counter's: the delta rule's FLOPs in MMA slots over both kernels' issue
    slots at its budget case, and steel's useful share at the case it names."""
    c = prefill.DELTA_RULE_COUNTED
    model = bench_linear_attention.PREFILL_BUDGET
    labels = case_labels("linear_attention", c.case)
    assert labels["model"] == model.name
    stats = [d for k in (DELTANET_PREP + DELTANET_STATE) if k in measured("linear_attention")
             for case, d in dispatches(k) if case.startswith(f"linear_attention {c.case} (")]
    assert sorted(d.kernel for d in stats) == [f"linear_attention_chunk_{k}_bf16" for k in ("prep", "state")]
    tokens = int(labels["tokens"])
    flops = census.delta_rule_chunk_flops(model.dk, model.dv, prefill.CHUNK) * model.v_heads * prefill.chunks(tokens)
    ours = efficiency.figures(stats, flops).useful_slot_fraction
    steel = efficiency.steel_figures(efficiency.shape_of("scaled_mm", case_labels("scaled_mm", c.steel_case)))
    assert (round(ours, 3), round(steel.useful_slot_fraction, 3)) == (c.ours, c.steel)


# Parametrized by kernel, as the budgets are, so that tests/conftest.py runs each in its op's xdist group,
# on the measurement (measured()) the op's budgets already made: by prefix it measured scaled_mm and
# grouped_mm a second time in the other worker (162 s and 71 s on CI).
@pytest.mark.parametrize("kernel", [c.kernel for c in prefill._COUNTED.values()])
def test_prefill_counted_figures_are_the_counters(kernel):
    """benchmarks/prefill.py's counted efficiencies (the time-to-first-token
    projection's, prefill.MEASURED_EFFICIENCY) are the counter's figures at
    the budget case each names, ours and steel's: a kernel that changes
    them fails here until prefill.py has the new ones."""
    c = next(c for c in prefill._COUNTED.values() if c.kernel == kernel)
    d = next(d for case, d in dispatches(c.kernel) if case.startswith(f"{c.op} {c.case} ("))
    labels = case_labels(c.op, c.case)
    ours, steel = efficiency.compare(c.op, labels, [d])
    if c.steel_rows is not None:  # steel with the tile MLX picks at that many rows
        steel_share = efficiency.steel_figures(efficiency.shape_of(c.op, {**labels, "rows": str(c.steel_rows)}))
        steel_share = steel_share.useful_slot_fraction
    else:
        steel_share = steel.matrix_slot_fraction
    assert (round(ours.useful_slot_fraction, 3), round(steel_share, 3)) == (c.ours, c.steel), c.what
