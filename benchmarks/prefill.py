"""What a prompt's prefill costs, counted from real model code, and the
time to first token (TTFT) it projects on an M3 Ultra.

The prefill is the forward `model.generate` runs on the prompt: one
sequence of `length` tokens, a new cache, logits of the last position only
(census.trace_prefill). Counted as the decode census counts a step
(benchmarks/census.py's rules: host calls, views, dispatches, syncs), with
what a prompt changes:

- Calls and dispatches per layer kind come from a tiny prefill traced at two
  lengths, `trace_lengths`: whole chunks of the Gated DeltaNet reference
  (transformers' torch_chunk_gated_delta_rule loops over chunks of CHUNK
  tokens, so its calls grow with the prompt) and past the token slots where
  mps_ext's MoE paths switch from their decode kernels to the prefill ones
  (MOE_SLOTS), so that the tiny trace takes the path a real prompt takes.
  Per layer kind, calls = base + per chunk x chunks(length), both derived
  from the two traces (`scale_counts`); every other kind's calls are the
  same at both lengths. torch's SDPA on a prompt: one dispatch
  (census.sdpa_dispatches; a graph counted as one: a lower bound, as every
  MPSGraph op here).
- FLOPs (`layer_flops`): matrix products only (what simdgroup-matrix units
  run), from the real config's dimensions at the real length: every
  projection (2 x rows x in x out; routed experts top_k rows a token, the
  router, a shared expert), attention's QK^T and PV over the causal half
  (L(L+1)/2 query-key pairs a head), the chunked delta rule as transformers'
  reference computes it (per value head and chunk of C: K_beta K^T and Q K^T,
  2 C^2 d_k each; two unitriangular solves, C(C-1)(d_k + d_v); the state
  pass, 2 C d_k d_v three times and 2 C^2 d_v; on the prompt padded to whole
  chunks), and the LM head on one row. Pointwise work, norms, the
  convolutions and the triangular-mask arithmetic are not counted (they
  are bandwidth work; their bytes are not counted either: see below).
  tests/test_prefill_census.py checks the formula against the FLOPs of the
  traced tiny model's own calls (census.matrix_flops).
- Bytes (`layer_bytes`): a lower bound, what kernels that read each operand
  and write each result once would move: the weights (every expert a
  prompt chooses, census.expected_experts; bf16, or as quantize_fp8 leaves
  them), each projection's input and output rows, attention's Q, K, V and
  output and the KV cache written, the DeltaNet state (fp32) read and
  written once a chunk, the embedding rows and the LM head. Intermediate
  tensors of the torch reference (the chunk's decay matrices, the padded
  copies) are not counted.
- Time to first token (`project`): compute at PEAK x the efficiency of the
  kernel each part runs (KERNEL_EFFICIENCY, or a counted figure in
  MEASURED_EFFICIENCY), the dispatches at timeline's GPU cost per dispatch,
  bytes at its bandwidth; GPU time = max(compute, bytes) + dispatches; the
  host's calls, views, syncs (each a round trip) and empty groups at
  timeline's constants. Within one forward torch's MPS stream commits only
  at a sync (benchmarks/timeline.py), so host and GPU time add up (without
  a sync the GPU starts when the forward's buffer is committed); the row's
  bound is the largest of compute, bytes, dispatches and host.
Eager only: a prompt's shapes differ from call to call, and torch.compile
with dynamic shapes is not counted here.
"""

from __future__ import annotations

import collections
import dataclasses

from benchmarks import census, timeline

LENGTHS = (512, 4096, 32768)
# transformers' torch_chunk_gated_delta_rule(chunk_size=64), the default the Qwen3.5/3.6 models call it with
# (transformers 5 models/qwen3_5_moe/modeling_qwen3_5_moe.py), and mps_ext's linear_attention_chunk's;
# trace_lengths traces whole chunks of it.
CHUNK = census.DELTA_CHUNK
# mps_ext's MoE paths take their decode kernels up to 1024 token slots (mps_ext/passes/moe.py MAX_SLOTS,
# tokens x (top_k + shared); mps_ext/fp8.py FP8Experts.DECODE_ROWS, tokens x top_k) and the prefill tiles
# beyond: the tiny trace must be past it to run the path a real prompt runs.
MOE_SLOTS = 1024


@dataclasses.dataclass(frozen=True)
class Efficiency:
    """A kernel's matrix throughput as a fraction of PEAK, and its source."""
    value: float
    source: str


