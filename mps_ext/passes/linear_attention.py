"""Gated DeltaNet decode on one kernel: the linear-attention layers of
Qwen3.5/3.6-MoE (transformers' Qwen3_5MoeGatedDeltaNet, and the layers of
the same structure in other models), for mps_ext.optimize.

transformers runs a decode step of these layers in its torch fallbacks for
causal_conv1d_update and FLA's fused_recurrent_gated_delta_rule (a Mac has
neither package): about 80 ops a layer between the input projections and
the output projection, each a host call and a dispatch on MPS. Here that
part is one call of torch.ops.mps_ext.linear_attention_decode
(csrc/ops/linear_attention.cpp, one dispatch): the convolution window and
the float32 recurrent state of transformers' cache are updated in place,
the gated RMSNorm is applied, and the projections stay the model's own
modules (nn.Linear or quantize_fp8's FP8Linear).

Prefill (and any call that is not a cached decode step) runs the layer's
own forward, except its chunked delta rule: transformers' forward calls its
module's global torch_chunk_gated_delta_rule (FLA's chunk_gated_delta_rule
where installed), about 688 ops a layer at 4k tokens; that name is given a
wrapper once (install_chunk_rule) that, inside a converted layer's forward
only, runs torch.ops.mps_ext.linear_attention_chunk (two dispatches) and
everywhere else the original function. The final state it returns is what
transformers' cache keeps, so decode continues from it. A call with
gradients asked for (any input requiring grad), another chunk size,
variable-length sequences (cu_seqlens) or beta in another dtype than q
runs the original function (differentiable). CPU tensors without a CPU
backend asked for run the layer's own forward.

A layer is recognised by its parts, not its class: in_proj_qkv, in_proj_z,
in_proj_b, in_proj_a, a depthwise conv1d without bias, A_log, dt_bias, a
gated RMSNorm `norm` (weight, variance_epsilon, SiLU gate), out_proj, the
SiLU activation and the head counts. Such a module gets a subclass of its
own class whose forward takes the kernel at decode (`__class__` swapped:
the parameters, the state dict and the module tree stay as they were).
Qwen3-Next's layers (one interleaved in_proj_qkvz and in_proj_ba) are
left, with the reason.
"""

from __future__ import annotations

import contextvars
import functools
import math

import torch
from torch import nn
from torch.nn import functional as F

from ._classes import fused_subclass, original_class, register_maker, register_mixin
from ._protocol import Pass, _exact, mismatch
from ._runtime import kernels_for

__all__ = ["CHUNK_TOLERANCE", "FusedDecodeMixin", "LinearAttentionPass", "chunk_rule_float64", "float64_rule",
           "gated_delta_step", "install_chunk_rule", "linear_attention_decode_reference"]

