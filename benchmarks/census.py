"""What one decoded token costs, counted from real model code.

A transformers 5 model is built in a tiny configuration that keeps the real
model's layer structure (its mixer types in their order, dense and MoE
layers, shared experts, the real expert count and top-k); a context is
prefilled with plain torch, and one decode step of `tokens` sequences (a
batch, one new token each) runs under a TorchDispatchMode that records every
aten call, the decoder layer it belongs to, and its tensors' sizes. With
mps_ext the step also runs under `mps_ext_executor.run_model`, which sends
what mps_ext takes on a Mac with that torch release to its kernels on the
CPU Metal executor: their dispatches are counted, not assumed.

From the trace, per call (the rules, stated once here):
- host call: an aten call that reaches a backend kernel. Views and metadata
  (is_view ops, empty*, detach, ...) are listed apart and not costed: they
  run no MPS kernel. F.linear is one call, as on a Mac (aten::linear has an
  MPS kernel there; on CPU it would decompose into t and mm).
- projections that read one input, fused by mps_ext.optimize
  (mps_ext/passes/projections.py): the one linear call of the concatenated
  weight (one host call, one GEMV dispatch); its split into the members'
  outputs is views, and the members served from it make no call.
- sync: a call that waits for the GPU (.item(), nonzero, the offs copy of
  torch's _grouped_mm fallback).
- Metal dispatches of torch's kernels: one per host call that writes a
  tensor (an MPSGraph op or a Metal kernel; a graph of several kernels is
  counted as one, so torch's count is a lower bound), except
  aten::_grouped_mm on torch <= 2.14 (no MPS kernel: its fallback copies offs
  to the CPU, a sync, and calls mm once per expert, of which those with rows
  dispatch; mps_ext/_policy.py HISTORY["grouped_mm"]): 1 + experts with rows
  host calls and dispatches, and the empty experts' mm calls apart ("empty":
  they return before encoding anything; not costed, for want of a published
  cost). mps_ext's dispatches are the executor's.
- torch.compile (`mode="compile"`): Inductor generates Metal for pointwise
  ops and reductions only, matmuls go to aten (pytorch PRs 143893, 150541):
  each maximal run of such fusible calls between two extern calls is counted
  as one generated kernel (one host call, one dispatch), and views cost
  nothing. An estimate of Inductor's fusion, not its output.

Scaling to the real model (`scale`): calls and dispatches per layer kind
(mixer x feed-forward) come from the tiny trace; the real model has the
real config's count of layers of each kind. Per-expert calls of torch's
_grouped_mm fallback use the real expert count and the expected number of
distinct experts the batch chooses. Bytes come from the real config's
dimensions (`step_bytes`; bf16, or fp8 as mps_ext.quantize_fp8 leaves the
weights), the same formula that tests/test_benchmarks.py checks against the
tiny model's traced parameter reads and its storage after quantize_fp8.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
from typing import Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

RELEASES = ("2.14", "2.15")
MODES = ("eager", "compile")

# ------------------------------------------------------------------ models --


@dataclasses.dataclass(frozen=True)
class Spec:
    """A model: its transformers classes, the real config's values (and where
    they come from), and the overrides that make it tiny."""
    name: str
    family: str  # transformers config class name
    model: str   # transformers causal-LM class name
    real: dict
    source: str
    tiny: dict
    published: dict = dataclasses.field(default_factory=dict)  # release -> tokens/s (M3 Ultra, bf16, 1 token)

    def config(self, tiny: bool = False):
        import transformers
        kwargs = dict(self.real)
        if tiny:
            kwargs.update(self.tiny)
        kwargs.setdefault("experts_implementation", "grouped_mm")
        return getattr(transformers, self.family)(**kwargs)


_LFM2_8B_LAYERS = ["conv", "conv", "full_attention", "conv", "conv", "conv", "full_attention", "conv", "conv", "conv",
                   "full_attention", "conv", "conv", "conv", "full_attention", "conv", "conv", "conv",
                   "full_attention", "conv", "conv", "full_attention", "conv", "conv"]

MODELS = {
    "Qwen3-30B-A3B": Spec(
        "Qwen3-30B-A3B",
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            vocab_size=151936,
            hidden_size=2048,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            moe_intermediate_size=768,
            intermediate_size=6144,
            norm_topk_prob=True,
            tie_word_embeddings=False,
        ),
        "Qwen/Qwen3-30B-A3B config.json (anchors.md: hidden 2048, 48 layers, 128 experts top-8, FFN 768, "
        "32 q / 4 KV heads of 128, vocab 151936)",
        dict(
            vocab_size=512,
            hidden_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            moe_intermediate_size=16,
            intermediate_size=64,
        ),
    ),
    "Qwen3.6-35B-A3B": Spec(
        "Qwen3.6-35B-A3B",
        "Qwen3_5MoeTextConfig",
        "Qwen3_5MoeForCausalLM",
        dict(
            vocab_size=248320,
            hidden_size=2048,
            num_hidden_layers=40,
            layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 10,
            num_attention_heads=16,
            num_key_value_heads=2,
            head_dim=256,
            linear_num_key_heads=16,
            linear_num_value_heads=32,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_conv_kernel_dim=4,
            num_experts=256,
            num_experts_per_tok=8,
            moe_intermediate_size=512,
            shared_expert_intermediate_size=512,
            tie_word_embeddings=False,
        ),
        "model_type qwen3_5_moe (transformers: Qwen3.6 checkpoints share Qwen3.5's architecture and model_type); "
        "Qwen/Qwen3.6-35B-A3B model card: 40 layers = 10 x (3 Gated DeltaNet + 1 gated attention), DeltaNet 32 V / "
        "16 QK heads of 128, attention 16 q / 2 KV heads of 256, 256 experts top-8 + 1 shared, expert FFN 512, "
        "vocab 248320 (padded)",
        dict(
            vocab_size=512,
            hidden_size=64,
            num_hidden_layers=4,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
        ),
        published={"2.15": 61.3, "2.14": 9.4},
    ),
    "LFM2.5-8B-A1B": Spec(
        "LFM2.5-8B-A1B",
        "Lfm2MoeConfig",
        "Lfm2MoeForCausalLM",
        dict(
            vocab_size=128000,
            hidden_size=2048,
            num_hidden_layers=24,
            layer_types=_LFM2_8B_LAYERS,
            num_attention_heads=32,
            num_key_value_heads=8,
            num_experts=32,
            num_experts_per_tok=4,
            moe_intermediate_size=1792,
            intermediate_size=7168,
            num_dense_layers=2,
            conv_L_cache=3,
            tie_word_embeddings=True,
            use_expert_bias=True,
            norm_topk_prob=True,
        ),
        "model_type lfm2_moe; LiquidAI/LFM2.5-8B-A1B model card: 24 layers (18 double-gated conv + 6 GQA), "
        "vocabulary 128,000 (LFM2-8B-A1B's is 65,536); layer order, heads, experts and FFN widths of the "
        "LFM2-8B-A1B config.json (not checked against LFM2.5's own config.json: not in the stored pages)",
        dict(
            vocab_size=512,
            hidden_size=64,
            num_hidden_layers=4,
            layer_types=["conv", "full_attention", "conv", "full_attention"],
            num_attention_heads=4,
            num_key_value_heads=2,
            moe_intermediate_size=16,
            intermediate_size=64,
        ),
        published={"2.15": 123.6, "2.14": 23.6},
    ),
}


def tiny_model(spec: Spec, dtype=torch.bfloat16, seed: int = 0):
    import transformers
    torch.manual_seed(seed)
    return getattr(transformers, spec.model)(spec.config(tiny=True)).eval().to(dtype)


def layer_kinds(config) -> list[str]:
    """Each decoder layer's kind: 'mixer+ffn' (ffn 'moe' or 'dense')."""
    n = config.num_hidden_layers
    types = list(getattr(config, "layer_types", None) or ["full_attention"] * n)
    if len(types) < n:  # a repeating pattern (Qwen3.6's 3 + 1)
        types = (types * n)[:n]
    dense = getattr(config, "num_dense_layers", 0) or 0
    return [f"{t}+{'dense' if i < dense else 'moe'}" for i, t in enumerate(types[:n])]


