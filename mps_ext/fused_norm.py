"""RMSNorm modules on one dispatch, for `mps_ext.optimize(model)`.

Eager, transformers' RMSNorm is 6 to 8 aten ops a call (to(float32), pow,
mean, add, rsqrt, mul, to, mul), each a host call and a dispatch on a Mac,
and a decoder layer has four or more (input and post-attention norms, the
attention's q and k norms over each head). Each module `fuse_norms`
recognises becomes a FusedRMSNorm, whose forward is one
torch.ops.mps_ext.rms_norm (csrc/ops/norm.cpp, kernels_metal/norm.metal).

Recognised by value, as fused_moe recognises MoE blocks: a module with one
parameter, `weight` [N] (floating), no buffers or children, an
`variance_epsilon` or `eps` float, a forward of one tensor, whose output on
a probe is bit-identical to one of the two variants computed with torch's
ops, step for step:
- "weight" (Llama, Qwen3, Qwen3-MoE, LFM2): weight * normed.to(x.dtype);
- "zero_centred" (Qwen3-Next, Qwen3.5/3.6, Gemma): (normed * (1 + weight.float())).to(x.dtype);
with normed = x.float() * rsqrt(x.float().pow(2).mean(-1) + eps). Gated
norms (two inputs, the linear-attention mixers') are not RMSNorms of this
kind and are left.

What the fusion cannot reach through module replacement: the residual add
before a norm and the rotary embedding after the q and k norms are in the
decoder layer's and attention's own forward (a function of the modeling
module, apply_rotary_pos_emb, called between q_norm and the cache update):
fusing them would mean replacing those forwards.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from .fused_moe import _kernels_for

__all__ = ["FusedRMSNorm", "fuse_norms"]

VARIANTS = ("weight", "zero_centred")
MAX_ROW = 1024 * 8  # norm_params.h: RMS_NORM_MAX_THREADS * RMS_NORM_PER_THREAD
_FLOAT = (torch.float32, torch.float16, torch.bfloat16)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, variant: str) -> torch.Tensor:
    """The variant with torch's ops, in the models' steps: what the kernel
    computes, and what FusedRMSNorm runs where the kernel does not."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if variant == "zero_centred":
        return (h * (1.0 + weight.float())).type_as(x)
    return weight * h.to(x.dtype)


class FusedRMSNorm(nn.Module):
    """An RMSNorm of the last dimension, forward(x [..., N]) -> [..., N], as
    one torch.ops.mps_ext.rms_norm dispatch where mps_ext's kernels run (MPS
    with the norm family on; CPU tensors when the executor is asked for);
    elsewhere, under torch.compile (Inductor fuses these ops with the
    residual add), and where autograd needs a derivative or the weight's
    dtype is not x's, the same steps with torch's ops."""

    def __init__(self, weight: torch.Tensor, eps: float, variant: str):
        super().__init__()
        if variant not in VARIANTS:
            raise ValueError(f"FusedRMSNorm: variant must be one of {VARIANTS}, got {variant!r}")
        self.weight = nn.Parameter(weight.detach(), requires_grad=weight.requires_grad)
        self.eps, self.variant = float(eps), variant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        # Compiled, Inductor fuses the norm's ops with their neighbours (the
        # residual add before a layer's norms) into one generated kernel; the
        # op would stand between them, one dispatch more.
        if (not torch.compiler.is_compiling() and x.dtype == w.dtype and x.dtype in _FLOAT and 0 < x.shape[-1] <= MAX_ROW and _kernels_for(x, "norm")
                and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))):  # no derivative
            return torch.ops.mps_ext.rms_norm(x, w, self.eps, self.variant)
        return rms_norm_reference(x, w, self.eps, self.variant)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, {self.variant}; torch.ops.mps_ext.rms_norm"


def _variant_of(mod: nn.Module) -> tuple[float, str] | None:
    """(eps, variant) of an RMSNorm module, by its structure and a probe;
    None if it is not one."""
    if isinstance(mod, FusedRMSNorm) or list(mod.children()) or list(mod.buffers(recurse=False)):
        return None
    params = dict(mod.named_parameters(recurse=False))
    w = params.get("weight")
    if len(params) != 1 or w is None or w.dim() != 1 or w.dtype not in _FLOAT or w.device.type == "meta":
        return None
    eps = next((getattr(mod, a) for a in ("variance_epsilon", "eps") if isinstance(getattr(mod, a, None), float)),
               None)
    if eps is None:
        return None
    try:
        if len([p for p in inspect.signature(mod.forward).parameters.values()
                if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]) != 1:
            return None
    except (TypeError, ValueError):
        return None
    # Rows of several magnitudes, so that eps and the mean both show.
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4, w.shape[0], generator=g) * torch.tensor([[1e-3], [1.0], [30.0], [1.0]])).to(w.device, w.dtype)
    with torch.no_grad():
        try:
            got = mod(x)
        except Exception:
            return None
        if not isinstance(got, torch.Tensor) or got.shape != x.shape:
            return None
        for variant in VARIANTS:
            want = rms_norm_reference(x, w, eps, variant)
            if want.dtype == got.dtype and torch.equal(want, got):
                return eps, variant
    return None


def fuse_norms(model: nn.Module) -> dict[str, str]:
    """Replace, in place, each RMSNorm module of `model` (module docstring)
    by a FusedRMSNorm; returns qualified name -> what it became."""
    plans = []
    for name, mod in model.named_modules():
        if not name:
            continue
        found = _variant_of(mod)
        if found is not None:
            plans.append((name, mod, *found))
    out = {}
    for name, mod, eps, variant in plans:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        fused = FusedRMSNorm(mod.weight, eps, variant)
        fused.train(mod.training)
        setattr(parent, leaf, fused)
        out[name] = f"{type(mod).__name__} -> FusedRMSNorm ({variant}, eps={eps:g})"
    return out