# The 16-bit simdgroup-matrix peak of an M3 Ultra (80-core GPU). Apple's GPUs have no 8-bit matrix unit
# (philipturner/metal-benchmarks: "Matrix FFMA8" 0 per core-cycle), so fp8 weights are widened to 16 bits
# before the product: the fp8 rows run at the same peak, at their kernels' efficiency.
PEAK = {
    "bf16": timeline.Constant(16.6e12, 28.4e12, 28.4e12, "FLOP/s",
                              "M3 Ultra 80-core GPU, 28.4 TFLOPS (huggingface/huggingface.js "
                              "packages/tasks/src/hardware.ts, FP32 figures for Apple silicon, PR 1044); F16 at the "
                              "F32 rate from M1 on (philipturner/metal-benchmarks: GOPS16 = GOPS32); bf16 assumed at "
                              "that rate (Apple9 family, native bfloat); low end: bf16 at 0.58x fp16, MLX's prompt "
                              "tokens/s bf16 12.1 against fp16 20.7 on an M2 Ultra (ml-explore/mlx-examples PR 186, "
                              "2024, before native bfloat)"),
    "fp8": timeline.Constant(16.6e12, 28.4e12, 28.4e12, "FLOP/s",
                             "no 8-bit matrix unit (philipturner/metal-benchmarks, Matrix FFMA8 0 a core-cycle): fp8 "
                             "weights are converted and multiplied at the 16-bit rate above"),
}
# In a matrix-multiply kernel an Apple GPU core reaches 102.5 FFMA16 a cycle of its 128 ALUs
# (philipturner/metal-benchmarks, "Matrix FFMA16", A15/M1 on): the most any kernel's efficiency can be.
MATRIX_CEILING = 102.5 / 128
_MLX_STEEL = 17.4e12 / 28.4e12  # MLX's measured fp16 matmul on an 80-core M3 Ultra (raullenchai/Rapid-MLX PR 258)
_MPS_VS_MLX = 3.38 / 4.96       # torch MPS matmul time vs MLX's, M3 Ultra (TristanBilot/mlx-benchmark PR 40)
_TORCH_MATMUL = Efficiency(
    _MLX_STEEL * _MPS_VS_MLX,
    f"torch's MPS matmul (MPSGraph): MLX's steel GEMM measured 17.4 TFLOPS fp16 on an 80-core M3 Ultra "
    f"(raullenchai/Rapid-MLX PR 258: {_MLX_STEEL:.2f} of PEAK), torch MPS's matmul took 4.96 ms against MLX's 3.38 on "
    f"an M3 Ultra (TristanBilot/mlx-benchmark PR 40): {_MLX_STEEL:.2f} x {_MPS_VS_MLX:.2f}")


# mps_ext's chunked delta rule (linear_attention.metal: linear_attention_chunk_prep and _state), its products on
# float32 simdgroup matrices (issue 32 point 3; before them, float32 FMAs: 0.089 of the ALUs' peak, counted as
# useful FMAs over executed instructions). Counted on the executor at bench_linear_attention's prefill budget
# case (Qwen3.6's head sizes, 4 value heads, 128 tokens, bf16): the delta rule's FLOPs as layer_flops counts them
# (census.delta_rule_chunk_flops: whole K K^T and Q K^T, the solves; the kernels multiply only the lower blocks
# of the triangular ones) in float32 MMAs' issue slots, over the issue slots of both kernels' dispatches
# (benchmarks.efficiency.figures' useful_slot_fraction: the time the projection's FLOPs take, whatever the
# kernels skip). Carried to the chip as the tiles' figures are (_COUNTED): over MLX's steel float32 GEMM's
# useful share on the executor (the tile MLX picks at `steel_case`), times steel's measured efficiency on the
# Mac. tests/test_budgets.py::test_prefill_delta_rule_figure_is_the_counter recounts both.
@dataclasses.dataclass(frozen=True)
class DeltaRuleCounted:
    case: str  # bench_linear_attention's case id
    ours: float  # the delta rule's FLOPs in MMA slots over both dispatches' issue slots, at the case
    steel_case: str  # bench_scaled_mm's case id of steel's figure ...
    steel: float  # ... its useful MMA share of issue slots


DELTA_RULE_COUNTED = DeltaRuleCounted("prefill Qwen3.6 heads 2+4 bfloat16 tokens=128", 0.489,
                                      "fp8_linear 2048->768 float32 rows=128 row", 0.502)
