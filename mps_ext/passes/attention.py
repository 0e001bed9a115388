"""An attention layer's q and k norms and rotary embedding in one dispatch,
for mps_ext.optimize: the attention of transformers' Qwen3 and Qwen3-MoE,
Qwen3.5/3.6-MoE (full attention: the output gate chunked from q_proj,
partial rotary) and LFM2 / LFM2-MoE, and the layers of the same structure in
other models.

Eager, those forwards run between their projections and the cache update
q_norm, k_norm (FusedRMSNorm after optimize: one dispatch each) and
transformers' apply_rotary_pos_emb (mul, neg, cat, mul, add for q and for
k; a partial rotary adds a cat for each): about 12 host calls and
dispatches a layer and token. Here they are one call of
mps_ext.passes.norm.qk_norm_rope (torch.ops.mps_ext.qk_norm_rope where the
kernels run, the same steps with torch's ops elsewhere). Two more pieces
are one dispatch each where the kernels run, eager: the output gate
(sigmoid_gate: the gate read where q_proj left it, where the model copies
it and runs sigmoid and mul; at a decode step, where o_proj is a plain
nn.Linear, the gate is in o_proj's GEMV instead, sigmoid_gate_linear: one
dispatch for both) and, for a plain DynamicCache's DynamicLayer,
the cache update (cache_update: kv_append into buffers with spare
capacity, where DynamicLayer.update copies the whole cache twice with
torch.cat); where both the norm and cache kernels run, that append is in
qk_norm_rope's own dispatch (qk_norm_rope_append: the keys normed and
rotated straight into the cache, the values copied beside them). At a
decode step (one query token, no mask: the plain causal mask over the
whole cache, which transformers leaves out) the attention function is
torch.ops.mps_ext.kv_decode_attention where its kernels run
(decode_attention: each cached key and value row read once for all the
query heads sharing it, where torch's decode SDPA reads it once per query
head). The rest of the forward is the model's, line for line: its
projections (nn.Linear, FP8Linear, or views of a fused q/k/v projection),
the attention function transformers selects for the config
(ALL_ATTENTION_FUNCTIONS of the layer's own modeling module, its
eager_attention_forward as default) everywhere else, the sliding window
where the layer has one, the output projection.

A layer is recognised by its parts, not its class: q_proj, k_proj, v_proj,
o_proj (or out_proj), per-head q and k norms that fuse_norms made
FusedRMSNorm (q_norm / k_norm, or LFM2's q_layernorm / k_layernorm), a
q_proj of one or two (query and gate) heads' width per output head, and a
forward of transformers 5's signature. Such a module gets a subclass of its
own class whose forward takes the fused path (`__class__` swapped: the
parameters, the state dict and the module tree stay as they were); then
its output on a probe (random hidden states, cos and sin of each rotary
size the model's rotary embeddings give) must equal, bit for bit, its own
forward's, both with torch's ops: so a rotary embedding that is not the
rotate_half one (interleaved pairs, a multimodal rope taking cos and sin of
another shape) or a forward that does anything else is found, and the layer
is left as it was, with the reason. At run time a cos of a rotary size the
probe did not see runs the layer's own forward.
"""  # noqa: E501

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import typing

import torch
from torch import nn

from ._classes import fused_subclass, original_class, register_maker, register_mixin
from ._protocol import Pass, _exact, mismatch
from ._runtime import kernels_for
from .norm import _FLOAT, MAX_HEAD_DIM, FusedRMSNorm, qk_norm_rope, qk_norm_rope_reference, qk_op_args

__all__ = ["AttentionPass", "FusedQKNormRopeMixin", "cache_update", "decode_attention", "qk_norm_rope_append",
           "sigmoid_gate", "sigmoid_gate_linear"]

_NORMS = (("q_norm", "k_norm"), ("q_layernorm", "k_layernorm"))
_OUT = ("o_proj", "out_proj")
# transformers 5's attention forward: (hidden_states, position_embeddings, attention_mask, <cache>=None,
# **kwargs), the cache named past_key_values up to 5.23 and cache from 5.24; the decoder layers pass them
# by name.
_ARGUMENTS = ("hidden_states", "position_embeddings", "attention_mask")
_CACHE_NAMES = ("past_key_values", "cache")
_PROBE_TOKENS = 3