# ------------------------------------------------------------------- trace --
_META = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "lift_fresh", "alias",
         "_reshape_alias", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_nonzero",
         "_unsafe_view", "resize_", "set_"}
_SYNC = {"_local_scalar_dense", "nonzero", "item", "equal", "_assert_async"}
# Inductor generates these (with pointwise ops) rather than call aten.
_FUSIBLE = {"sum", "mean", "amax", "amin", "max", "min", "prod", "var", "var_mean", "any", "all", "argmax", "argmin",
            "_softmax", "_log_softmax", "linalg_vector_norm", "norm", "clone", "copy_", "_to_copy", "cat", "index",
            "gather", "embedding", "index_select", "fill_", "zero_", "zeros_like", "ones_like", "full_like", "full",
            "zeros", "ones", "new_zeros", "new_ones", "new_full", "arange", "constant_pad_nd", "slice_scatter",
            "select_scatter", "scalar_tensor", "one_hot", "stack", "repeat", "expand_copy", "masked_fill",
            "index_put_", "index_put", "index_copy", "tril", "triu", "rsub", "pow", "where", "softplus", "silu",
            "sigmoid"}

# mps_ext ops whose modules run torch's ops under torch.compile instead
# (mps_ext.optimize's FusedRMSNorm alone: Inductor fuses a norm with the
# ops around it, where the op would be one dispatch more; its attention's
# qk_norm_rope: Inductor fuses the norms and the rotary embedding with their
# neighbours; its output gate, sigmoid_gate, and its cache append,
# kv_append (or, with the norms and rotary embedding, qk_norm_rope_append),
# for which the compiled forward keeps the model's sigmoid, mul and
# DynamicCache's torch.cat): compiled, each counts as the fusible calls it
# stands for. A decoder layer's fused path (mps_ext.passes.decoder:
# add_rms_norm, the input norm in the projection's GEMV, rms_norm_linear or
# rms_norm_fp8_linear, and the second residual add in moe_layer) runs
# compiled as eager: its neighbours are mps_ext's kernels, with nothing for
# Inductor to fuse it with (tests/models/test_static_cache.py reads the
# compiled graph).
_TORCH_WHEN_COMPILED = {"rms_norm", "qk_norm_rope", "sigmoid_gate", "kv_append", "qk_norm_rope_append"}
# mps_ext's ops that write an attention layer's new key and value rows into
# the cache in place (appends_in_place).
_APPENDS = ("kv_append", "qk_norm_rope_append")


