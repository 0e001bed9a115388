"""FP8 weights for nn.Linear: `quantize_fp8(model)` halves a model's weight
memory against bf16.

Every selected nn.Linear becomes an FP8Linear holding its weight as
float8_e4m3fn plus fp32 de-quantisation scales:

    granularity="tensor"  one scale for the weight
    granularity="row"     one scale per output feature           (default)
    granularity="block"   one scale per 128 x 128 weight block   (DeepSeek-style)

The forward keeps the activation in its own dtype (bf16, fp16 or fp32) and
de-quantises the weight in registers (torch.ops.mps_ext.fp8_linear, the
kernels of kernels_metal/fp8_mm.metal): the same weight traffic as
quantising the activation to fp8 too, without the activation's rounding
error. It runs on MPS and, through the CPU Metal executor, on CPU tensors.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

__all__ = ["FP8Linear", "quantize_fp8", "quantize_weight"]

E4M3_MAX = 448.0
BLOCK = 128
GRANULARITIES = ("tensor", "row", "block")


def quantize_weight(weight: torch.Tensor, granularity: str = "row") -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, fp32 scale) with weight ~= fp8 * scale; the
    largest magnitude of each scale group maps to 448. Rounding is done in
    float32 on the weight's device (then converted: the fp8 conversion of
    torch on CPU, mps_ext's on MPS)."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if weight.dim() != 2:
        raise ValueError(f"expected a 2-D weight, got {weight.dim()} dimensions")
    w = weight.detach().float()
    n, k = w.shape
    if granularity == "tensor":
        amax = w.abs().amax().reshape(())
        scale = (amax / E4M3_MAX).clamp(min=torch.finfo(torch.float32).tiny)
        q = w / scale
    elif granularity == "row":
        amax = w.abs().amax(dim=1, keepdim=True)
        scale = (amax / E4M3_MAX).clamp(min=torch.finfo(torch.float32).tiny)
        q = w / scale
    else:
        nb, kb = -(-n // BLOCK), -(-k // BLOCK)
        padded = torch.zeros(nb * BLOCK, kb * BLOCK, device=w.device)
        padded[:n, :k] = w
        blocks = padded.view(nb, BLOCK, kb, BLOCK)
        amax = blocks.abs().amax(dim=(1, 3))
        scale = (amax / E4M3_MAX).clamp(min=torch.finfo(torch.float32).tiny)
        q = (blocks / scale[:, None, :, None]).view(nb * BLOCK, kb * BLOCK)[:n, :k]
    # Clamp before converting: fp8 conversion saturates, but say so here.
    q = q.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.contiguous(), scale.contiguous()


class FP8Linear(nn.Module):
    """nn.Linear with a float8_e4m3fn weight and fp32 scales."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, granularity: str = "row",
                 device=None, dtype=torch.bfloat16):
        super().__init__()
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
        self.in_features, self.out_features, self.granularity = in_features, out_features, granularity
        scale_shape = {"tensor": (), "row": (out_features, 1),
                       "block": (-(-out_features // BLOCK), -(-in_features // BLOCK))}[granularity]
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.float8_e4m3fn, device=device))
        self.register_buffer("weight_scale", torch.ones(scale_shape, dtype=torch.float32, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, granularity: str = "row") -> "FP8Linear":
        dtype = linear.weight.dtype if linear.weight.dtype.is_floating_point else torch.bfloat16
        m = cls(linear.in_features, linear.out_features, linear.bias is not None, granularity,
                device=linear.weight.device, dtype=dtype)
        q, s = quantize_weight(linear.weight, granularity)
        m.weight.copy_(q)
        m.weight_scale.copy_(s)
        if linear.bias is not None:
            m.bias.data.copy_(linear.bias.detach())
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias.to(x.dtype) if self.bias is not None and self.bias.dtype != x.dtype else self.bias
        return torch.ops.mps_ext.fp8_linear(x, self.weight, self.weight_scale, self.granularity, bias)

    def extra_repr(self) -> str:
        recipe = {"tensor": "one fp32 scale", "row": "fp32 scale per output row",
                  "block": "fp32 scale per 128x128 block"}[self.granularity]
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"weight=float8_e4m3fn, granularity={self.granularity} ({recipe}), "
                f"activation kept in its dtype, weight de-quantised in registers")


def _default_filter(name: str, module: nn.Linear) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    return leaf not in ("lm_head", "output", "embed_out")


def quantize_fp8(model: nn.Module, granularity: str = "row",
                 filter: Callable[[str, nn.Linear], bool] | None = None) -> nn.Module:
    """Replace every nn.Linear for which filter(qualified_name, module) is
    true (default: all but an LM head named lm_head / output / embed_out)
    by an FP8Linear, in place; returns the model."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    keep = filter or _default_filter
    targets = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, nn.Linear) and keep(name, mod)]
    for name, mod in targets:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, leaf, FP8Linear.from_linear(mod, granularity))
    return model