@dataclasses.dataclass(frozen=True)
class _Plan:
    q_norm: str
    k_norm: str
    out: str
    gated: bool                  # q_proj holds each head's query, then its output gate (Qwen3.5/3.6, Qwen3-Next)
    sliding_window: bool         # the layer passes its sliding_window to the attention function (Qwen3)
    update_kwargs: bool = False  # the forward passes its keywords to cache.update (transformers 5.24 on)
    rotary: frozenset = frozenset()  # rotary sizes (cos.shape[-1]) the probe checked


def _bind(args: tuple, kwargs: dict):
    """(hidden_states, position_embeddings, attention_mask, cache, the other
    keywords) of an attention's call, whichever name its release gives the
    cache; None if the call is not of that form."""
    if len(args) > 4:
        return None
    given = dict(zip(_ARGUMENTS + ("cache",), args))
    rest = dict(kwargs)
    for n in _ARGUMENTS:
        if n in rest:
            if n in given:
                return None
            given[n] = rest.pop(n)
    for n in _CACHE_NAMES:
        if n in rest:
            if "cache" in given:
                return None
            given["cache"] = rest.pop(n)
    if any(n not in given for n in _ARGUMENTS):
        return None
    return given["hidden_states"], given["position_embeddings"], given["attention_mask"], given.get("cache"), rest


@register_mixin
class FusedQKNormRopeMixin:
    """The forward of a transformers 5 attention with its q/k norms and
    rotary embedding as one mps_ext.passes.norm.qk_norm_rope call; the
    layer's own forward (the next class in the MRO) for a call of another
    form or a rotary size the probe did not check."""

    def forward(self, *args, **kwargs):
        call = self._mps_ext_fused_call(False, args, kwargs)
        return super().forward(*args, **kwargs) if call is None else call()

    def _mps_ext_fused_call(self, reference: bool, args: tuple, kwargs: dict):
        """The call on the fused path (reference: torch's ops for the
        kernels), as a function of no arguments; None where the layer's own
        forward runs."""
        bound = _bind(args, kwargs)
        if bound is None:
            return None
        hidden_states, position_embeddings, attention_mask, cache, rest = bound
        cos = position_embeddings[0] if isinstance(position_embeddings, (tuple, list)) else None
        if not (isinstance(cos, torch.Tensor) and cos.dim() == 3 and cos.shape[-1] in self._mps_ext_attention.rotary):
            return None
        ops = _REFERENCE if reference else _KERNELS
        return lambda: self._fused_forward(ops, hidden_states, position_embeddings, attention_mask, cache, **rest)

    def _fused_forward(self, ops, hidden_states, position_embeddings, attention_mask, cache=None, **kwargs):
        """The model's forward with `ops` in place of its norm and rotary
        lines, its output gate and its cache update (_KERNELS; the probe:
        _REFERENCE, torch's ops in the model's steps)."""
        plan = self._mps_ext_attention
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query = self.q_proj(hidden_states)
        if plan.gated:
            # gate stays a view of q_proj's output ([..., heads, head_dim], each head's query then its gate):
            # the op reads it there; the model's reshape(*input_shape, -1) would copy it.
            query, gate = torch.chunk(query.view(*input_shape, -1, self.head_dim * 2), 2, dim=-1)
        key = self.k_proj(hidden_states).view(hidden_shape)
        value = self.v_proj(hidden_states).view(hidden_shape)
        cos, sin = position_embeddings
        q_norm, k_norm = getattr(self, plan.q_norm), getattr(self, plan.k_norm)
        # The cache append in the norm and rotary dispatch where it can be (ops.qk_append; None: it cannot).
        fused = None if cache is None or ops.qk_append is None else ops.qk_append(
            query.view(hidden_shape), key, value, cos, sin, q_norm, k_norm, cache, self.layer_idx)
        if fused is not None:
            query_states, key_states, value_states = fused
        else:
            query_states, key_states = ops.qk(query.view(hidden_shape), key, cos, sin, q_norm, k_norm)
            value_states = value.transpose(1, 2)
            if cache is not None:
                key_states, value_states = ops.cache(cache, key_states, value_states, self.layer_idx,
                                                     kwargs if plan.update_kwargs else None)
        window = {"sliding_window": self.sliding_window} if plan.sliding_window else {}
        decoded = None if ops.attend is None else ops.attend(self, query_states, key_states, value_states,
                                                             attention_mask, window, kwargs)
        if decoded is not None:
            attn_output, attn_weights = decoded, None
        else:
            attention_interface = self._mps_ext_functions.get_interface(self.config._attn_implementation,
                                                                        self._mps_ext_eager)
            attn_output, attn_weights = attention_interface(
                self, query_states, key_states, value_states, attention_mask,
                dropout=0.0 if not self.training else getattr(self, "attention_dropout", 0.0), scaling=self.scaling,
                **window, **kwargs)
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        out = getattr(self, plan.out)
        if plan.gated:
            # The gate in the output projection's dispatch where it can be (ops.gate_out; None: it cannot).
            gated = None if ops.gate_out is None else ops.gate_out(attn_output, gate, out)
            if gated is not None:
                return gated, attn_weights
            attn_output = ops.gate(attn_output, gate)
        return out(attn_output), attn_weights