# One named figure per kernel that does a prefill's matrix work (census.Call.kernels' names, matched by
# prefix, the longest; torch's own ops as "torch <op>"). A counted figure in MEASURED_EFFICIENCY (below) under
# the same or a longer name replaces the assumption (efficiency()).
KERNEL_EFFICIENCY = {
    "torch linear": _TORCH_MATMUL,
    "torch mm": _TORCH_MATMUL,
    "torch addmm": _TORCH_MATMUL,
    "torch bmm": Efficiency(_TORCH_MATMUL.value, "as torch's matmul (the delta rule's per-chunk products are "
                            "64-row batches: no published figure; likely lower)"),
    "torch linalg_solve_triangular": Efficiency(_TORCH_MATMUL.value, "as torch's matmul (assumed; no published "
                                                "figure for MPS's triangular solve)"),
    "torch _grouped_mm": Efficiency(_TORCH_MATMUL.value, "as torch's matmul (2.14's per-expert mm fallback: no "
                                    "published figure; 2.15's own kernel is counted, RELEASE_COUNTED)"),
    "torch _scaled_dot_product_attention_math_for_mps": Efficiency(
        _TORCH_MATMUL.value, "as torch's matmul (assumed; MLX's SDPA reaches 0.88 of its own matmul at 4k on an M3 "
        "Ultra, raullenchai/Rapid-MLX PR 258)"),
    "gmm_tiled": Efficiency(_TORCH_MATMUL.value, "mps_ext's MoE prefill tile, a variant without a counted figure "
                            "(MEASURED_EFFICIENCY): assumed torch's matmul's"),
    "fp8_mm_tile": Efficiency(0.12 * _TORCH_MATMUL.value,
                              "mps_ext's fp8 prefill tile (64 x 64, weights re-read rows/64 times), a variant "
                              "without a counted figure (MEASURED_EFFICIENCY): assumed 0.12 x torch's matmul, what "
                              "torch's own simdgroup fp8 GEMM measured against its bf16 one (pytorch PR 196916)"),
    "gemv": Efficiency(_TORCH_MATMUL.value, "mps_ext's GEMV (the LM head's one row: bandwidth-bound; its FLOPs "
                       "are negligible)"),
    # mps_ext's chunked delta rule: counted (DELTA_RULE_COUNTED above).
    "linear_attention_chunk": Efficiency(
        DELTA_RULE_COUNTED.ours / DELTA_RULE_COUNTED.steel * _MLX_STEEL,
        f"counted: mps_ext's chunked delta rule (float32 simdgroup matrices), the delta rule's FLOPs in MMA issue "
        f"slots over both kernels' slots on the executor at Qwen3.6's head sizes, {DELTA_RULE_COUNTED.ours:.3f}; "
        f"steel float32 32x64x16 (MLX's tile at 128 rows of 2048->768) {DELTA_RULE_COUNTED.steel:.3f}: "
        f"{DELTA_RULE_COUNTED.ours / DELTA_RULE_COUNTED.steel:.2f} x MLX's steel measured {_MLX_STEEL:.2f} of PEAK "
        f"(raullenchai/Rapid-MLX PR 258)"),
    "lu_solve": Efficiency(_TORCH_MATMUL.value, "mps_ext's triangular solve (the linalg family, which takes the "
                           "delta rule's solves on torch 2.14): not counted; assumed torch's matmul's"),
}
# Counted efficiencies (fraction of PEAK) by kernel name, each replacing the kernel's assumption above: the
# executor's counted useful share of issue slots (multiply-accumulates the product needs, DispatchStats.
# matrix_slot_fraction: docs/dev/compute_efficiency.md, benchmarks/efficiency.py) of the tile over MLX's steel
# GEMM's at a prefill's shape, run on the executor from MLX's source, times steel's measured efficiency on the
# Mac (_MLX_STEEL): the executor's ratio carried to the chip by MLX's published figure. Ours is the same at any
# row count (one tile shape); steel's is the tile MLX picks for a prefill's rows.
@dataclasses.dataclass(frozen=True)
class Counted:
    """A tile's counted figure, where it was counted, and steel's beside it.
    tests/test_budgets.py::test_prefill_counted_figures_are_the_counters
    recounts both (benchmarks.efficiency.compare) at the budgets' benchmark
    case, so they cannot drift from the kernels."""

    kernel: str  # the variant counted
    op: str  # its benchmark (benchmarks/bench_<op>.py) ...
    case: str  # ... and case id there
    steel_rows: int | None  # steel's useful share at this many rows of the case's shape; None: all its MMAs' share
    ours: float  # the variant's useful MMA share of issue slots at the case
    steel: float
    what: str


