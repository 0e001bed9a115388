"""LFM2's short convolution at decode on one kernel: the conv layers of
LFM2 and LFM2-MoE (transformers' Lfm2ShortConv, Lfm2MoeShortConv, and the
layers of the same structure in other models), for mps_ext.optimize.

transformers runs a decode step of these layers as in_proj, `B * x`,
causal_conv1d_update's torch fallback (a Mac has no causal_conv1d: cat,
copy_ into the cached window, conv1d), `C * y` and out_proj: 5 host calls
and dispatches between the projections. Here that part is one call of
torch.ops.mps_ext.short_conv_decode (csrc/ops/short_conv.cpp, one
dispatch), which moves transformers' cached window in place as its code
does and gives torch's CPU numbers bit for bit where oneDNN's fused
multiply-add kernels run torch's convolution (x86-64 with AVX2 or later;
tests/short_conv_oracle.py computes that arithmetic); the projections stay the
model's own modules (nn.Linear or quantize_fp8's FP8Linear). Prefill, a
call without a cache (or one recording past states for speculative
decoding), a padding mask, CPU tensors without the executor, and a
forward that needs gradients run the layer's own forward. Under
torch.compile the op stays one call in the graph (its fake kernel in
_meta.py): Inductor would leave the convolution to aten between two
generated kernels, 3 dispatches for the op's 1, and round B * x where its
fused code keeps floats, so the compiled step would not be the eager one's
numbers.

A layer is recognised by its parts, not its class: in_proj, a depthwise
nn.Conv1d `conv` over the hidden channels of window conv_kernel_size (at
most the kernel's SC_MAX_K, 4), out_proj and layer_idx. Such a module gets
a subclass of its own class whose forward takes the kernel at decode
(`__class__` swapped: the parameters, the state dict and the module tree
stay as they were); then its decode step on a probe (a random window and
token, with torch's ops in place of the kernel) must give its own
forward's output and window bit for bit, or the layer is left as it was,
with the reason.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._subclass import candidates, fused_subclass
from .fused_linear_attention import cached_decode_step

__all__ = ["optimize_short_conv"]

_FLOAT = (torch.float32, torch.float16, torch.bfloat16)
MAX_TAPS = 4  # SC_MAX_K of kernels_metal/short_conv_params.h


def short_conv_decode_reference(BCx, conv_state, weight, bias):
    """short_conv_decode with torch's ops, in transformers' order (the probe's
    stand-in for the kernel): C * conv(window), the window moved in place."""
    B, C, x = BCx.transpose(-1, -2).chunk(3, dim=-2)
    window = torch.cat([conv_state[:, :, 1:], B * x], -1)
    conv_state.copy_(window)
    y = F.conv1d(window, weight.unsqueeze(1), bias, groups=weight.shape[0])
    return (C * y).transpose(-1, -2).contiguous()


class FusedShortConvMixin:
    """The decode step of an LFM2 conv layer on short_conv_decode;
    everything else the layer's own forward (the next class in the MRO)."""

    def forward(self, hidden_states, past_key_values=None, attention_mask=None, **kwargs):
        conv_state = self._decode_state(hidden_states, past_key_values, attention_mask)
        if conv_state is None:
            return super().forward(hidden_states, past_key_values=past_key_values, attention_mask=attention_mask,
                                   **kwargs)
        return self._decode(torch.ops.mps_ext.short_conv_decode, hidden_states, conv_state)

    def _decode(self, step, hidden_states, conv_state):
        weight = self.conv.weight
        return self.out_proj(step(self.in_proj(hidden_states), conv_state, weight.view(weight.shape[0], -1),
                                  self.conv.bias))

    def _decode_state(self, hidden_states, past_key_values, attention_mask):
        """The cache's window when this call is a decode step the kernel
        takes, else None (the layer's own forward)."""
        if not cached_decode_step(hidden_states, past_key_values, attention_mask, self.layer_idx):
            return None
        conv_state = past_key_values.get_conv_state(self.layer_idx, state_idx=0)
        w, b, dt = self.conv.weight, self.conv.bias, hidden_states.dtype
        # what the op takes (else its error would reach the user): one dtype, a contiguous window and weight
        if (conv_state is None or conv_state.dtype != dt or not conv_state.is_contiguous()
                or conv_state.shape[-1] != w.shape[-1] or w.dtype != dt or not w.is_contiguous()
                or (b is not None and (b.dtype != dt or not b.is_contiguous()))):
            return None
        return conv_state