@dataclasses.dataclass
class Call:
    op: str                  # aten name without overload ("mm")
    layer: int | None        # decoder layer index, None outside the layers (embedding, final norm, LM head)
    kind: str                # "compute", "view" or "sync" (see stream for the calls that commit or wait)
    fusible: bool            # Inductor would generate it (see the module docstring)
    read: int                # bytes of the distinct input tensors (a tensor's viewed extent)
    written: int             # bytes of the outputs
    param_read: int          # of `read`, bytes of model parameters (expert banks: the experts with rows)
    groups: int = 0          # _grouped_mm: experts (groups)
    groups_used: int = 0     # _grouped_mm: experts with rows
    ours: int | None = None  # mps_ext dispatches (None: the call ran torch's kernel)
    ours_bytes: int = 0
    ffn: bool = False        # made inside its layer's feed-forward block (the MoE block of a MoE layer)
    # What the call does to the MPS stream besides encoding (STREAM_ACTIONS): "commit" (its command buffer
    # is committed, nothing waits: mps_ext's commit op, an asynchronous copy to the host, an event record),
    # "wait_previous" (the host waits for an event the previous step recorded: transformers'
    # DeferredStopCheck); "" for neither. A sync commits and waits for everything (kind "sync").
    stream: str = ""
    keys: int = 0            # attention (SDPA): the key length it was traced at
    # Bytes that grow with the real model: "vocab" (a logits row: generate's loop), "context" (input ids
    # and attention mask: the loop's concatenations), "" (neither; the forward's are from layer_bytes).
    size: str = ""
    queries: int = 0         # attention (SDPA): the query rows it was traced at
    flops: int = 0           # matrix FLOPs of the call (matrix_flops; torch's ops only)
    kernels: dict = dataclasses.field(default_factory=dict)  # mps_ext: executor kernel -> its dispatches


STREAM_ACTIONS = ("", "commit", "wait_previous")


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


def _extent(t: torch.Tensor) -> int:
    """Bytes a kernel reads of `t`: its elements as viewed (a broadcast
    dimension of stride 0 counts once)."""
    if t.numel() == 0:
        return 0
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size()


def _argument(func, args, kwargs, name: str, default=None):
    """The argument `name` of an aten call, passed by position or keyword."""
    for i, a in enumerate(func._schema.arguments):
        if a.name == name:
            return args[i] if i < len(args) else kwargs.get(name, default)
    return default


def _attended_pairs(func, args, kwargs) -> int:
    """Query-key pairs an SDPA call computes: those its mask lets through
    (a boolean mask's True entries, a float mask's finite ones), the causal
    triangle with is_causal (aligned to the last key, as torch's causal
    mask is), else every pair."""
    q, k = args[0], args[1]
    lq, lk = q.shape[-2], k.shape[-2]
    mask = _argument(func, args, kwargs, "attn_mask")
    if mask is not None:
        allowed = mask if mask.dtype == torch.bool else torch.isfinite(mask)
        per_head = int(allowed.expand(*q.shape[:-2], lq, lk).sum())
        return per_head // max(1, q.shape[:-2].numel())
    if _argument(func, args, kwargs, "is_causal", False):
        return sum(min(lk, lk - lq + i + 1) for i in range(lq))
    return lq * lk