_FLOAT = (torch.float32, torch.float16, torch.bfloat16)
_PARTS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "A_log", "dt_bias", "norm", "out_proj")
# What transformers has called a recurrent layer's cache argument: 5.23's Gated DeltaNet cache_params, the
# short convolution past_key_values; from 5.24 both `cache`.
CACHE_NAMES = ("cache", "cache_params", "past_key_values")
# The decode step's bound against the layer's own torch code (tests/ops/test_linear_attention.py: the two
# differ in summation order and library exp/rsqrt, and in fp16/bf16 a float32 difference can move a rounded
# intermediate by an ulp), per dtype, relative to the output's largest magnitude.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}
# The prefill core's bound (torch.ops.mps_ext.linear_attention_chunk against transformers'
# torch_chunk_gated_delta_rule run in float64, tests/ops/test_linear_attention_chunk.py), per input dtype:
# the largest difference of the output over the float64 output's largest magnitude, and of the final state over
# its largest magnitude. Both compute in float32 from the inputs on; the output is rounded to the input dtype once
# (half an ulp: 2^-9 of the magnitude in bfloat16, 2^-12 in float16); the float32 sums differ in order (the
# chunk's (I + A)^-1 by forward substitution a column at a time, its products as 8 x 8 simdgroup-matrix sums
# over the lower blocks), measured below 2e-6 in float32 at up to 200 tokens of unit-norm keys. The bound is the
# output's rounding plus float32 error at 1 to 200 tokens.
CHUNK_TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def gated_delta_step(qkv, z, b, a, conv_state, recurrent_state, conv_weight, A_log, dt_bias, norm_weight,
                     k_heads: int, eps: float):
    """The Gated DeltaNet decode step in float64, from its equations
    (Qwen3-Next / Qwen3.5): (output [batch, v_heads * dv], the moved
    convolution window, the new state), the inputs left as they are."""
    qkv, z, b, a, window, state, conv_w, A_log, dt_bias, norm_w = (
        _exact(t) for t in (qkv, z, b, a, conv_state, recurrent_state, conv_weight, A_log, dt_bias, norm_weight))
    batch, v_heads, dk, dv = state.shape
    window = torch.cat([window[:, :, 1:], qkv[:, :, None]], -1)
    x = F.silu((window * conv_w).sum(-1))
    key_dim = k_heads * dk
    q, k, v = x[:, :key_dim], x[:, key_dim:2 * key_dim], x[:, 2 * key_dim:]
    q = q.view(batch, k_heads, dk).repeat_interleave(v_heads // k_heads, 1)
    k = k.view(batch, k_heads, dk).repeat_interleave(v_heads // k_heads, 1)
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) / math.sqrt(dk)  # transformers' l2norm, eps 1e-6
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    v = v.view(batch, v_heads, dv)
    decay = torch.exp(-A_log.exp() * F.softplus(a + dt_bias))
    beta = torch.sigmoid(b)
    s = state * decay[..., None, None]
    delta = (v - torch.einsum("bhij,bhi->bhj", s, k)) * beta[..., None]
    s = s + k[..., :, None] * delta[..., None, :]
    o = torch.einsum("bhij,bhi->bhj", s, q)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * norm_w
    o = o * F.silu(z.view(batch, v_heads, dv))
    return o.reshape(batch, v_heads * dv), window, s


def linear_attention_decode_reference(qkv, z, b, a, conv_state, recurrent_state, conv_weight, A_log, dt_bias,
                                      norm_weight, k_heads: int, eps: float) -> torch.Tensor:
    """torch.ops.mps_ext.linear_attention_decode with torch's ops
    (gated_delta_step), the states updated in place as the kernel updates
    them (the window moved, the float32 state replaced), the output in the
    activations' dtype."""
    out, window, state = gated_delta_step(qkv, z, b, a, conv_state, recurrent_state, conv_weight, A_log, dt_bias,
                                          norm_weight, k_heads, eps)
    conv_state.copy_(window.to(conv_state.dtype))
    recurrent_state.copy_(state.to(recurrent_state.dtype))
    return out.to(qkv.device, qkv.dtype)


def recurrent_call(args: tuple, kwargs: dict):
    """(hidden_states, cache, attention_mask) of a recurrent layer's call,
    under whichever name the release passes its cache."""
    hidden = args[0] if args else kwargs.get("hidden_states")
    cache = next((kwargs[n] for n in CACHE_NAMES if kwargs.get(n) is not None), args[1] if len(args) > 1 else None)
    mask = kwargs.get("attention_mask", args[2] if len(args) > 2 else None)
    return hidden, cache, mask


def cached_decode_step(hidden_states, cache, attention_mask, layer_idx: int, family: str | None,
                       recording_too: bool = False) -> bool:
    """Whether a recurrent layer's call (Gated DeltaNet, LFM2's short
    convolution) is one cached decode token a kernel of `family` takes
    (None: wherever, for the reference ops): [batch, 1, features] floating,
    no derivative asked (the ops have none), and transformers' own decode
    condition (no mask: a padding mask zeroes the token's input,
    apply_mask_to_padding_states, which is left to the layer; a cache not
    recording its past, unless `recording_too`)."""
    recording = getattr(cache, "is_recording_past", None)
    return (isinstance(hidden_states, torch.Tensor) and callable(recording) and hidden_states.dim() == 3
            and hidden_states.shape[1] == 1 and hidden_states.dtype in _FLOAT
            and (family is None or kernels_for(hidden_states, family))
            and not (torch.is_grad_enabled() and hidden_states.requires_grad)
            and attention_mask is None and (recording_too or not recording(layer_idx)))


def count_in_place_step(cache, layer_idx: int) -> None:
    """What transformers' own decode step does to the cache when it updates
    the conv window in place: from 5.25 on it counts the token
    (cache.increase_count, the linear-attention layers' sequence length);
    earlier releases keep no count. The generate episode compares the cache
    each step leaves, so a release that counts otherwise is left."""
    count = getattr(cache, "increase_count", None)
    if callable(count):
        count(layer_idx, 0)


class _Float64Torch:
    """torch, except that torch.float32 is torch.float64: the globals under
    which transformers' chunked delta rule, which casts its inputs to
    torch.float32, computes in float64."""

    def __getattr__(self, name):
        return torch.float64 if name == "float32" else getattr(torch, name)


def float64_rule(rule):
    """transformers' chunked delta rule function `rule` (its innermost
    torch code, under any kernel-hub wrapper) computing in float64: the same
    code object with `torch.float32` meaning float64."""
    import inspect
    import types
    code = inspect.unwrap(rule)
    return types.FunctionType(code.__code__, {**code.__globals__, "torch": _Float64Torch()}, code.__name__,
                              code.__defaults__, code.__closure__)


def chunk_rule_float64(query, key, value, g, beta, chunk_size: int = 64, initial_state=None,
                       output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False, rule=None, **kwargs):
    """transformers' chunked delta rule `rule` (the original function the
    wrapper holds) run in float64 (float64_rule: the oracle of
    linear_attention_chunk): the output in query's dtype, the final state
    in float32, as the float32 function returns them."""
    out, state = float64_rule(rule)(
        *(_exact(t) for t in (query, key, value)), g=_exact(g), beta=_exact(beta), chunk_size=chunk_size,
        initial_state=None if initial_state is None else _exact(initial_state), output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kwargs)
    assert out.dtype == torch.float64, "the reference did not compute in float64"
    return out.to(query.dtype), None if state is None else state.float()


class _Prefill:
    """A converted layer's forward running: its mode (reference: the
    probe's float64 rule instead of the kernel) and the calls the wrapper
    took."""

    def __init__(self, reference: bool):
        self.reference, self.taken = reference, 0


# Read by the chunk-rule wrapper: None outside converted layers' forwards, where it calls the original.
_PREFILL: contextvars.ContextVar = contextvars.ContextVar("mps_ext_deltanet_prefill", default=None)
_CHUNK_RULE = "torch_chunk_gated_delta_rule"


def chunk_rule_call(original, args: tuple, kwargs: dict, reference: bool):
    """linear_attention_chunk (reference: chunk_rule_float64) for a call of
    transformers' chunked delta rule it takes, else None (module docstring)."""
    names = ("query", "key", "value", "g", "beta", "chunk_size", "initial_state", "output_final_state",
             "use_qk_l2norm_in_kernel")
    call = dict(zip(names, args), **kwargs)
    q, k, v, g, beta = (call.get(n) for n in names[:5])
    init = call.get("initial_state")
    tensors = [t for t in (q, k, v, g, beta, init) if t is not None]
    if (len(tensors) < 5 or not all(isinstance(t, torch.Tensor) for t in tensors) or call.get("chunk_size", 64) != 64
            or call.get("cu_seqlens") is not None or q.dtype not in _FLOAT or beta.dtype != q.dtype
            or k.dtype != q.dtype or v.dtype != q.dtype or not g.is_floating_point()
            or (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
            or not (reference or kernels_for(q, "linear_attention"))):
        return None
    final = bool(call.get("output_final_state", False))
    l2 = bool(call.get("use_qk_l2norm_in_kernel", False))
    if reference:
        return chunk_rule_float64(q, k, v, g, beta, initial_state=init, output_final_state=final,
                                  use_qk_l2norm_in_kernel=l2, rule=original)
    out, state = torch.ops.mps_ext.linear_attention_chunk(
        q, k, v, g.float(), beta, None if init is None else init.float().contiguous(), l2)
    return out, state if final else None


def install_chunk_rule(cls: type) -> bool:
    """Gives the module of a layer class's forward, once, the wrapper of its
    chunked delta rule (module docstring); False if the module has none (a
    forward that calls something else: prefill stays the layer's own)."""
    import sys
    module = sys.modules.get(cls.__module__)
    original = getattr(module, _CHUNK_RULE, None)
    if not callable(original):
        return False
    if getattr(original, "_mps_ext_chunk_rule", False):
        return True

    @functools.wraps(original)
    def chunk_gated_delta_rule(*args, **kwargs):
        if torch.compiler.is_compiling():  # Dynamo cannot trace a ContextVar (FusedDecodeMixin.forward)
            return original(*args, **kwargs)
        mode = _PREFILL.get()
        taken = None if mode is None else chunk_rule_call(original, args, kwargs, mode.reference)
        if taken is None:
            return original(*args, **kwargs)
        mode.taken += 1
        return taken

    chunk_gated_delta_rule._mps_ext_chunk_rule = True
    setattr(module, _CHUNK_RULE, chunk_gated_delta_rule)
    return True


@register_mixin
class FusedDecodeMixin:
    """The decode step of a Gated DeltaNet layer on linear_attention_decode,
    its prefill's chunked delta rule on linear_attention_chunk; everything
    else the layer's own forward (the next class in the MRO)."""

    def forward(self, *args, **kwargs):
        call = self._mps_ext_fused_call(False, args, kwargs)
        if call is not None:
            return call()
        if torch.compiler.is_compiling():
            # Under torch.compile the prefill is the layer's own forward: Dynamo cannot trace the ContextVar
            # that routes the chunked delta rule to the kernel, and Inductor compiles the reference's ops.
            return super().forward(*args, **kwargs)
        return self._mps_ext_prefill(False, args, kwargs)

    def _mps_ext_prefill(self, reference: bool, args: tuple, kwargs: dict, count: bool = False):
        """The layer's own forward, its chunked delta rule on the kernel
        (reference: chunk_rule_float64) where the wrapper takes it; count:
        (output, calls the wrapper took)."""
        mode = _Prefill(reference)
        token = _PREFILL.set(mode)
        try:
            out = super().forward(*args, **kwargs)
        finally:
            _PREFILL.reset(token)
        return (out, mode.taken) if count else out

    def _mps_ext_fused_call(self, reference: bool, args: tuple, kwargs: dict):
        """The call's decode step on the kernel (reference: with torch's ops,
        wherever the kernel would run), as a function of no arguments; None
        where the layer's own forward runs."""
        hidden_states, cache, mask = recurrent_call(args, kwargs)
        if not cached_decode_step(
            hidden_states, cache, mask, self.layer_idx, None if reference else "linear_attention"
        ):
            return None
        get_conv, get_recurrent = (getattr(cache, n, None) for n in ("get_conv_state", "get_recurrent_state"))
        if not (callable(get_conv) and callable(get_recurrent)):
            return None
        conv_state, recurrent_state = get_conv(self.layer_idx), get_recurrent(self.layer_idx)
        dt = hidden_states.dtype
        if (not isinstance(conv_state, torch.Tensor) or not isinstance(recurrent_state, torch.Tensor)
                or recurrent_state.dtype != torch.float32 or conv_state.dtype != dt
                or not conv_state.is_contiguous() or not recurrent_state.is_contiguous()
                or conv_state.shape[-1] != self.conv_kernel_size
                or any(t.dtype != dt for t in (self.conv1d.weight, self.A_log, self.dt_bias, self.norm.weight))):
            return None
        op = linear_attention_decode_reference if reference else torch.ops.mps_ext.linear_attention_decode

        def step():
            count_in_place_step(cache, self.layer_idx)
            # The projections of hidden_states itself, [B, 1, K], not of a view of it: the decoder
            # layer may have handed their fused GEMV's product over for that very tensor
            # (projections.norm_into_projection). The same GEMV rows either way.
            x = hidden_states
            core = op(self.in_proj_qkv(x)[:, 0], self.in_proj_z(x)[:, 0], self.in_proj_b(x)[:, 0],
                      self.in_proj_a(x)[:, 0], conv_state,
                      recurrent_state, self.conv1d.weight.view(self.conv1d.weight.shape[0], -1), self.A_log,
                      self.dt_bias, self.norm.weight, self.num_k_heads, float(self.norm.variance_epsilon))
            return self.out_proj(core)[:, None]
        return step


def _fused_class(cls: type) -> type:
    return fused_subclass(FusedDecodeMixin, cls, f"{cls.__name__} with its decode step on "
                          "torch.ops.mps_ext.linear_attention_decode (mps_ext.optimize).")


register_maker(FusedDecodeMixin, _fused_class)


def _is_linear(m) -> bool:
    from ..fp8 import FP8Linear
    from .projections import ProjectionRows  # a second optimize: the projections are fused
    return isinstance(m, (nn.Linear, FP8Linear, ProjectionRows)) and m.bias is None


def why_not(mod: nn.Module) -> str | None:
    """None if `mod` is a Gated DeltaNet layer the kernel runs, else why not."""
    if all(hasattr(mod, n) for n in ("in_proj_qkvz", "in_proj_ba", "A_log", "conv1d")):
        return ("Qwen3-Next's interleaved in_proj_qkvz / in_proj_ba layout: its decode is not on "
                "linear_attention_decode yet")
    missing = [n for n in _PARTS if getattr(mod, n, None) is None]
    if missing:
        return f"no {', '.join(missing)}"
    try:
        hk, hv, dk, dv = (int(getattr(mod, n)) for n in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim"))
        k = int(mod.conv_kernel_size)
    except (AttributeError, TypeError, ValueError):
        return "no num_k_heads, num_v_heads, head_k_dim, head_v_dim and conv_kernel_size"
    conv = mod.conv1d
    conv_dim = 2 * hk * dk + hv * dv
    if not (isinstance(conv, nn.Conv1d) and conv.bias is None and conv.groups == conv_dim
            and tuple(conv.weight.shape) == (conv_dim, 1, k)):
        return f"its conv1d is not a depthwise convolution without bias over {conv_dim} channels of window {k}"
    if getattr(mod, "activation", None) != "silu" or getattr(mod.norm, "activation", None) != "silu":
        return "its activation or its norm's gate is not SiLU"
    if not all(_is_linear(getattr(mod, n)) for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")):
        return "its input projections are not linear layers without bias"
    shapes = [getattr(mod, n).out_features for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")]
    if shapes != [conv_dim, hv * dv, hv, hv] or hv % hk:
        return f"its projections give {shapes} features, not [{conv_dim}, {hv * dv}, {hv}, {hv}] for its heads"
    if tuple(mod.A_log.shape) != (hv,) or tuple(mod.dt_bias.shape) != (hv,) or \
            tuple(mod.norm.weight.shape) != (dv,) or not hasattr(mod.norm, "variance_epsilon"):
        return "A_log, dt_bias or its norm's weight is not of its heads' sizes"
    if mod.A_log.dtype not in _FLOAT:
        raise ValueError(f"optimize runs float32, float16 or bfloat16 models; {type(mod).__name__} is "
                         f"{mod.A_log.dtype}")
    return None


class _ProbeCache:
    """The calls a recurrent layer's decode makes of transformers' cache
    (5.23's names), over states the probe chose."""

    def __init__(self, conv, recurrent=None):
        self.conv, self.recurrent = conv, recurrent

    def get_conv_state(self, layer_idx, state_idx=0):
        return self.conv

    def get_recurrent_state(self, layer_idx, state_idx=0):
        return self.recurrent

    def update_recurrent_state(self, state, layer_idx, *args, **kwargs):
        self.recurrent.copy_(state)
        return self.recurrent

    def is_recording_past(self, layer_idx):
        return False

    def increase_count(self, layer_idx, state_idx=0):  # (5.25's token count: the episode checks it)
        pass


def probe_decode_step(mod, original, make_states, tolerance: float) -> str | None:
    """None if mod's decode step (already swapped), with torch's ops for
    the kernel, gives its own forward's output and cache states on a probe
    (within `tolerance` of their largest magnitude; 0: bit for bit), else
    why not. `make_states(generator)` gives the probe cache's states."""
    from ._episode import difference
    w = next(mod.parameters())
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 1, _hidden_of(mod), generator=g).to(w.device, w.dtype)
    ours = make_states(g)
    theirs = tuple(t.clone() for t in ours)
    modes = [(m, m.training) for m in mod.modules()]
    mod.train(False)
    try:
        with torch.no_grad():
            try:
                want = original(mod, x, _ProbeCache(*theirs))
            except Exception as e:  # noqa: BLE001 - a forward that is not transformers'
                return f"it raised on a probe: {type(e).__name__}: {e}"
            call = mod._mps_ext_fused_call(True, (x, _ProbeCache(*ours)), {})
            if call is None:
                return "its decode step does not take a probe's cached decode call"
            try:
                got = call()
            except Exception as e:  # noqa: BLE001
                return f"its decode step raised on a probe: {type(e).__name__}: {e}"
    finally:
        for m, training in modes:
            m.training = training
    d = difference(want, got, tolerance) or difference(theirs, ours, tolerance, "state")
    if d:
        return mismatch(f"its decode step differs from its own forward on a probe ({d}): it computes something "
                        "else than the kernel")
    return None


def probe_prefill(mod, original, tolerance: float) -> str | None:
    """None if mod's forward (already swapped) on a prompt of more than a
    chunk, its chunked delta rule by chunk_rule_float64, gives its own
    forward's output within `tolerance` of its largest magnitude and the
    wrapper took the call; else why not."""
    from ._episode import difference
    w = next(mod.parameters())
    x = torch.randn(1, 70, _hidden_of(mod), generator=torch.Generator().manual_seed(1)).to(w.device, w.dtype)
    modes = [(m, m.training) for m in mod.modules()]
    mod.train(False)
    try:
        with torch.no_grad():
            want = original(mod, x)
            got, taken = mod._mps_ext_prefill(True, (x,), {}, count=True)
    except Exception as e:  # noqa: BLE001 - a forward that is not transformers'
        return f"its prefill raised on a probe: {type(e).__name__}: {e}"
    finally:
        for m, training in modes:
            m.training = training
    if not taken:
        return f"its forward does not call its module's {_CHUNK_RULE} on a prompt"
    d = difference(want, got, tolerance)
    return mismatch(f"its prefill differs from its own forward on a probe ({d})") if d else None


def _hidden_of(mod) -> int:
    p = mod.in_proj_qkv if hasattr(mod, "in_proj_qkv") else mod.in_proj
    return p.in_features


def _states(mod):
    """The probe's (conv window, float32 recurrent state) for a DeltaNet layer."""
    w = mod.A_log

    def make(g):
        conv_dim = mod.conv1d.weight.shape[0]
        conv = torch.randn(2, conv_dim, mod.conv_kernel_size, generator=g).to(w.device, w.dtype)
        state = torch.randn(2, mod.num_v_heads, mod.head_k_dim, mod.head_v_dim, generator=g).to(w.device)
        return conv, state
    return make


class RecurrentDecodePass(Pass):
    """A recurrent layer whose cached decode step one kernel takes, its
    class swapped to a subclass with `mixin` first: what the Gated DeltaNet
    and the short-convolution passes share. A subclass gives the mixin,
    is_candidate (its parts), why_not (None, a reason, or ValueError for a
    dtype), fused_class (the class maker), states and tolerance (the
    probe's), describe (apply's text) and witness."""

    stateful = True
    mixin: type

    def candidates(self, model):
        return [n for n, m in model.named_modules() if isinstance(m, self.mixin) or self.is_candidate(m)]

    def refuse(self, model):
        for name in self.candidates(model):
            m = model.get_submodule(name) if name else model
            if not isinstance(m, self.mixin):
                self.why_not(m)  # raises for a dtype the kernel does not take

    def already(self, module):
        return isinstance(module, self.mixin)

    def plan(self, model, name, module):
        return self.why_not(module) or True

    def probe(self, model, name, module, plan):
        cls = type(module)
        module.__class__ = self.fused_class(cls)
        try:
            return probe_decode_step(module, cls.forward, self.states(module), self.tolerance(module))
        finally:
            module.__class__ = cls

    def apply(self, model, name, module, plan):
        module.__class__ = self.fused_class(type(module))
        return f"{original_class(type(module)).__name__} -> {self.describe(module)}"

    def revert(self, model, name):
        module = model.get_submodule(name) if name else model
        module.__class__ = original_class(type(module))


class LinearAttentionPass(RecurrentDecodePass):
    """A Gated DeltaNet layer (module docstring) -> decode on
    linear_attention_decode (its class swapped)."""

    name = "linear_attention"
    title = ("linear-attention layers on torch.ops.mps_ext.linear_attention_decode at decode, "
             "linear_attention_chunk at prefill")
    mixin = FusedDecodeMixin
    why_not = staticmethod(why_not)
    fused_class = staticmethod(_fused_class)
    states = staticmethod(_states)

    @staticmethod
    def is_candidate(m) -> bool:
        return all(isinstance(getattr(m, n, None), (nn.Module, torch.Tensor)) for n in ("A_log", "dt_bias", "conv1d"))

    @staticmethod
    def tolerance(module) -> float:
        return TOLERANCE.get(module.A_log.dtype, 0.0)

    def probe(self, model, name, module, plan):
        cls = type(module)
        why = super().probe(model, name, module, plan)
        if why is not None or not install_chunk_rule(cls):
            return why  # no chunk rule to hook: prefill stays the layer's own (describe says so)
        module.__class__ = self.fused_class(cls)
        try:
            return probe_prefill(module, cls.forward, self.tolerance(module))
        finally:
            module.__class__ = cls

    @staticmethod
    def describe(module) -> str:
        prefill = ("prefill's delta rule on linear_attention_chunk" if install_chunk_rule(original_class(type(module)))
                   else f"prefill its own (its module has no {_CHUNK_RULE})")
        return (f"decode on linear_attention_decode, {prefill} ({module.num_v_heads} value heads, "
                f"{module.num_k_heads} key heads)")

    def witness(self, model, name):
        return model.get_submodule(name).A_log