class _ProbeCache:
    """The two calls a conv layer's decode makes of transformers' cache."""

    def __init__(self, state):
        self.state = state

    def get_conv_state(self, layer_idx, state_idx=0):
        return self.state

    def is_recording_past(self, layer_idx):
        return False


def why_not(mod: nn.Module) -> str | None:
    """None if `mod` has the parts of a conv layer the kernel runs, else
    why not (the probe decides the rest)."""
    missing = [n for n in ("in_proj", "conv", "out_proj") if not isinstance(getattr(mod, n, None), nn.Module)]
    if missing or not isinstance(getattr(mod, "layer_idx", None), int):
        return f"no {', '.join(missing or ['layer_idx'])}"
    conv = mod.conv
    h = getattr(conv, "in_channels", None)
    if not (isinstance(conv, nn.Conv1d) and conv.groups == h == conv.out_channels and conv.stride == (1,)
            and conv.dilation == (1,) and conv.weight.dim() == 3 and conv.weight.shape[1] == 1):
        return "its conv is not a depthwise nn.Conv1d over its channels (stride and dilation 1)"
    k = conv.weight.shape[-1]
    if k > MAX_TAPS:
        return f"its convolution's window of {k} taps: short_conv_decode takes at most {MAX_TAPS}"
    if getattr(mod, "conv_kernel_size", k) != k:
        return f"its conv_kernel_size {mod.conv_kernel_size} is not its conv's {k} taps"
    if conv.weight.dtype not in _FLOAT:
        raise ValueError(f"optimize runs float32, float16 or bfloat16 models; {type(mod).__name__} is "
                         f"{conv.weight.dtype}")
    return None


def _probe(mod: nn.Module, original) -> str | None:
    """None if mod's decode step (already swapped), with torch's ops for
    the kernel, gives its own forward's output and window bit for bit on a
    probe, else why not."""
    w = mod.conv.weight
    if w.device.type == "meta":
        return "on the meta device: nothing to probe"
    h, k = w.shape[0], w.shape[-1]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 1, h, generator=g).to(w.device, w.dtype)
    state = torch.randn(2, h, k, generator=g).to(w.device, w.dtype)
    theirs = state.clone()
    modes = [(m, m.training) for m in mod.modules()]
    mod.train(False)
    try:
        with torch.no_grad():
            try:
                want = original(mod, x, past_key_values=_ProbeCache(theirs), attention_mask=None)
            except Exception as e:  # noqa: BLE001 - a forward that is not LFM2's
                return f"it raised on a probe: {type(e).__name__}: {e}"
            try:
                got = mod._decode(short_conv_decode_reference, x, state)
            except Exception as e:  # noqa: BLE001
                return f"its decode step raised on a probe: {type(e).__name__}: {e}"
    finally:
        for m, training in modes:
            m.training = training
    if not (isinstance(want, torch.Tensor) and got.shape == want.shape and torch.equal(got, want)
            and torch.equal(state, theirs)):
        return ("its output or its cached window differs from B * x, a depthwise convolution and C * y on a probe: "
                "its forward does something else")
    return None


def optimize_short_conv(model: nn.Module) -> tuple[dict[str, str], list[str], dict[str, str]]:
    """Every LFM2 conv layer of `model` on short_conv_decode at decode, in
    place: (converted {name: what}, already [names], left {name: why}). A
    module counts as a candidate when it holds in_proj, out_proj and an
    nn.Conv1d `conv`."""
    converted = {}
    already, left, plans = candidates(
        model, FusedShortConvMixin,
        lambda m: isinstance(getattr(m, "conv", None), nn.Conv1d)
        and all(isinstance(getattr(m, n, None), nn.Module) for n in ("in_proj", "out_proj")),
        why_not)  # raises for a dtype the kernel does not take: before any layer is changed
    for name, mod in plans:
        cls = type(mod)
        mod.__class__ = fused_subclass(FusedShortConvMixin, cls, f"{cls.__name__} with its decode step on "
                                       "torch.ops.mps_ext.short_conv_decode (mps_ext.optimize).")
        why = _probe(mod, cls.forward)
        if why:
            mod.__class__ = cls
            left[name] = why
            continue
        w = mod.conv.weight
        converted[name] = (f"{cls.__name__} -> decode on short_conv_decode ({w.shape[0]} channels, window "
                           f"{w.shape[-1]}{', bias' if mod.conv.bias is not None else ''})")
    return converted, already, left