# ----------------------------------------------------------- the output gate --
def sigmoid_gate_reference(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The model's `x * torch.sigmoid(gate.reshape(x.shape))` (x [..., heads
    * head_dim], gate [..., heads, head_dim])."""
    return x * torch.sigmoid(gate.reshape(x.shape))


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """sigmoid_gate_reference as one torch.ops.mps_ext.sigmoid_gate
    dispatch, reading gate where q_proj left it, where mps_ext's kernels run
    (MPS with the attention_gate family on; CPU tensors when a CPU backend
    is asked for); elsewhere, under torch.compile (Inductor fuses the ops
    with their neighbours) and where autograd needs a derivative, torch's
    ops."""
    if (not torch.compiler.is_compiling() and x.dtype in _FLOAT and gate.dtype == x.dtype
            and x.numel() == gate.numel() and x.is_contiguous()
            and not (torch.is_grad_enabled() and (x.requires_grad or gate.requires_grad))
            and kernels_for(x, "attention_gate")):
        return torch.ops.mps_ext.sigmoid_gate(x.view(gate.shape), gate).view(x.shape)
    return sigmoid_gate_reference(x, gate)


def sigmoid_gate_linear(x: torch.Tensor, gate: torch.Tensor, out: nn.Module) -> torch.Tensor | None:
    """out(sigmoid_gate(x, gate)), the output gate and the output projection
    that reads it, as one torch.ops.mps_ext.sigmoid_gate_linear dispatch
    (bit for bit sigmoid_gate, then the layer's F.linear: csrc/ops/linear.cpp)
    where its kernel takes the call: `out` a plain nn.Linear (no hooks) in
    x's dtype, contiguous along K, at decode (the rows' bytes within what the
    GEMV stages: the input norm's bounds, projections._NORMED_ROWS and
    _NORMED_BYTES), where mps_ext's attention_gate and linear kernels both
    run; None elsewhere (then sigmoid_gate and the layer's own call), and
    where autograd needs a derivative (the op has none). Compiled too, as
    rms_norm_linear: at decode the gate's neighbours are mps_ext's kernels
    (the decode attention, o_proj's GEMV), nothing for Inductor to fuse it
    with, so the op saves the compiled step its dispatch as it does eager's."""
    from .projections import _NORMED_BYTES, _NORMED_ROWS
    if type(out) is not nn.Linear or out._forward_hooks or out._forward_pre_hooks:
        return None
    w, b = out.weight, out.bias
    rows = x.numel() // max(x.shape[-1], 1)
    if not (x.dtype in _FLOAT and gate.dtype == x.dtype and w.dtype == x.dtype and (b is None or b.dtype == x.dtype)
            and x.numel() == gate.numel() and x.is_contiguous() and w.stride(-1) == 1
            and 1 <= rows <= _NORMED_ROWS and rows * x.shape[-1] * x.element_size() <= _NORMED_BYTES):
        return None
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, gate, w, b)):
        return None
    if not (kernels_for(x, "attention_gate") and kernels_for(x, "linear")):
        return None
    return torch.ops.mps_ext.sigmoid_gate_linear(x, gate, w, b)


