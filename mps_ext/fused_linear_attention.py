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
modules (nn.Linear or quantize_fp8's FP8Linear). Prefill, a call without a
cache (or one recording past states for speculative decoding), CPU tensors
without the executor, and a forward that needs gradients run the layer's
own forward.

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

import torch
from torch import nn

from ._subclass import candidates, fused_subclass
from .fp8 import _use_torch_cpu_ops

__all__ = ["optimize_linear_attention"]

_FLOAT = (torch.float32, torch.float16, torch.bfloat16)
_PARTS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "A_log", "dt_bias", "norm", "out_proj")


def _kernels_on_mps() -> bool:
    import mps_ext
    return mps_ext.is_available() and mps_ext._C.is_enabled("linear")


# Decided when dynamo traces a graph, as fused_moe's: a pybind call it cannot trace.
_kernels_on_mps._dynamo_marked_constant = True


def _kernels_for(x: torch.Tensor) -> bool:
    if x.device.type == "mps":
        return _kernels_on_mps()
    return x.device.type == "cpu" and not _use_torch_cpu_ops(x)


def cached_decode_step(hidden_states: torch.Tensor, cache, attention_mask, layer_idx: int) -> bool:
    """Whether a recurrent layer's call (Gated DeltaNet, LFM2's short
    convolution) is one cached decode token a kernel takes: [batch, 1,
    features] floating where mps_ext's kernels run, no derivative asked
    (the ops have none), and transformers' own decode condition (a cache
    not recording the past, no mask: a padding mask zeroes the token's
    input, apply_mask_to_padding_states, which is left to the layer)."""
    return (cache is not None and hidden_states.dim() == 3 and hidden_states.shape[1] == 1
            and hidden_states.dtype in _FLOAT and _kernels_for(hidden_states)
            and not (torch.is_grad_enabled() and hidden_states.requires_grad)
            and attention_mask is None and not cache.is_recording_past(layer_idx))


class FusedDecodeMixin:
    """The decode step of a Gated DeltaNet layer on linear_attention_decode;
    everything else the layer's own forward (the next class in the MRO)."""

    def forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
        states = self._decode_states(hidden_states, cache_params, attention_mask)
        if states is None:
            return super().forward(hidden_states, cache_params=cache_params, attention_mask=attention_mask, **kwargs)
        conv_state, recurrent_state = states
        x = hidden_states[:, 0]
        core = torch.ops.mps_ext.linear_attention_decode(
            self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x), conv_state,
            recurrent_state, self.conv1d.weight.view(self.conv1d.weight.shape[0], -1), self.A_log, self.dt_bias,
            self.norm.weight, self.num_k_heads, float(self.norm.variance_epsilon))
        return self.out_proj(core)[:, None]

    def _decode_states(self, hidden_states, cache_params, attention_mask):
        """(conv_state, recurrent_state) of the cache when this call is a
        decode step the kernel takes, else None (the layer's own forward)."""
        if not cached_decode_step(hidden_states, cache_params, attention_mask, self.layer_idx):
            return None
        conv_state = cache_params.get_conv_state(self.layer_idx)
        recurrent_state = cache_params.get_recurrent_state(self.layer_idx)
        if conv_state is None or recurrent_state is None:
            return None
        dt = hidden_states.dtype
        if (recurrent_state.dtype != torch.float32 or conv_state.dtype != dt or not conv_state.is_contiguous()
                or not recurrent_state.is_contiguous() or conv_state.shape[-1] != self.conv_kernel_size
                or any(t.dtype != dt for t in (self.conv1d.weight, self.A_log, self.dt_bias, self.norm.weight))):
            return None
        return conv_state, recurrent_state


def _is_linear(m) -> bool:
    from .fp8 import FP8Linear
    from .fused_projections import ProjectionRows  # a second optimize: the projections are fused
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


def optimize_linear_attention(model: nn.Module) -> tuple[dict[str, str], list[str], dict[str, str]]:
    """Every Gated DeltaNet layer of `model` on linear_attention_decode at
    decode, in place: (converted {name: what}, already [names], left
    {name: why}). A module counts as a candidate when it holds `A_log`,
    `dt_bias` and `conv1d` (the parts every Gated DeltaNet layer has)."""
    converted = {}
    already, left, plans = candidates(
        model, FusedDecodeMixin,
        lambda m: all(isinstance(getattr(m, n, None), (nn.Module, torch.Tensor))
                      for n in ("A_log", "dt_bias", "conv1d")),
        why_not)  # raises for a dtype the kernel does not take: before any layer is changed
    for name, mod in plans:
        mod.__class__ = fused_subclass(FusedDecodeMixin, type(mod), f"{type(mod).__name__} with its decode step on "
                                       "torch.ops.mps_ext.linear_attention_decode (mps_ext.optimize).")
        converted[name] = (f"{type(mod).__mro__[2].__name__} -> decode on linear_attention_decode "
                           f"({mod.num_v_heads} value heads, {mod.num_k_heads} key heads)")
    return converted, already, left