_COUNTED = {  # kernel prefix: its counted figure
    # fp8_linear's prefill with block scales or a bias (16-bit activations with tensor-wise or row-wise scales:
    # gmm_tiled_dense_<t>_e4m3w below)
    "fp8_mm_tile_bf16": Counted("fp8_mm_tile_bf16_vec", "scaled_mm", "fp8_linear 2048->768 bfloat16 rows=128 block",
                                2048, 0.516, 0.514, "fp8_mm_tile_bf16_vec 0.516; steel bf16 64x64x16 (MLX's tile at "
                                "2048 rows) 0.514"),
    "gmm_tiled_bf16": Counted("gmm_tiled_bf16", "grouped_mm", "_grouped_mm bfloat16 bfloat16 rows=128 nk", None,
                              0.447, 0.420, "gmm_tiled_bf16 0.447; steel bf16 64x32x32 with every row used (a "
                              "prompt's experts get 16 rows and more) 0.420"),
    # F.linear / mm / addmm past 8 rows in 16 bits (linear.cpp): gmm_tiled with one group, every tile full
    **{f"gmm_tiled_dense_{t}": Counted(f"gmm_tiled_dense_{t}", "linear", f"prefill 2048->768 [N,K] {dtype} rows=128",
                                       2048, ours, 0.514, f"gmm_tiled_dense_{t} {ours:.3f}; steel {t} 64x64x16 "
                                       "(MLX's tile at 2048 rows) 0.514")
       for t, dtype, ours in (("f16", "float16", 0.617), ("bf16", "bfloat16", 0.616))},
    # fp8_linear past 8 rows, 16-bit activations, tensor-wise or row-wise scales (scaled_mm.cpp): the dense tile
    # with e4m3 weights, each decoded once a stage
    **{f"gmm_tiled_dense_{t}_e4m3w": Counted(f"gmm_tiled_dense_{t}_e4m3w", "scaled_mm",
                                             f"fp8_linear 2048->768 {dtype} rows=128 row", 2048, ours, 0.514,
                                             f"gmm_tiled_dense_{t}_e4m3w {ours:.3f}; steel {t} 64x64x16 (MLX's tile "
                                             "at 2048 rows) 0.514")
       for t, dtype, ours in (("f16", "float16", 0.593), ("bf16", "bfloat16", 0.593))},
    "gmm_tiled_e4m3": Counted("gmm_tiled_e4m3", "grouped_mm", "_scaled_grouped_mm fp8 float8_e4m3fn rows=128 nk",
                              None, 0.402, 0.420, "gmm_tiled_e4m3 0.402; steel bf16 64x32x32 with every row used "
                              "0.420"),
}
MEASURED_EFFICIENCY: dict[str, float] = {k: c.ours / c.steel * _MLX_STEEL for k, c in _COUNTED.items()}


# A release's own kernel for a torch op, counted on the executor from the release's source (benchmarks/
# release_gemm.py: torch 2.15's _grouped_mm_mps simdgroup tile, launched as GroupedMM.mm launches it), carried to
# the chip as the tiles' figures are: its useful MMA share over steel's at the same shape, times steel's measured
# efficiency. kernels_of names the op "torch <op> (<release>)" on that release; other releases keep the op's
# KERNEL_EFFICIENCY assumption (2.14's _grouped_mm: the per-expert mm fallback, MPSGraph's mm).
# tests/test_release_gemm.py::test_the_prefill_figure_is_the_counter recounts both figures.
@dataclasses.dataclass(frozen=True)
class ReleaseCounted:
    release: str  # census.RELEASES' name
    op: str  # the aten op
    kernel: str  # the release's kernel counted
    shape: str  # where (release_gemm.BUDGET_CASE: the grouped_mm budget case gmm_tiled_bf16 is counted at)
    torch: float  # its useful MMA share of issue slots, every threadgroup the host launches included
    steel: float  # steel's MMA share with every row used, as _COUNTED["gmm_tiled_bf16"]'s

    @property
    def name(self) -> str:
        return f"torch {self.op} ({self.release})"