def matrix_flops(func, args, kwargs) -> int:
    """FLOPs (a multiply-add is 2) of a call whose work is matrix
    products, what simdgroup-matrix units run on a Mac: linear (and
    rms_norm_linear's and sigmoid_gate_linear's), mm, addmm,
    bmm, baddbmm, _grouped_mm (its rows), SDPA (QK^T and PV over the pairs
    it attends, _attended_pairs) and a unitriangular solve (C(C-1) per
    right-hand column), and mps_ext's chunked delta rule
    (linear_attention_chunk: what transformers' reference multiplies for the
    same call, per value head and chunk of 64 as prefill.layer_flops
    counts it); 0 for any other call (pointwise ops, reductions,
    depthwise convolutions: bandwidth work, in the bytes)."""
    name = func._schema.name.split("::")[1]
    if name in ("linear", "rms_norm_linear", "sigmoid_gate_linear"):
        # (rms_norm_linear: the norm, then F.linear of its weight, args[4]; sigmoid_gate_linear: the output
        # gate, then F.linear of args[2])
        x, w = args[0], args[{"linear": 1, "rms_norm_linear": 4, "sigmoid_gate_linear": 2}[name]]
        return 2 * x.numel() // x.shape[-1] * w.shape[0] * w.shape[1]
    if name in ("mm", "bmm"):
        a, b = args[0], args[1]
        return 2 * a.numel() * b.shape[-1]
    if name in ("addmm", "baddbmm"):
        a, b = args[1], args[2]
        return 2 * a.numel() * b.shape[-1]
    if name == "_grouped_mm":
        a, b = args[0], args[1]
        return 2 * a.shape[0] * a.shape[-1] * b.shape[-1]
    if name.startswith("_scaled_dot_product"):
        q, v = args[0], args[2]
        heads = q.shape[:-2].numel()
        return 2 * heads * _attended_pairs(func, args, kwargs) * (q.shape[-1] + v.shape[-1])
    if name == "linalg_solve_triangular":
        a, b = args[0], args[1]
        c = a.shape[-1]
        return b.numel() // c * c * (c - 1)
    if name == "linear_attention_chunk":
        q, v = args[0], args[2]
        batch, tokens, _, dk = q.shape
        return batch * v.shape[2] * -(-tokens // DELTA_CHUNK) * delta_rule_chunk_flops(dk, v.shape[3])
    return 0


# transformers' torch_chunk_gated_delta_rule(chunk_size=64), the default the Qwen3.5/3.6 models call it with,
# and mps_ext's linear_attention_chunk's LA_CHUNK.
DELTA_CHUNK = 64


def delta_rule_chunk_flops(dk: int, dv: int, c: int = DELTA_CHUNK) -> int:
    """Matrix FLOPs of the chunked delta rule per value head and chunk of c,
    as transformers' reference computes it: K_beta K^T and Q K^T (2 c^2 dk
    each), two unitriangular solves (c (c - 1) (dk + dv)), the state pass
    (2 c dk dv three times, 2 c^2 dv)."""
    return 4 * c * c * dk + c * (c - 1) * (dk + dv) + 3 * 2 * c * dk * dv + 2 * c * c * dv


class _Tracer(TorchDispatchMode):
    def __init__(self, trace: "Trace", params: dict, counters: Callable[[], tuple[int, int]] | None):
        super().__init__()
        self.trace, self.params, self.counters = trace, params, counters

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        before = self.counters() if self.counters else None
        out = func(*args, **kwargs)
        self.trace.record(func, args, kwargs, out, self.params, before, self.counters)
        return out


class _OneLinear(TorchFunctionMode):
    """F.linear as one aten::linear call (on a Mac it has an MPS kernel; on
    CPU it is a composite that decomposes before a dispatch mode sees it):
    recorded here, then run with the tracer paused. Under run_model its own
    function mode (entered inside this one) turns it into mps_ext.linear
    first, and the tracer sees that call instead."""

    def __init__(self, tracer: _Tracer):
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.nn.functional.linear:
            return func(*args, **kwargs)
        with torch.utils._python_dispatch._disable_current_modes():
            out = func(*args, **kwargs)
        self.tracer.trace.record(torch.ops.aten.linear.default, args, kwargs, out, self.tracer.params, None, None)
        return out


@dataclasses.dataclass
class Trace:
    calls: list[Call] = dataclasses.field(default_factory=list)
    layer: int | None = None
    ffn: bool = False

    def record(self, func, args, kwargs, out, params, before, counters):
        name = func._schema.name.split("::")[1]
        ins = {id(t): t for t in _tensors((args, kwargs))}
        read = sum(_extent(t) for t in ins.values())
        param_read = sum(_extent(t) for t in ins.values() if t.untyped_storage().data_ptr() in params)
        written = sum(_extent(t) for t in _tensors(out))
        if func.is_view or name in _META or name in ("view", "t", "transpose", "permute", "expand", "unsqueeze",
                                                        "squeeze", "slice", "select", "split", "chunk",
                                                        "unbind", "as_strided", "split_with_sizes"):
            kind = "view"
        elif name in _SYNC:
            kind = "sync"
        else:
            kind = "compute"
        if func.namespace == "aten" and name.endswith("_") and name[:-1] in _FUSIBLE:
            name_f = name[:-1]
        else:
            name_f = name
        fusible = kind == "compute" and (name_f in _FUSIBLE or name in _TORCH_WHEN_COMPILED
                                         or torch.Tag.pointwise in func.tags)
        if kind == "view":
            param_read = 0  # a view reads nothing; the call that uses it does
        if name == "embedding":  # reads the rows of its indices
            param_read = args[1].numel() * args[0].shape[-1] * args[0].element_size()
            read = param_read + _extent(args[1])
        call = Call(name, self.layer, kind, fusible, read, written, param_read, ffn=self.ffn)
        if name == "commit" and func.namespace == "mps_ext":  # mps_ext/stream.py's commit point
            call.stream = "commit"
        if name.startswith("_scaled_dot_product"):
            call.keys, call.queries = args[1].shape[-2], args[0].shape[-2]
        call.flops = matrix_flops(func, args, kwargs)
        if name == "add_rms_norm_moe_layer":
            # The MoE block's work, called by the decoder layer on the block's behalf (the layer's
            # residual add and post-attention norm in its router's dispatch): the block's calls.
            call.ffn = True
        if name == "_grouped_mm":
            a, b, offs = args[0], args[1], args[2] if len(args) > 2 else kwargs.get("offs")
            counts = torch.diff(offs.long(), prepend=offs.new_zeros(1).long())
            call.groups, call.groups_used = b.shape[0], int((counts > 0).sum())
            call.param_read = _extent(b) // b.shape[0] * call.groups_used
            call.read = _extent(a) + _extent(offs) + call.param_read
        if before is not None:
            after = counters()
            if after[0] > before[0]:
                call.ours, call.ours_bytes = after[0] - before[0], after[1] - before[1]
                call.kernels = dict(after[2] - before[2])
        self.calls.append(call)


def _layer_hooks(model, trace: Trace):
    handles = []
    for i, layer in enumerate(model.model.layers):
        handles.append(layer.register_forward_pre_hook(lambda m, a, i=i: setattr(trace, "layer", i)))
        handles.append(layer.register_forward_hook(lambda m, a, o: setattr(trace, "layer", None)))
        ffn = feed_forward(layer)
        handles.append(ffn.register_forward_pre_hook(lambda m, a: setattr(trace, "ffn", True)))
        handles.append(ffn.register_forward_hook(lambda m, a, o: setattr(trace, "ffn", False)))
    return handles


def feed_forward(layer):
    """A decoder layer's feed-forward block (a dense MLP, or the MoE block:
    router, experts, shared expert; the block mps_ext.optimize puts on moe_layer after it):
    transformers names it `mlp` (Qwen3-MoE, Qwen3.5-MoE) or `feed_forward`
    (LFM2-MoE)."""
    for name in ("mlp", "feed_forward"):
        if isinstance(getattr(layer, name, None), torch.nn.Module):
            return getattr(layer, name)
    raise ValueError(f"{type(layer).__name__} has neither an `mlp` nor a `feed_forward` block: the census cannot "
                     "tell its feed-forward calls apart")


def _executor_counters(report):
    """A callable: (executor dispatches, their bytes, dispatches per kernel)
    run_model's report has counted so far."""
    def counters():
        fams = report.families.values()
        kernels = collections.Counter()
        for f in fams:
            kernels.update(f.kernels)
        return sum(f.dispatches for f in fams) + report.other_dispatches, sum(f.bytes for f in fams), kernels
    return counters


# The KV caches a step can run with: transformers' DynamicCache (grows by
# torch.cat, or in place by mps_ext.optimize's kv_append, eager) and its
# StaticCache (cache_implementation="static": buffers of max_cache_len
# positions allocated at the prefill, the new rows written in place by
# index_copy_, and attention reading all max_cache_len positions under a
# mask). Compiled, only the static cache writes in place: Inductor keeps
# index_copy_ into the static buffers in place (tests/models/test_static_cache.py
# reads its generated code), where DynamicCache's torch.cat copies the cache.
CACHES = ("dynamic", "static")
# Positions a static cache holds past the step's context. transformers
# sizes it prompt + max_new_tokens; assumed: the counted step is 256 tokens
# before the end of the reply it was sized for (attention reads those
# positions too, masked).
STATIC_HEADROOM = 256


def attention_keys(context: int, cache: str = "dynamic") -> int:
    """Keys attention reads in a decode step at `context`: the cache and the
    new row (dynamic), or every position of a static cache (context +
    STATIC_HEADROOM)."""
    if cache not in CACHES:
        raise ValueError(f"cache must be one of {CACHES}, not {cache!r}")
    return context + 1 if cache == "dynamic" else context + STATIC_HEADROOM


def trace_step(model, tokens: int = 1, context: int = 8, torch_release: str | None = None,
               transform: Callable | None = None, seed: int = 0, cache: str = "dynamic") -> Trace:
    """One decode step of `tokens` sequences after a prefill of `context`
    tokens each: every aten call with its layer. With `torch_release`, the
    step runs under mps_ext's run_model with that release's policy, and each
    call's mps_ext dispatches are recorded. `transform(model)` (e.g. a future
    mps_ext.optimize) is applied before the prefill; it returns the model to
    run (or None: changed in place). `cache`: one of CACHES (static: a
    StaticCache of attention_keys(context, "static") positions)."""
    attention_keys(context, cache)  # checks `cache`

    def prepare(model, g):
        # The prefill too under run_model: the cache the step finds is the one mps_ext's path left (its KV
        # cache buffers, mps_ext/passes/attention.py), as on a Mac, not the one torch's CPU ops would.
        vocab = model.config.vocab_size
        ids = torch.randint(1, vocab, (tokens, context), generator=g)
        step = torch.randint(1, vocab, (tokens, 1), generator=g)
        past = None
        if cache == "static":
            from transformers.cache_utils import StaticCache
            past = StaticCache(config=model.config, max_cache_len=attention_keys(context, cache))
        past = model(ids, past_key_values=past, use_cache=True).past_key_values
        return dict(input_ids=step, past_key_values=past, use_cache=True)
    return _trace_forward(model, prepare, torch_release, transform, seed)


def trace_prefill(model, length: int, torch_release: str | None = None, transform: Callable | None = None,
                  seed: int = 0) -> Trace:
    """The prefill of one prompt of `length` tokens, as `model.generate`
    runs it: one forward with a new cache and logits of the last position
    only (transformers' generate sets `model_kwargs["logits_to_keep"] = 1`
    for a model that takes it, generation/utils.py). Traced as trace_step
    traces a decode step (the same arguments)."""
    def prepare(model, g):
        ids = torch.randint(1, model.config.vocab_size, (1, length), generator=g)
        return dict(input_ids=ids, use_cache=True, logits_to_keep=1)
    return _trace_forward(model, prepare, torch_release, transform, seed)


def _trace_forward(model, prepare: Callable, torch_release: str | None, transform: Callable | None,
                   seed: int) -> Trace:
    """The forward `model(**prepare(model, generator))` traced: prepare runs
    first, untraced (under run_model too, with `torch_release`)."""
    if transform is not None:
        model = copy.deepcopy(model)  # the caller's model stays as it was
        model = transform(model) or model
    g = torch.Generator().manual_seed(seed)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    trace = Trace()
    with torch.no_grad(), contextlib.ExitStack() as stack:
        counters = None
        if torch_release is not None:
            import mps_ext_executor as cpu_metal
            counters = _executor_counters(stack.enter_context(cpu_metal.run_model(torch_release=torch_release)))
        inputs = prepare(model, g)
        handles = _layer_hooks(model, trace)
        try:
            with contextlib.ExitStack() as traced:
                tracer = _Tracer(trace, params, counters)
                # run_model's modes are entered first so that the tracer (the
                # innermost dispatch mode) sees the model's aten calls before
                # run_model reroutes them.
                if torch_release is None:
                    traced.enter_context(_OneLinear(tracer))
                traced.enter_context(tracer)
                model(**inputs)
        finally:
            for h in handles:
                h.remove()
    return trace


# ----------------------------------------------------------------- counting --
@dataclasses.dataclass
class Counts:
    host: float = 0.0        # host calls that reach a kernel
    views: float = 0.0       # view and metadata calls (no kernel; eager, each a trip through the dispatcher)
    dispatches: float = 0.0
    syncs: float = 0.0
    empty: float = 0.0       # calls that reach a kernel with nothing to do: torch's per-expert mm of an expert no
    #                          token chose, in its _grouped_mm fallback (timeline.EMPTY_GROUP a piece)
    commits: float = 0.0     # command buffers committed without a wait (Call.stream "commit")
    waits: float = 0.0       # waits for the previous step's event (Call.stream "wait_previous")

    def __add__(self, o):
        return Counts(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(o))))

    def __mul__(self, k):
        return Counts(*(a * k for a in dataclasses.astuple(self)))