# ----------------------------------------------------------- the KV cache --
# Positions a cache buffer grows by (as MLX's KVCache): a reallocation, one
# copy of the cache, every STEP tokens instead of two every token.
KV_STEP = 256


def _release_update(cache, key_states, value_states, layer_idx, kwargs):
    """The model's own `cache.update(key_states, value_states, layer_idx)`
    (with `kwargs=kwargs` where its release passes them)."""
    if kwargs is None:
        return cache.update(key_states, value_states, layer_idx)
    return cache.update(key_states, value_states, layer_idx, kwargs=kwargs)


def kv_append_reference(k_buf, v_buf, key, value, n: int) -> None:
    """torch.ops.mps_ext.kv_append with torch's copies."""
    t = key.shape[-2]
    k_buf[:, :, n:n + t].copy_(key)
    v_buf[:, :, n:n + t].copy_(value)


@functools.cache
def _dynamic_cache_classes() -> tuple[type, type]:
    """transformers' DynamicCache and DynamicLayer, imported once (not per layer and token)."""
    from transformers.cache_utils import DynamicCache, DynamicLayer
    return DynamicCache, DynamicLayer


def _appends(cache, key: torch.Tensor, value: torch.Tensor, layer_idx, kernels: bool) -> bool:
    """Whether cache_update writes this update with kv_append: a plain
    DynamicCache's DynamicLayer (the classes exactly: a sliding-window,
    quantized, static or hybrid layer keeps its own update), eager, where
    the kernels run (`kernels`; else wherever they would)."""
    if torch.compiler.is_compiling():
        return False
    DynamicCache, DynamicLayer = _dynamic_cache_classes()
    if type(cache) is not DynamicCache or cache.offloading:
        return False
    if not isinstance(layer_idx, int) or not 0 <= layer_idx < len(cache.layers) or \
            type(cache.layers[layer_idx]) is not DynamicLayer:
        return False  # a layer Cache.update has yet to add, or another kind
    if key.dim() != 4 or value.shape != key.shape or key.dtype not in _FLOAT or value.dtype != key.dtype or \
            value.device != key.device:
        return False
    if torch.is_grad_enabled() and (key.requires_grad or value.requires_grad):  # no derivative
        return False
    return not kernels or kernels_for(key, "kv_cache")


