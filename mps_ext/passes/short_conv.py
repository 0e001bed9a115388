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
decoding), a padding mask, CPU tensors without a CPU backend asked for, and a
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

from ._classes import fused_subclass, register_maker, register_mixin
from .linear_attention import RecurrentDecodePass, cached_decode_step, count_in_place_step, recurrent_call

__all__ = ["FusedShortConvMixin", "ShortConvPass", "short_conv_decode_reference"]

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


@register_mixin
class FusedShortConvMixin:
    """The decode step of an LFM2 conv layer on short_conv_decode;
    everything else the layer's own forward (the next class in the MRO)."""

    def forward(self, *args, **kwargs):
        call = self._mps_ext_fused_call(False, args, kwargs)
        return super().forward(*args, **kwargs) if call is None else call()

    def _mps_ext_fused_call(self, reference: bool, args: tuple, kwargs: dict):
        """The call's decode step on the kernel (reference: with torch's ops,
        wherever the kernel would run), as a function of no arguments; None
        where the layer's own forward runs."""
        hidden_states, cache, mask = recurrent_call(args, kwargs)
        if not cached_decode_step(hidden_states, cache, mask, self.layer_idx, None if reference else "short_conv",
                                  recording_too=True):
            return None
        # A cache recording its past (transformers' deferred stop check on MPS, for a cache the caller gets
        # back) keeps every window since its last crop: the step runs on a copy of the window, and the cache
        # appends the new column as the model's own step makes it do (update_conv_state).
        recording = cache.is_recording_past(self.layer_idx)
        get_conv, append = getattr(cache, "get_conv_state", None), getattr(cache, "update_conv_state", None)
        conv_state = get_conv(self.layer_idx, state_idx=0) if callable(get_conv) else None
        w, b, dt = self.conv.weight, self.conv.bias, hidden_states.dtype
        k = w.shape[-1]
        # what the op takes (else its error would reach the user): one dtype, a contiguous window and weight
        if (
            not isinstance(conv_state, torch.Tensor)
            or conv_state.dtype != dt
            or conv_state.shape[-1] != k
            or not (recording or conv_state.is_contiguous())
            or (recording and not callable(append))
            or w.dtype != dt
            or not w.is_contiguous()
            or (b is not None and (b.dtype != dt or not b.is_contiguous()))
        ):
            return None
        op = short_conv_decode_reference if reference else torch.ops.mps_ext.short_conv_decode

        def step():
            window = conv_state.clone(memory_format=torch.contiguous_format) if recording else conv_state
            # in_proj's product of this very tensor, where norm_into_projection made it with the layer's
            # input norm (one rms_norm_linear dispatch); else in_proj's own call.
            handed = self.__dict__.pop("_mps_ext_in_proj_product", None)
            projected = handed[1] if handed is not None and handed[0] is hidden_states else self.in_proj(hidden_states)
            y = op(projected, window, w.view(w.shape[0], -1), b)
            if recording:
                append(window[..., -1:], self.layer_idx, conv_kernel_size=k)
            else:
                count_in_place_step(cache, self.layer_idx)
            return self.out_proj(y)
        return step


    def _mps_ext_takes_product(self, hidden_states: torch.Tensor, kwargs: dict) -> bool:
        """Whether a call with these arguments runs the decode step above,
        which takes in_proj's product of its input from the decoder layer
        (norm_into_projection: the layer's input norm and in_proj in one
        dispatch); elsewhere the layer's own forward calls in_proj itself."""
        return self._mps_ext_fused_call(False, (), {"hidden_states": hidden_states, **kwargs}) is not None


def _fused_class(cls: type) -> type:
    return fused_subclass(FusedShortConvMixin, cls, f"{cls.__name__} with its decode step on "
                          "torch.ops.mps_ext.short_conv_decode (mps_ext.optimize).")


register_maker(FusedShortConvMixin, _fused_class)


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


def _states(mod):
    w = mod.conv.weight

    def make(g):
        return (torch.randn(2, w.shape[0], w.shape[-1], generator=g).to(w.device, w.dtype),)
    return make


def _is_candidate(m) -> bool:
    return isinstance(getattr(m, "conv", None), nn.Conv1d) and \
        all(isinstance(getattr(m, n, None), nn.Module) for n in ("in_proj", "out_proj"))


class ShortConvPass(RecurrentDecodePass):
    """An LFM2 conv layer (module docstring) -> decode on short_conv_decode
    (its class swapped)."""

    name = "short_conv"
    title = "short-convolution layers on torch.ops.mps_ext.short_conv_decode at decode"
    mixin = FusedShortConvMixin
    is_candidate = staticmethod(_is_candidate)
    why_not = staticmethod(why_not)
    fused_class = staticmethod(_fused_class)
    states = staticmethod(_states)

    @staticmethod
    def tolerance(module) -> float:
        return 0.0  # bit for bit: torch's CPU ops' order (tests/ops/test_short_conv.py)

    @staticmethod
    def describe(module) -> str:
        w = module.conv.weight
        return (f"decode on short_conv_decode ({w.shape[0]} channels, window {w.shape[-1]}"
                f"{', bias' if module.conv.bias is not None else ''})")

    def witness(self, model, name):
        return model.get_submodule(name).conv.weight