def expected_experts(experts: int, top_k: int, tokens: int) -> float:
    """Distinct experts `tokens` tokens choose, each top_k of `experts`
    uniformly (a router's choices are not uniform; this is the most)."""
    return experts * (1 - (1 - top_k / experts) ** tokens)


# torch's SDPA on MPS at decode (one to eight query rows, head dim 64, 96,
# 128 or 256): aten/src/ATen/native/mps/operations/Attention.mm
# (_scaled_dot_product_attention_math_mps, pytorch/pytorch at 00a5f92)
# takes sdpa_vector_2pass_mps, two dispatches (a pass over 32 blocks of
# keys, then one combining them), when `k_.size(2) >= 1024 || (k_.size(1) <
# q_.size(1) && k_.size(2) >= 4096)`, and sdpa_vector_fast_mps (one)
# otherwise; the 2.14 and 2.15 wheels ship the same three kernels
# (ATen/native/mps/kernels/DecodeAttention.h, identical headers).
SDPA_TWO_PASS_KEYS = 1024
# The vector kernels serve one to eight query rows (above); a prefill's
# SDPA (more rows) takes torch's other paths, counted as one dispatch (an
# MPSGraph as one, as every graph here: a lower bound).
SDPA_VECTOR_MAX_QUERIES = 8