RELEASE_COUNTED = {c.name: c for c in (
    ReleaseCounted("2.15", "_grouped_mm", "grouped_mm_rows_bfloat_bm16_u32",
                   "8 experts x 16 rows, 768->2048 (256 sampled columns), weights [E, N, K] transposed, bf16",
                   0.298, 0.420),
)}
for _c in RELEASE_COUNTED.values():
    MEASURED_EFFICIENCY[_c.name] = _c.torch / _c.steel * _MLX_STEEL
# torch's CPU SDPA stands in for the Mac's in a trace on CPU: costed as torch's MPS SDPA.
_SDPA_ON_MAC = "torch _scaled_dot_product_attention_math_for_mps"


def efficiency(kernel: str) -> tuple[float, str]:
    """(fraction of PEAK, source) of `kernel`: the counted figure if there
    is one, else the assumption of KERNEL_EFFICIENCY; capped at
    MATRIX_CEILING."""
    if kernel in MEASURED_EFFICIENCY:
        c, r = _COUNTED.get(kernel), RELEASE_COUNTED.get(kernel)
        source = "counted (executor simdgroup-matrix counter)"
        if c is not None:
            source = (f"counted: useful MMA share of issue slots on the executor, {c.what}: {c.ours / c.steel:.2f} "
                      f"x MLX's steel measured {_MLX_STEEL:.2f} of PEAK (raullenchai/Rapid-MLX PR 258)")
        elif r is not None:
            source = (f"counted: torch {r.release}'s own {r.kernel} (GroupedMM.metal, run on the executor as "
                      f"GroupedMM.mm launches it, benchmarks/release_gemm.py) at {r.shape}, useful MMA share of "
                      f"issue slots {r.torch:.3f}; steel bf16 64x32x32 with every row used {r.steel:.3f}: "
                      f"{r.torch / r.steel:.2f} x MLX's steel measured {_MLX_STEEL:.2f} of PEAK "
                      f"(raullenchai/Rapid-MLX PR 258)")
        return min(MEASURED_EFFICIENCY[kernel], MATRIX_CEILING), source
    if kernel not in KERNEL_EFFICIENCY:
        raise KeyError(f"no efficiency for kernel {kernel!r}: add it to benchmarks/prefill.py KERNEL_EFFICIENCY "
                       f"(with its source) or MEASURED_EFFICIENCY")
    e = KERNEL_EFFICIENCY[kernel]
    return min(e.value, MATRIX_CEILING), e.source