def _slot(cache, layer_idx: int, key: torch.Tensor, value: torch.Tensor, shape: tuple):
    """(k_buf, v_buf, n): the buffers [b, h, capacity, d] of a DynamicLayer
    (_appends) that take an update of `shape` (b, h, t, d) at rows n ..
    n + t - 1, made anew (one copy of the cache) when it is full or the
    layer's keys are not the views last set here (the first update, or
    after crop, reorder, reset, batch_repeat_interleave, a torch.cat of the
    layer's own update); None where the release's update must run (old
    keys that torch.cat would refuse or promote). key and value: the new
    rows, in any layout (the layer takes its dtype and device from them)."""
    layer = cache.layers[layer_idx]
    if not layer.is_initialized:
        layer.lazy_initialization(key, value)
    b, h, t, d = shape
    held = layer.__dict__.get("_mps_ext_kv")
    n = 0 if held is None else held[2].shape[-2]
    if held is None or layer.keys is not held[2] or layer.values is not held[3] or n + t > held[0].shape[2] or \
            held[0].shape[:2] != (b, h) or held[0].shape[3] != d or held[0].dtype != key.dtype or \
            held[0].device != key.device:
        old_k, old_v = layer.keys, layer.values
        n = old_k.shape[-2] if old_k.numel() else 0
        if n and (old_k.shape[:2] != (b, h) or old_k.shape[3] != d or old_v.shape != old_k.shape
                  or old_k.dtype != key.dtype or old_v.dtype != key.dtype):
            return None  # torch.cat would raise or promote
        capacity = -(-(n + t) // KV_STEP) * KV_STEP
        k_buf = key.new_empty((b, h, capacity, d))
        v_buf = key.new_empty((b, h, capacity, d))
        if n:
            k_buf[:, :, :n].copy_(old_k)
            v_buf[:, :, :n].copy_(old_v)
        return k_buf, v_buf, n
    return held[0], held[1], n


def _filled(layer, k_buf: torch.Tensor, v_buf: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's keys and values after an update by _slot's buffers, now
    filled to n rows: what DynamicLayer.update would leave and return."""
    layer.keys, layer.values = k_buf[:, :, :n], v_buf[:, :, :n]
    layer._mps_ext_kv = (k_buf, v_buf, layer.keys, layer.values)
    return layer.keys, layer.values


def cache_update(cache, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, kwargs=None, *,
                 reference: bool = False):
    """cache.update(key_states, value_states, layer_idx), for a
    DynamicLayer (_appends) in one torch.ops.mps_ext.kv_append dispatch:
    the layer's keys and values are views [:, :, :n] of buffers with spare
    capacity (KV_STEP positions at a time, _slot), the new rows written in
    place. The layer holds what DynamicLayer.update would leave (its keys
    and values of n positions, dtype, device, is_initialized), so
    get_seq_length, the masks, crop, reorder and generate see the same
    cache. `kwargs`: what the release passes update besides (None:
    nothing). `reference`: torch's copies for kv_append (the probe's path),
    wherever the kernel would run."""
    slot = _slot(cache, layer_idx, key_states, value_states, tuple(key_states.shape)) if _appends(
        cache, key_states, value_states, layer_idx, not reference) else None
    if slot is None:
        return _release_update(cache, key_states, value_states, layer_idx, kwargs)
    k_buf, v_buf, n = slot
    (kv_append_reference if reference else torch.ops.mps_ext.kv_append)(k_buf, v_buf, key_states, value_states, n)
    return _filled(cache.layers[layer_idx], k_buf, v_buf, n + key_states.shape[-2])


def qk_norm_rope_append(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor, q_norm: nn.Module | None, k_norm: nn.Module | None, cache,
                        layer_idx: int):
    """qk_norm_rope then cache_update (query, key and value [B, T, H, D],
    the projections' outputs viewed as heads) in one
    torch.ops.mps_ext.qk_norm_rope_append dispatch, where both would run
    their kernels (qk_op_args, _appends): the keys are normed and rotated
    straight into the cache's buffer and the values copied beside them,
    where kv_append would copy both again in a second dispatch; bit for bit
    what the two give. Returns (query_states, keys, values) as the two
    would; None where they must run instead."""
    args = qk_op_args(query, key, cos, sin, q_norm, k_norm)
    if args is None or not _appends(cache, key, value, layer_idx, True):
        return None
    b, t, h, d = key.shape
    slot = _slot(cache, layer_idx, key, value, (b, h, t, d))
    if slot is None:
        return None
    k_buf, v_buf, n = slot
    query_states = torch.ops.mps_ext.qk_norm_rope_append(query, key, value, cos, sin, *args, k_buf, v_buf, n)
    return (query_states, *_filled(cache.layers[layer_idx], k_buf, v_buf, n + t))


# ----------------------------------------------------------- decode attention --
# The attention functions decode_attention stands for: with no mask and one query row, both are
# softmax(q k^T * scaling) v over every key, each query head on its key-value head (repeat_kv).
_DECODE_IMPLEMENTATIONS = ("sdpa", "eager")
# Keywords the models and decoder layers pass down that those functions ignore (anything else, such as a
# softcap, attention sinks or a position bias, keeps the model's function).
_DECODE_IGNORED_KWARGS = frozenset({"position_ids", "cache_position", "use_cache", "output_attentions",
                                    "output_hidden_states", "output_router_logits", "return_dict"})
DECODE_HEAD_DIMS = (64, 128, 256)  # kv_decode_attention's instantiations
DECODE_MAX_GQA = 16


def decode_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                     window: dict, kwargs: dict) -> torch.Tensor | None:
    """The model's attention function at a decode step as one
    torch.ops.mps_ext.kv_decode_attention call (two past 128 keys: blocks
    of keys, then their merge), which reads each cached key and value row
    once for all the query heads sharing it: where one query row (one
    token) attends to the whole cache (no mask: the plain causal mask of
    the last position, which transformers leaves out), with the sdpa or
    eager function, no sliding window, no dropout, no attention weights
    asked for, eager, no autograd, and the kernels run. Returns the
    function's output ([batch, 1, heads, head_dim]), None where the
    model's function must run."""
    if attention_mask is not None or query.dim() != 4 or query.shape[2] != 1 or module.training or \
            window.get("sliding_window") is not None or kwargs.get("output_attentions") or \
            not _DECODE_IGNORED_KWARGS.issuperset(kwargs) or \
            module.config._attn_implementation not in _DECODE_IMPLEMENTATIONS:
        return None
    if torch.compiler.is_compiling() or query.dtype not in _FLOAT or key.dtype != query.dtype or \
            value.dtype != query.dtype or key.shape != value.shape or key.shape[2] == 0 or \
            query.shape[-1] not in DECODE_HEAD_DIMS or key.shape[-1] != query.shape[-1] or \
            query.shape[1] % key.shape[1] or query.shape[1] // key.shape[1] > DECODE_MAX_GQA:
        return None
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        return None
    if not kernels_for(query, "kv_cache"):
        return None
    scaling = module.scaling if module.scaling is not None else query.shape[-1] ** -0.5
    return torch.ops.mps_ext.kv_decode_attention(query, key, value, float(scaling)).transpose(1, 2)


class _Ops(typing.NamedTuple):
    qk: typing.Callable
    gate: typing.Callable
    cache: typing.Callable
    # qk and cache in one call where it can (else None: then qk and cache run); None: never
    qk_append: typing.Callable | None = None
    # the attention function at a decode step where it can (else None: the model's function); None: never
    attend: typing.Callable | None = None
    # gate and the output projection in one call where it can (else None: gate, then the layer); None: never
    gate_out: typing.Callable | None = None


_KERNELS = _Ops(qk_norm_rope, sigmoid_gate, cache_update, qk_norm_rope_append, decode_attention, sigmoid_gate_linear)
_REFERENCE = _Ops(qk_norm_rope_reference, sigmoid_gate_reference, functools.partial(cache_update, reference=True))


def _fused_class(cls: type) -> type:
    modeling = sys.modules[cls.__module__]
    return fused_subclass(
        FusedQKNormRopeMixin, cls,
        f"{cls.__name__} with its q/k norms and rotary embedding on one torch.ops.mps_ext.qk_norm_rope call "
        "(mps_ext.optimize).",
        # The modeling module's own: the attention function the config names, and its default.
        _mps_ext_functions=modeling.ALL_ATTENTION_FUNCTIONS,
        _mps_ext_eager=staticmethod(modeling.eager_attention_forward))


def _features(m, name: str) -> int | None:
    n = getattr(m, name, None)
    return n if isinstance(n, int) else None


def _plan(mod: nn.Module) -> _Plan | str:
    """What the fused forward needs to know of `mod`, or why it cannot
    stand for mod's forward (before the probe)."""
    norm_names = next((p for p in _NORMS if all(isinstance(getattr(mod, n, None), nn.Module) for n in p)), None)
    if norm_names is None:
        return "no per-head q and k norms (q_norm, k_norm or q_layernorm, k_layernorm): no norm to fuse with its rotary"
    out = next(n for n in _OUT if isinstance(getattr(mod, n, None), nn.Module))
    norms = [getattr(mod, n) for n in norm_names]
    if not all(isinstance(n, FusedRMSNorm) for n in norms):
        kinds = ", ".join(type(n).__name__ for n in norms)
        return f"its q and k norms ({kinds}) are not RMSNorms optimize fuses"
    d = getattr(mod, "head_dim", None)
    if not isinstance(d, int) or any(tuple(n.weight.shape) != (d,) for n in norms):
        return f"its q and k norms are not over each head's {d} elements"
    if d > MAX_HEAD_DIM:
        return f"head_dim {d}: qk_norm_rope takes at most {MAX_HEAD_DIM}"
    if len({(n.eps, n.variant, n.weight.dtype) for n in norms}) != 1:
        return "its q and k norms differ in eps, variant or dtype (qk_norm_rope takes one of each)"
    q_rows, o_cols = _features(mod.q_proj, "out_features"), _features(getattr(mod, out), "in_features")
    if q_rows is None or o_cols is None or _features(mod.q_proj, "in_features") is None or o_cols % d:
        return f"its q_proj and {out} are not linear layers of whole heads"
    if q_rows not in (o_cols, 2 * o_cols):
        return (f"its q_proj gives {q_rows} features for {o_cols // d} heads of {d}: neither queries nor queries "
                "and gate")
    try:
        params = list(inspect.signature(type(mod).forward).parameters.values())
    except (TypeError, ValueError):
        params = []
    names = [p.name for p in params]
    if names[1:4] != list(_ARGUMENTS) or len(params) != 6 or names[4] not in _CACHE_NAMES \
            or params[-1].kind != inspect.Parameter.VAR_KEYWORD:
        return ("its forward is not transformers 5's (hidden_states, position_embeddings, attention_mask, "
                "past_key_values or cache, **kwargs)")
    modeling = sys.modules.get(type(mod).__module__)
    if not all(hasattr(modeling, n) for n in ("ALL_ATTENTION_FUNCTIONS", "eager_attention_forward")) or \
            not hasattr(getattr(mod, "config", None), "_attn_implementation"):
        return "its modeling module has no ALL_ATTENTION_FUNCTIONS and eager_attention_forward (not transformers 5's)"
    from .projections import ProjectionRows
    known = {"q_proj", "k_proj", "v_proj", out, *norm_names}
    known |= {m.fused_name for m in (mod.q_proj, mod.k_proj, mod.v_proj) if isinstance(m, ProjectionRows)}
    extra = [n for n, _ in mod.named_children() if n not in known]
    if extra:
        return f"it holds {', '.join(extra)} beside its projections and q/k norms (optimize knows no such attention)"
    try:
        source = inspect.getsource(type(mod).forward)
    except (OSError, TypeError):
        source = ""
    return _Plan(norm_names[0], norm_names[1], out, q_rows == 2 * o_cols, hasattr(mod, "sliding_window"),
                 update_kwargs="kwargs=kwargs)" in source.replace(" ", ""))


def _probe(mod: nn.Module, original, plan: _Plan, rotary: set[int]) -> frozenset | str:
    """The rotary sizes at which mod (already swapped) gives, with torch's
    ops, its own forward's output bit for bit, or why not: those of the
    model's rotary embeddings (`rotary`; head_dim if it has none). Sizes its
    own forward raises for are sizes the layer cannot run."""
    w = getattr(mod, plan.q_norm).weight
    if w.device.type == "meta":
        return "on the meta device: nothing to probe"
    d = mod.head_dim
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, _PROBE_TOKENS, mod.q_proj.in_features, generator=g).to(w.device, w.dtype)
    ok, raised = [], []
    modes = [(m, m.training) for m in mod.modules()]
    mod.train(False)  # dropout apart
    try:
        with torch.no_grad():
            for r in sorted({r for r in rotary if 2 <= r <= d and r % 2 == 0} or {d}):
                cos, sin = ((torch.rand(1, _PROBE_TOKENS, r, generator=g) * 2 - 1).to(w.device, w.dtype)
                            for _ in range(2))
                try:
                    want = original(mod, x, (cos, sin), None)[0]
                except Exception as e:  # noqa: BLE001 - a rotary size the layer does not take
                    raised.append(f"{r}: {type(e).__name__}: {e}")
                    continue
                got = mod._fused_forward(_REFERENCE, x, (cos, sin), None)[0]
                if not (got.shape == want.shape and torch.equal(got, want)):
                    err = float((_exact(got) - _exact(want)).abs().max() / _exact(want).abs().max())
                    return mismatch(f"its output differs on a probe (rotary size {r}, relative error {err:.2g}): its "
                                    "rotary embedding is not rotate_half's, or its forward does something else")
                ok.append(r)
    finally:
        for m, training in modes:
            m.training = training
    if not ok:
        return f"it raised on every probe (rotary sizes {'; '.join(raised)})"
    return frozenset(ok)


def _rotary_sizes(model: nn.Module) -> set[int]:
    """cos.shape[-1] of each rotary embedding of `model` (2 x its inv_freq)."""
    return {2 * b.numel() for m in model.modules() for n, b in m.named_buffers(recurse=False) if n == "inv_freq"}


def _is_candidate(mod: nn.Module) -> bool:
    return all(isinstance(getattr(mod, n, None), nn.Module) for n in ("q_proj", "k_proj", "v_proj")) and \
        any(isinstance(getattr(mod, n, None), nn.Module) for n in _OUT)


class AttentionPass(Pass):
    """An attention layer with per-head q/k norms (module docstring) -> its
    norms and rotary embedding on qk_norm_rope (its class swapped)."""

    name = "attention"
    title = "attention layers with q/k norms and rotary embedding on torch.ops.mps_ext.qk_norm_rope (one dispatch)"
    # The op takes FusedRMSNorm's weights; and the probe runs each layer as it will run, q, k and v views of
    # the fused projection's output.
    after = ("norms", "projections")
    stateful = True

    def candidates(self, model):
        return [n for n, m in model.named_modules() if isinstance(m, FusedQKNormRopeMixin) or _is_candidate(m)]

    def already(self, module):
        return isinstance(module, FusedQKNormRopeMixin)

    def plan(self, model, name, module):
        plan = _plan(module)
        if isinstance(plan, _Plan):
            plan = dataclasses.replace(plan, rotary=frozenset(_rotary_sizes(model)))
        return plan

    def probe(self, model, name, module, plan):
        cls = type(module)
        module.__class__ = _fused_class(cls)
        module._mps_ext_attention = plan
        try:
            sizes = _probe(module, cls.forward, plan, set(plan.rotary))
        finally:
            module.__class__ = cls
            del module._mps_ext_attention
        if isinstance(sizes, str):
            return sizes
        plan.__dict__["_sizes"] = sizes  # (frozen dataclass: what apply takes)
        return None

    def apply(self, model, name, module, plan):
        sizes = plan.__dict__.pop("_sizes")
        cls = type(module)
        module.__class__ = _fused_class(cls)
        module._mps_ext_attention = dataclasses.replace(plan, rotary=sizes)
        d = module.head_dim
        heads = getattr(module, plan.out).in_features // d
        return (f"{cls.__name__} -> {plan.q_norm}, {plan.k_norm} and rotary embedding on qk_norm_rope "
                f"({heads} query heads, {module.k_proj.out_features // d} key heads of {d}, rotary "
                f"{', '.join(map(str, sorted(sizes)))}{', output gate' if plan.gated else ''})")

    def witness(self, model, name):
        return getattr(model.get_submodule(name), model.get_submodule(name)._mps_ext_attention.q_norm).weight

    def revert(self, model, name):
        module = model.get_submodule(name) if name else model
        module.__class__ = original_class(type(module))
        module.__dict__.pop("_mps_ext_attention", None)


register_maker(FusedQKNormRopeMixin, _fused_class)