def sdpa_dispatches(keys: int, queries: int = 1) -> int:
    """Dispatches of one SDPA call over `keys` keys with `queries` query
    rows (at decode, the condition's first clause decides for every key
    length the second one would)."""
    if queries > SDPA_VECTOR_MAX_QUERIES:
        return 1
    return 2 if keys >= SDPA_TWO_PASS_KEYS else 1


def units(calls: list[Call], release: str, mode: str, ours: bool, experts: int | None = None,
          used: float | None = None, keys: int | None = None) -> list[tuple[Call, Counts]]:
    """Each call of `calls` as a Mac with torch `release` runs it, eager or
    compiled, stock (ours=False) or with mps_ext (each call's recorded
    executor dispatches; None = torch's kernel), in order: (call, what it
    costs). A call Inductor fuses into the generated kernel before it costs
    nothing; torch's _grouped_mm fallback is two units, its sync (offs
    copied to the CPU) and then its per-expert products. `experts`/`used`:
    the real model's expert count and experts with rows for that fallback
    (default: the traced ones); `keys`: the key length attention runs at
    (default: the traced one)."""
    out = []
    old = tuple(int(x) for x in release.split(".")) < (2, 15)
    fused_run = False
    for call in calls:
        c = Counts()
        out.append((call, c))
        if call.kind == "view":
            c.views += 0 if mode == "compile" else 1
            continue
        mine = ours and call.ours is not None
        if mode == "compile" and _generated(call, ours):
            if not fused_run:
                c.host += 1
                c.dispatches += 1
            fused_run = True
            continue
        fused_run = False
        if call.kind == "sync":
            c.syncs += 1
            c.host += 1
            c.dispatches += 1 if call.op == "nonzero" else 0
            continue
        if call.stream == "commit":
            c.commits += 1
        elif call.stream == "wait_previous":
            c.waits += 1
            continue
        if mine:
            c.host += 1
            c.dispatches += call.ours
        elif call.op == "_grouped_mm" and old:
            # torch's fallback: offs copied to the CPU (a sync), then mm per expert
            e = experts if experts is not None else call.groups
            u = used if used is not None else call.groups_used
            c.host += 1
            c.syncs += 1
            c.dispatches += 1
            out.append((call, Counts(host=u, empty=e - u, dispatches=u)))
        elif call.op.startswith("_scaled_dot_product"):
            c.host += 1
            c.dispatches += sdpa_dispatches(keys if keys is not None else call.keys, call.queries or 1)
        elif call.op == "commit":  # mps_ext's commit point: a command buffer committed, no kernel
            continue
        else:
            c.host += 1
            c.dispatches += 1 if call.written else 0
    return out


def count(calls: list[Call], release: str, mode: str, ours: bool, experts: int | None = None,
          used: float | None = None, keys: int | None = None) -> Counts:
    """Host calls, views, dispatches, syncs, commits and waits of `calls`
    (units' costs, summed)."""
    total = Counts()
    for _, c in units(calls, release, mode, ours, experts, used, keys):
        total = total + c
    return total


def by_layer(trace: Trace) -> dict:
    """Calls per decoder layer (None: outside the layers)."""
    out = collections.defaultdict(list)
    for call in trace.calls:
        out[call.layer].append(call)
    return out


def per_kind(trace: Trace, config) -> dict[str, list[Call]]:
    """The calls of one traced layer of each kind, and those before the
    first layer ('pre': embedding, rotary tables) and after the last
    ('post': final norm, LM head)."""
    layers = by_layer(trace)
    kinds = layer_kinds(config)
    first = next((i for i, c in enumerate(trace.calls) if c.layer is not None), len(trace.calls))
    out = {"pre": [c for c in trace.calls[:first] if c.layer is None],
           "post": [c for c in trace.calls[first:] if c.layer is None]}
    for i, k in enumerate(kinds):
        out.setdefault(k, layers.get(i, []))
    return out


def _generated(call: Call, ours: bool) -> bool:
    """Whether Inductor would generate `call` (stock, or with mps_ext: not
    one of mps_ext's kernels, unless its module leaves it to torch when
    compiled)."""
    return (call.kind == "compute" and call.fusible
            and not (ours and call.ours is not None and call.op not in _TORCH_WHEN_COMPILED))