# ----------------------------------------------------------------- lengths --
def chunks(length: int) -> int:
    """Chunks of the delta rule over a prompt of `length` (padded to whole chunks)."""
    return -(-length // CHUNK)


def trace_lengths(config) -> tuple[int, int]:
    """Two prompt lengths for the tiny trace: whole chunks, consecutive,
    the first past MOE_SLOTS token slots (top_k slots a token; a shared
    expert's adds to mps_ext's count, so this is past both)."""
    top_k = config.num_experts_per_tok
    first = (MOE_SLOTS // top_k) // CHUNK + 1
    return first * CHUNK, (first + 1) * CHUNK


# ------------------------------------------------------------------- FLOPs --
def _ffn_parts(c, ffn: str) -> tuple[list, list]:
    """(routed matrices, other matrices) of a feed-forward block as
    (rows, columns, per token): the routed experts' gate/up and down, top_k a
    token; the dense MLP, or a shared expert and its gate, and the router."""
    if ffn == "dense":
        return [], census._ffn_weights(c, "dense", 0)[0]
    matrices = census._ffn_weights(c, "moe", c.num_experts_per_tok)[0]
    # _ffn_weights lists the routed experts' two slices first, then the shared expert's matrices
    return matrices[:2], matrices[2:] + [(c.num_experts, c.hidden_size, 1)]


def _mixer_matrices(c, mixer: str) -> list:
    return {"full_attention": census._attn_weights, "linear_attention": census._deltanet_weights,
            "conv": census._conv_weights}[mixer](c)[0]


def _product_flops(matrices: list, rows: int) -> int:
    return sum(2 * rows * n * r * k for r, k, n in matrices)


def layer_flops(config, kind: str, length: int) -> dict[str, int]:
    """Matrix FLOPs of one layer of `kind` ('mixer+ffn') over a prompt of
    `length`, by part: 'projections' (the mixer's), 'attention' or 'delta
    rule', 'ffn projections' (dense MLP, shared expert, router), 'experts'."""
    c = config
    mixer, ffn = kind.split("+")
    out = {"projections": _product_flops(_mixer_matrices(c, mixer), length)}
    if mixer == "full_attention":
        hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        out["attention"] = 2 * c.num_attention_heads * (length * (length + 1) // 2) * 2 * hd  # QK^T and PV
    elif mixer == "linear_attention":
        per_chunk = census.delta_rule_chunk_flops(c.linear_key_head_dim, c.linear_value_head_dim, CHUNK)
        out["delta rule"] = c.linear_num_value_heads * chunks(length) * per_chunk
    routed, other = _ffn_parts(c, ffn)
    out["ffn projections"] = _product_flops(other, length)
    if routed:
        out["experts"] = _product_flops(routed, length)
    return out


def head_flops(config) -> dict[str, int]:
    """The LM head on the last position (generate's logits_to_keep=1)."""
    return {"head": 2 * config.vocab_size * config.hidden_size}


def model_flops(config, length: int) -> int:
    return (sum(sum(layer_flops(config, k, length).values()) for k in census.layer_kinds(config))
            + sum(head_flops(config).values()))


# ------------------------------------------------------------------- bytes --
def layer_bytes(config, kind: str, length: int, fp8: bool = False, dtype_bytes: int = 2, state_bytes: int = 4) -> dict:
    """Bytes one layer of `kind` moves in a prefill of `length` (a lower
    bound: the module docstring): 'weights' (census.layer_bytes' weights for
    the experts `length` tokens choose), 'activations' (each product's input
    and output rows, attention's Q, K, V and output, the DeltaNet's q, k, v
    and output), 'cache' (the KV cache written; the DeltaNet's fp32 state
    read and written once a chunk)."""
    c = config
    mixer, ffn = kind.split("+")
    weights = census.layer_bytes(c, kind, length, 0, fp8)["weights"]
    routed, other = _ffn_parts(c, ffn)
    rows = sum(n * (r + k) for r, k, n in _mixer_matrices(c, mixer) + routed + other)
    acts = length * rows * dtype_bytes
    cache = 0
    if mixer == "full_attention":
        hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        acts += length * (2 * c.num_attention_heads + 2 * c.num_key_value_heads) * hd * dtype_bytes
        cache = length * 2 * c.num_key_value_heads * hd * dtype_bytes
    elif mixer == "linear_attention":
        kd, vd = c.linear_num_key_heads * c.linear_key_head_dim, c.linear_num_value_heads * c.linear_value_head_dim
        acts += length * (2 * kd + 2 * vd) * dtype_bytes
        cache = chunks(length) * 2 * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim \
            * state_bytes
    out = {"weights": weights, "activations": acts, "cache": cache}
    out["total"] = sum(out.values())
    return out


def head_bytes(config, length: int) -> float:
    """The embedding rows of the prompt, the final norm and the LM head
    (census.head_bytes)."""
    return sum(census.head_bytes(config, length).values())


def model_bytes(config, length: int, fp8: bool = False) -> dict:
    out = collections.Counter()
    for kind in census.layer_kinds(config):
        out.update(layer_bytes(config, kind, length, fp8))
    out["weights"] += head_bytes(config, length)
    out["total"] += head_bytes(config, length)
    return dict(out)


# ------------------------------------------------------------------ counts --
def scale_counts(spec: census.Spec, traces: dict[int, census.Trace], tiny_config, length: int, release: str,
                 ours: bool) -> dict:
    """census.scale's counts (eager) at a prompt of `length`, from the tiny
    prefill traced at the two lengths of `traces` ({length: trace}): per
    layer kind and for the whole model, base + per chunk x chunks(length),
    the per-chunk part the difference of the two traces over their
    chunks'. 'per_chunk': that difference per layer kind (calls that grow
    with the prompt)."""
    (l1, t1), (l2, t2) = sorted(traces.items())
    if chunks(l2) == chunks(l1):
        raise ValueError(f"the traced lengths {l1} and {l2} have the same number of chunks of {CHUNK}")
    a = census.scale(spec, t1, tiny_config, length, release, "eager", ours)
    b = census.scale(spec, t2, tiny_config, length, release, "eager", ours)
    steps = chunks(l2) - chunks(l1)

    def at(x: census.Counts, y: census.Counts) -> tuple[census.Counts, census.Counts]:
        per = (y + x * -1) * (1 / steps)
        return x + per * (chunks(length) - chunks(l1)), per
    per_kind, per_chunk = {}, {}
    for k in a["per_kind"]:
        per_kind[k], per_chunk[k] = at(a["per_kind"][k], b["per_kind"][k])
    total, _ = at(a["total"], b["total"])
    return {"per_kind": per_kind, "per_chunk": per_chunk, "layers": a["layers"], "total": total}


_PROJECTION_OPS = {"linear", "fp8_linear", "mm", "addmm"}
_EXPERT_OPS = {"_grouped_mm", "fp8_grouped_linear", "moe_experts", "moe_layer"}


def part_of(call: census.Call) -> str | None:
    """The part of layer_flops (or 'head') whose matrix work a traced call
    does; None for a call without matrix work."""
    if call.layer is None:
        return "head" if call.op in _PROJECTION_OPS else None
    if call.ffn:
        if call.op in _EXPERT_OPS:
            return "experts"
        return "ffn projections" if call.op in _PROJECTION_OPS else None
    if call.op.startswith("_scaled_dot_product"):
        return "attention"
    if call.op in ("bmm", "linalg_solve_triangular", "linear_attention_chunk"):
        return "delta rule"
    return "projections" if call.op in _PROJECTION_OPS else None


def kernels_of(call: census.Call, release: str | None = None) -> list[str]:
    """The KERNEL_EFFICIENCY names of what a call runs: mps_ext's executor
    kernels by their family's prefix, else torch's op (its CPU SDPA as the
    Mac's; on `release`, the release's own kernel if RELEASE_COUNTED has
    it)."""
    if call.ours:
        out = []
        for name in call.kernels:
            match = [k for k in (*KERNEL_EFFICIENCY, *MEASURED_EFFICIENCY) if name.startswith(k)]
            out.append(max(match, key=len) if match else name)
        return out
    if call.op.startswith("_scaled_dot_product"):
        return [_SDPA_ON_MAC]
    own = f"torch {call.op} ({release})"
    return [own if own in RELEASE_COUNTED else f"torch {call.op}"]


def part_kernels(calls: list[census.Call], release: str | None = None) -> dict[str, str]:
    """{part: the kernel that runs it}: of the calls of one layer kind (or
    'pre'/'post'), the least efficient kernel among each part's calls (a
    part of several kernels, such as fp8 projections beside the router left
    in bf16, is costed at its slowest)."""
    found = collections.defaultdict(set)
    for call in calls:
        part = part_of(call)
        if part is not None:
            found[part].update(kernels_of(call, release))
    return {part: min(ks, key=lambda k: efficiency(k)[0]) for part, ks in found.items()}


# -------------------------------------------------------------- projection --
@dataclasses.dataclass
class Projection:
    flops: float
    bytes: float
    compute_s: float     # FLOPs at PEAK x each part's kernel efficiency
    limit_s: float       # FLOPs at PEAK: the compute limit
    bytes_s: float
    dispatch_s: float
    host_s: float
    kernels: dict        # part -> kernel, over the model's layer kinds

    @property
    def gpu_s(self) -> float:
        return max(self.compute_s, self.bytes_s) + self.dispatch_s

    @property
    def ttft_s(self) -> float:
        return self.gpu_s + self.host_s

    @property
    def bound(self) -> str:
        parts = {"compute": self.compute_s, "bytes": self.bytes_s, "dispatches": self.dispatch_s,
                 "host": self.host_s}
        return max(parts, key=parts.get)


def project(spec: census.Spec, counts: dict, calls: dict, length: int, fp8: bool, which: str = "central",
            release: str | None = None) -> Projection:
    """Time to first token of a prompt of `length`: `counts` from
    scale_counts, `calls` the traced calls per layer kind (census.layer_calls)
    whose kernels cost each part of the FLOPs (torch's ops as `release`
    runs them, kernels_of)."""
    real = spec.config()
    k = timeline.costs(which)
    peak = getattr(PEAK["fp8" if fp8 else "bf16"], which)
    compute = limit = flops = 0.0
    used = {}
    for kind, n in collections.Counter(census.layer_kinds(real)).items():
        kernels = part_kernels(calls[kind], release)
        for part, f in layer_flops(real, kind, length).items():
            kernel = kernels.get(part)
            if kernel is None:
                raise ValueError(f"{spec.name} {kind}: the trace has no call doing its {part!r}")
            used[part] = kernel
            compute += n * f / (peak * efficiency(kernel)[0])
            limit += n * f / peak
            flops += n * f
    head = part_kernels(calls["post"], release).get("head")
    f = sum(head_flops(real).values())
    used["head"] = head
    compute += f / (peak * efficiency(head)[0])
    limit += f / peak
    flops += f
    b = model_bytes(real, length, fp8)["total"]
    t = counts["total"]
    host = t.host * k["host"] + t.views * k["view"] + t.syncs * k["round_trip"] + t.empty * k["empty_group"] \
        + t.commits * k["commit"]
    return Projection(flops, b, compute, limit, b / k["bandwidth"], t.dispatches * k["dispatch"], host, used)


def ttft_range(spec, counts, calls, length, fp8, release: str | None = None) -> tuple[float, float, float]:
    """TTFT (s) with every constant at its fast end, central, and slow end."""
    return tuple(project(spec, counts, calls, length, fp8, w, release).ttft_s for w in ("high", "central", "low"))


def constants_text() -> str:
    """Every constant of the projection with its source."""
    lines = [f"- peak ({dtype}): {k.low / 1e12:g}-{k.high / 1e12:g} TFLOPS, central {k.central / 1e12:g} ({k.source})"
             for dtype, k in PEAK.items()]
    lines.append(f"- matrix ceiling: {MATRIX_CEILING:.2f} of peak, the most any kernel reaches (philipturner/"
                 f"metal-benchmarks: 102.5 FFMA16 a core-cycle inside a matrix multiplication, of 128)")
    for name in (*KERNEL_EFFICIENCY, *RELEASE_COUNTED):
        value, source = efficiency(name)
        lines.append(f"- efficiency of {name}: {value:.3f} of peak ({source})")
    lines.append(f"- delta rule chunk: {CHUNK} tokens (transformers' torch_chunk_gated_delta_rule, and mps_ext's "
                 f"linear_attention_chunk); mps_ext's MoE "
                 f"decode kernels up to {MOE_SLOTS} token slots (mps_ext/passes/moe.py, mps_ext/fp8.py)")
    lines.append("- bandwidth, dispatch, host, view, round_trip, empty_group, commit: as benchmarks/timeline.py's "
                 "(decode's constants, below)")
    return "\n".join(lines)



# -------------------------------------------------------------- first call --
# The first prompt of a process also compiles each of mps_ext's kernel variants it runs: the Metal backend builds
# a variant on its first call (csrc/backend/metal.mm, newLibraryWithSource of the library's code with that
# variant's instantiation alone; docs/dev/first_call.md). Apart from the warm TTFT above: a term of its own.
COMPILE_PER_FUNCTION = timeline.Constant(
    0.026, 0.045, 0.070, "s",
    "Metal compile of one function from source, on its first use: 26 ms, an MLX mx.fast.metal_kernel's first call "
    "(26.02 ms against 0.38 ms warm, rajveer43/VeloxQuant-MLX issue 507); about 70 ms a newLibrary of one shader "
    "variant on the render path, 84 variants in 3.8 s (45 ms each) compiled in the background (Apple silicon, "
    "Kenix3/libultraship PR 1145). Cold: macOS keeps compiled shaders in a per-app cache, so a relaunch may find "
    "them (the same PR; deepspeedai/DeepSpeed PR 8300), which the system may purge without notice (Blender's "
    "Metal ShaderCache commit)")


def functions_run(trace: census.Trace) -> set[str]:
    """The kernel variants of mps_ext's that a traced forward ran."""
    return {k for call in trace.calls if call.ours for k in call.kernels}


def library_sizes() -> dict[str, tuple[str, int]]:
    """Kernel variant -> (its library, the library's variant count): what a
    first call compiled when a library compiled whole."""
    from tools import shader_variants
    from tools.embed_shaders import sources
    out = {}
    for name, text in sources().items():
        kernels = [k for site in shader_variants.sites(text + "\n") for k in site.kernels]
        out.update({k: (name, len(kernels)) for k in kernels})
    return out


def whole_library_functions(functions: set[str]) -> int:
    """The variants compiled if each library `functions` use compiled whole."""
    sizes = library_sizes()
    return sum(dict(sizes[f] for f in functions).values())


def compile_s(functions: int, which: str = "central") -> float:
    """Seconds to compile `functions` variants; `which` as timeline.costs
    ('low' the slow end, 'high' the fast end)."""
    k = COMPILE_PER_FUNCTION
    return functions * {"central": k.central, "low": k.high, "high": k.low}[which]