def _fused_edges(calls: list[Call], ours: bool) -> tuple[bool, bool]:
    """Whether the first and the last call that reach a kernel would be
    generated by Inductor (so that they fuse with a neighbouring segment's)."""
    costed = [c for c in calls if c.kind != "view"]
    if not costed:
        return False, False
    last, first = costed[-1], costed[0]
    return _generated(first, ours), _generated(last, ours)


def layer_calls(spec: Spec, trace: Trace, tiny_config) -> tuple[dict[str, list[Call]], list[str]]:
    """The traced calls of one layer of each kind (and 'pre', 'post': see
    per_kind), and the real model's layer kinds in their order."""
    real = spec.config()
    calls = per_kind(trace, tiny_config)
    sequence = layer_kinds(real)
    missing = set(sequence) - set(calls)
    if missing:
        raise ValueError(f"the tiny {spec.name} has no layer of kind {sorted(missing)}: its layer structure must "
                         f"cover every kind of the real model's ({sorted(set(sequence))})")
    return calls, sequence


def scale(spec: Spec, trace: Trace, tiny_config, tokens: int, release: str, mode: str, ours: bool,
          context: int | None = None, cache: str = "dynamic") -> dict:
    """Counts per layer kind (one layer, counted alone; 'ffn': of its
    feed-forward block alone), outside the layers ('head'), and for the
    whole real model of `spec`: its layers in their
    order, where under torch.compile a layer's trailing pointwise calls fuse
    with the next layer's leading ones (the residual add and the next norm).
    `context`: the tokens of context each sequence has (attention's key
    length, sdpa_dispatches; default: the traced one) and `cache` the KV
    cache the step runs with (attention_keys)."""
    real = spec.config()
    calls, sequence = layer_calls(spec, trace, tiny_config)
    kinds = collections.Counter(sequence)
    used = expected_experts(real.num_experts, real.num_experts_per_tok, tokens)
    keys = None if context is None else attention_keys(context, cache)
    per = {k: count(calls[k], release, mode, ours, real.num_experts, used, keys) for k in ["pre", *kinds, "post"]}
    total = Counts()
    for k in ["pre", *sequence, "post"]:
        total = total + per[k]
    if mode == "compile":
        segments = [_fused_edges(calls[k], ours) for k in ["pre", *sequence, "post"] if calls[k]]
        merges = sum(1 for a, b in zip(segments, segments[1:]) if a[1] and b[0])
        total.host -= merges
        total.dispatches -= merges
    per["head"] = per.pop("pre") + per.pop("post")
    ffn = {k: count([c for c in calls[k] if c.ffn], release, mode, ours, real.num_experts, used, keys) for k in kinds}
    return {"per_kind": per, "ffn": ffn, "layers": dict(kinds), "total": total}


# ------------------------------------------------------------------- bytes --
# A layer's weights as matrices and others. Matrices: (rows, columns, count)
# of each nn.Linear weight and each chosen expert's two bank slices (gate
# and up together, down): what mps_ext.quantize_fp8 converts to float8 with
# one fp32 scale per row (mps_ext/fp8.py, its default granularity "row";
# an expert bank by row whatever the granularity). Others: every other
# parameter (norms, convolutions, the MoE router, DeltaNet's dt_bias and
# A_log), which quantize_fp8 leaves in the model's dtype, as it does the LM
# head and the embedding.
FP8_SCALE_BYTES = 4  # fp32


def _attn_weights(c) -> tuple[list, int]:
    h = c.hidden_size
    hd = getattr(c, "head_dim", None) or h // c.num_attention_heads
    q = c.num_attention_heads * hd * (2 if c.model_type.startswith("qwen3_5") else 1)  # Qwen3.5's output gate
    kv = c.num_key_value_heads * hd
    return [(q, h, 1), (kv, h, 1), (kv, h, 1), (h, c.num_attention_heads * hd, 1)], 2 * hd  # + q/k norms


def _deltanet_weights(c) -> tuple[list, int]:
    h, nv = c.hidden_size, c.linear_num_value_heads
    kd, vd = c.linear_num_key_heads * c.linear_key_head_dim, nv * c.linear_value_head_dim
    conv_dim = 2 * kd + vd
    return ([(conv_dim, h, 1), (vd, h, 1), (nv, h, 1), (nv, h, 1), (h, vd, 1)],  # in_proj_qkv, z, b, a; out_proj
            conv_dim * c.linear_conv_kernel_dim + 2 * nv + c.linear_value_head_dim)  # conv1d, dt_bias, A_log, norm


def _conv_weights(c) -> tuple[list, int]:
    h = c.hidden_size
    return [(3 * h, h, 1), (h, h, 1)], h * c.conv_L_cache  # in_proj, out_proj; the short convolution


def _ffn_weights(c, ffn: str, used: float) -> tuple[list, int]:
    h = c.hidden_size
    if ffn == "dense":
        i = c.intermediate_size
        return [(i, h, 1), (i, h, 1), (h, i, 1)], 0
    i = c.moe_intermediate_size
    matrices, others = [(2 * i, h, used), (h, i, used)], h * c.num_experts  # chosen experts; router
    shared = getattr(c, "shared_expert_intermediate_size", 0) or 0
    if shared:  # the shared expert (gate, up, down) and its gate, all nn.Linear
        matrices += [(shared, h, 1), (shared, h, 1), (h, shared, 1), (1, h, 1)]
    return matrices, others


def weight_bytes(matrices: list, others: int, fp8: bool = False, dtype_bytes: int = 2) -> float:
    """Bytes of (matrices, others) in the model's dtype, or with the
    matrices as quantize_fp8 leaves them (1 byte an element, an fp32 scale a
    row)."""
    if fp8:
        return sum(n * (r * k + FP8_SCALE_BYTES * r) for r, k, n in matrices) + others * dtype_bytes
    return (sum(n * r * k for r, k, n in matrices) + others) * dtype_bytes


def layer_bytes(config, kind: str, tokens: int, context: int, fp8: bool = False, cache_bytes: int = 2,
                state_bytes: int = 4, used: float | None = None, cache_copy: bool = True,
                cache: str = "dynamic") -> dict:
    """Bytes one layer of `kind` ('mixer+ffn') reads and writes in a decode
    step of `tokens` sequences at `context`, from the config's dimensions:
    every weight a token needs once (routed experts: the distinct ones
    chosen, `used`, default expected_experts), bf16 or, with `fp8`, as
    mps_ext.quantize_fp8 leaves them (weight_bytes); the KV cache (read by
    attention; with `cache_copy`, as transformers' DynamicCache appends with
    torch.cat, also read and written whole once more; without, the new rows
    written in place: a static cache, or mps_ext.optimize's eager
    kv_append (or qk_norm_rope_append), which keeps DynamicCache's keys and values as views of
    buffers with spare capacity; `cache`: the cache attention reads,
    attention_keys), and the recurrent and convolution states (read and written once: what a compiled or fused
    step moves; transformers' eager DeltaNet step passes over its fp32
    state in several pointwise calls, which is not counted). Activations
    (KB) left out."""
    c = config
    h = c.hidden_size
    if used is None:
        used = expected_experts(c.num_experts, c.num_experts_per_tok, tokens)
    mixer, ffn = kind.split("+")
    matrices, others = {"full_attention": _attn_weights, "linear_attention": _deltanet_weights,
                        "conv": _conv_weights}[mixer](c)
    more, others_ffn = _ffn_weights(c, ffn, used)
    weights = weight_bytes(matrices + more, others + others_ffn + 2 * h, fp8)  # + the two RMS norms
    kv_read = kv_written = copy = state = 0
    if mixer == "full_attention":
        hd = getattr(c, "head_dim", None) or h // c.num_attention_heads
        per_token = 2 * c.num_key_value_heads * hd * cache_bytes
        # attention reads the cache with the new rows (a static cache: all of it, attention_keys)
        kv_read = tokens * attention_keys(context, cache) * per_token
        if cache_copy:  # torch.cat([cache, new]): the old cache and the new rows read, the grown cache written
            copy = 2 * tokens * (context + 1) * per_token
        else:  # a static cache, or kv_append: the new rows written in place
            kv_written = tokens * per_token
    elif mixer == "linear_attention":
        kd = c.linear_num_key_heads * c.linear_key_head_dim
        conv = (2 * kd + c.linear_num_value_heads * c.linear_value_head_dim) * (c.linear_conv_kernel_dim - 1)
        rec = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim
        state = tokens * 2 * (conv * cache_bytes + rec * state_bytes)
    elif mixer == "conv":
        # transformers' cache holds conv_L_cache taps a channel ([batch, hidden, L]), each read and the
        # window written back whole (short_conv_decode, or the torch code's copy_)
        state = tokens * 2 * h * c.conv_L_cache * cache_bytes
    out = {"weights": weights, "kv_read": kv_read, "kv_written": kv_written, "kv_copy": copy, "state": state}
    out["total"] = sum(out.values())
    return out


def appends_in_place(trace: Trace, mode: str) -> bool:
    """Whether the traced step's attention layers wrote their new key and
    value rows in place rather than torch.cat (layer_bytes' cache_copy), in
    `mode`: a static cache's index_copy_ in either mode (compiled, Inductor
    keeps it in place), mps_ext's kv_append or qk_norm_rope_append eager
    (compiled, the fused forward keeps DynamicCache's own update)."""
    if any(c.op == "index_copy_" for c in trace.calls):
        return True
    return mode == "eager" and any(c.op in _APPENDS and c.ours for c in trace.calls)


def step_bytes(config, tokens: int, context: int, fp8: bool = False, fp8_head: bool = False, **kwargs) -> dict:
    """Bytes a whole decode step reads and writes: every layer's
    (layer_bytes, which takes the same keywords), the final norm, the LM
    head (tied or not, read whole) and the embedding rows (all three in the
    model's dtype, fp8 or not: quantize_fp8 leaves them; head_bytes, with
    `fp8_head` the LM head in fp8)."""
    c = config
    out = dict.fromkeys(("weights", "kv_read", "kv_written", "kv_copy", "state", "total"), 0)
    for kind in layer_kinds(c):
        for k, v in layer_bytes(c, kind, tokens, context, fp8, **kwargs).items():
            out[k] += v
    head = sum(head_bytes(c, tokens, fp8_head).values())
    out["weights"] += head
    out["total"] += head
    return out


def head_bytes(config, tokens: int, fp8_head: bool = False) -> dict:
    """Bytes outside the layers: 'pre', the embedding rows of the step's
    tokens; 'post', the final norm and the LM head read whole (tied or not),
    in the model's dtype, or with `fp8_head` the LM head as quantize_fp8
    converts a matrix (an fp8 byte an element and an fp32 scale a row: the
    option issue 31 asks of quantize_fp8, not what it does today)."""
    c = config
    head = weight_bytes([(c.vocab_size, c.hidden_size, 1)], c.hidden_size, fp8=fp8_head)
    return {"pre": weight_bytes([], tokens * c.hidden_size), "post": head}
