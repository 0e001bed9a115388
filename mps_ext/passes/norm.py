"""RMSNorm modules on one dispatch, for `mps_ext.optimize(model)`.

Eager, transformers' RMSNorm is 6 to 8 aten ops a call (to(float32), pow,
mean, add, rsqrt, mul, to, mul), each a host call and a dispatch on a Mac,
and a decoder layer has four or more (input and post-attention norms, the
attention's q and k norms over each head). Each module `fuse_norms`
recognises becomes a FusedRMSNorm, whose forward is one
torch.ops.mps_ext.rms_norm (csrc/ops/norm.cpp, kernels_metal/norm.metal).

Recognised by value, as the MoE pass recognises MoE blocks: a module with one
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
fusing them means replacing those forwards. `qk_norm_rope` is the piece
such a forward calls: the attention's q_norm, k_norm and rotary embedding
as one torch.ops.mps_ext.qk_norm_rope dispatch (docs/optimize.md);
`add_rms_norm` the decoder layer's: its residual add and post-attention
norm as one torch.ops.mps_ext.add_rms_norm dispatch (mps_ext/passes/decoder.py).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from ._protocol import Pass, mismatch
from ._runtime import kernels_for

__all__ = ["FusedRMSNorm", "NormPass", "add_rms_norm", "add_then_norm", "qk_norm_rope", "qk_norm_rope_reference",
           "qk_op_args"]

VARIANTS = ("weight", "zero_centred")
MAX_ROW = 1024 * 8  # norm_params.h: RMS_NORM_MAX_THREADS * RMS_NORM_PER_THREAD
MAX_HEAD_DIM = 256  # norm_params.h: QK_ROPE_MAX_HEAD_DIM
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
    with the norm family on; CPU tensors when a CPU backend is asked for);
    elsewhere, under torch.compile (Inductor fuses these ops with the
    residual add), and where autograd needs a derivative or the weight's
    dtype is not x's, the same steps with torch's ops."""

    def __init__(self, weight: torch.Tensor, eps: float, variant: str):
        super().__init__()
        if variant not in VARIANTS:
            raise ValueError(f"FusedRMSNorm: variant must be one of {VARIANTS}, got {variant!r}")
        # The norm's own Parameter where it has one: an optimizer made before optimize keeps training it.
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight.detach(),
                                                                                   requires_grad=weight.requires_grad)
        self.eps, self.variant = float(eps), variant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.op_takes(x):
            return torch.ops.mps_ext.rms_norm(x, self.weight, self.eps, self.variant)
        return rms_norm_reference(x, self.weight, self.eps, self.variant)

    def op_takes(self, *xs: torch.Tensor, compiled: bool = False) -> bool:
        """Whether the norm's op (rms_norm of x; add_rms_norm of x and a
        residual) runs for these inputs, or torch's ops do. Compiled, only
        where the caller says so (`compiled`): a norm alone is left to
        Inductor, which fuses its ops with their neighbours (the residual
        add before a layer's norms) into one generated kernel, where the op
        would stand between them, one dispatch more; a decoder layer's fused
        path (mps_ext.passes.decoder) has mps_ext's ops for neighbours, the
        residual add in them, and takes the ops compiled as eager."""
        w = self.weight
        x = xs[0]
        return ((compiled or not torch.compiler.is_compiling()) and all(t.dtype == w.dtype for t in xs)
                and x.dtype in _FLOAT and 0 < x.shape[-1] <= MAX_ROW and all(t.shape == x.shape for t in xs)
                and kernels_for(x, "norm")
                and not (torch.is_grad_enabled() and (w.requires_grad or any(t.requires_grad for t in xs))))

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, {self.variant}; torch.ops.mps_ext.rms_norm"


def add_then_norm(x: torch.Tensor, residual: torch.Tensor, norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """add_rms_norm with torch's add and the norm module itself, as a
    decoder layer's forward writes it: (x + residual, norm(x + residual))."""
    h = x + residual
    return h, norm(h)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, norm: FusedRMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoder layer's `h = residual + x` and `norm(h)`: (h, norm(h)), as
    one torch.ops.mps_ext.add_rms_norm dispatch where FusedRMSNorm would run
    its op (FusedRMSNorm.op_takes; x and residual of one shape and dtype),
    else torch's add and the norm module's own forward. The sum is torch's
    add to the bit; the normed rows are rms_norm's of that sum to the bit."""
    if norm.op_takes(x, residual, compiled=True):
        return torch.ops.mps_ext.add_rms_norm(x, residual, norm.weight, norm.eps, norm.variant)
    return add_then_norm(x, residual, norm)


def _eps_of(mod: nn.Module) -> float | str:
    """The eps of a module shaped as an RMSNorm (_is_norm_shaped), or why
    its forward is not one's."""
    eps = next((getattr(mod, a) for a in ("variance_epsilon", "eps") if isinstance(getattr(mod, a, None), float)),
               None)
    if eps is None:
        return "no float variance_epsilon or eps"
    try:
        params = list(inspect.signature(mod.forward).parameters.values())
    except (TypeError, ValueError):
        return "its forward has no signature"
    # One input and nothing else: a gated norm's forward(x, gate=None) is called with its gate.
    if len(params) != 1 or params[0].kind not in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
        return (f"its forward takes ({', '.join(p.name for p in params)}) (a gated norm?): rms_norm takes one "
                "input")
    return eps


def _variant_of(mod: nn.Module, eps: float) -> str | None:
    """The variant of mod's forward, by a probe: the one whose steps give
    its output bit for bit; None if neither does."""
    w = mod.weight
    # Rows of several magnitudes, so that eps and the mean both show.
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4, w.shape[0], generator=g) * torch.tensor([[1e-3], [1.0], [30.0], [1.0]])).to(w.device, w.dtype)
    with torch.no_grad():
        try:
            got = mod(x)
        except Exception:  # noqa: BLE001 - not a norm of one input
            return None
        if not isinstance(got, torch.Tensor) or got.shape != x.shape:
            return None
        for variant in VARIANTS:
            want = rms_norm_reference(x, w, eps, variant)
            if want.dtype == got.dtype and torch.equal(want, got):
                return variant
    return None


def _is_norm_shaped(mod: nn.Module) -> bool:
    """One parameter, `weight` [N], floating, no buffers or children."""
    if isinstance(mod, FusedRMSNorm) or list(mod.children()) or list(mod.buffers(recurse=False)):
        return False
    params = dict(mod.named_parameters(recurse=False))
    w = params.get("weight")
    return len(params) == 1 and w is not None and w.dim() == 1 and w.dtype in _FLOAT


class _NormPlan:
    def __init__(self, eps: float):
        self.eps, self.variant = eps, None


class NormPass(Pass):
    """An RMSNorm module (module docstring) -> FusedRMSNorm."""

    name = "norms"
    title = "RMSNorms on torch.ops.mps_ext.rms_norm (one dispatch each)"
    after = ("linear_attention",)  # the Gated DeltaNet pass takes the layers' gated norms as they are

    def candidates(self, model):
        return [name for name, mod in model.named_modules()
                if name and (isinstance(mod, FusedRMSNorm) or _is_norm_shaped(mod))]

    def already(self, module):
        return isinstance(module, FusedRMSNorm)

    def plan(self, model, name, module):
        if module.weight.device.type == "meta":
            return "on the meta device: nothing to probe"
        eps = _eps_of(module)
        return eps if isinstance(eps, str) else _NormPlan(eps)

    def probe(self, model, name, module, plan):
        plan.variant = _variant_of(module, plan.eps)
        if plan.variant is None:
            return mismatch("its output on a probe is neither RMSNorm variant's (weight * normed, or normed * "
                            "(1 + weight)) bit for bit")
        return None

    def apply(self, model, name, module, plan):
        parent_name, _, leaf = name.rpartition(".")
        fused = FusedRMSNorm(module.weight, plan.eps, plan.variant)
        fused.train(module.training)
        setattr(model.get_submodule(parent_name) if parent_name else model, leaf, fused)
        return f"{type(module).__name__} -> FusedRMSNorm ({plan.variant}, eps={plan.eps:g})"

    def witness(self, model, name):
        return model.get_submodule(name).weight


def rope_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' apply_rotary_pos_emb on [B, H, T, D] q and k with cos
    and sin [B, T, R], rotate_half convention: the first R elements rotate,
    the rest pass (R = D: Qwen3, LFM2; R < D: Qwen3.5's partial rotary), the
    models' ops in their order, so each rounds where theirs does."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    r = cos.shape[-1]

    def rotate(x):
        x_rot, x_pass = x[..., :r], x[..., r:]
        x1, x2 = x_rot[..., : r // 2], x_rot[..., r // 2:]
        out = (x_rot * cos) + (torch.cat((-x2, x1), dim=-1) * sin)
        return torch.cat([out, x_pass], dim=-1) if x_pass.shape[-1] else out

    return rotate(q), rotate(k)


def _norm_of(mod: nn.Module | None) -> tuple[torch.Tensor | None, float | None, str | None] | None:
    """(weight, eps, variant) of a q or k norm the op computes: a
    FusedRMSNorm, or none at all ((None, None, None)); None otherwise."""
    if mod is None:
        return None, None, None
    if isinstance(mod, FusedRMSNorm):
        return mod.weight, mod.eps, mod.variant
    return None


def _op_takes(q, k, cos, sin, qn, kn) -> bool:
    """Whether torch.ops.mps_ext.qk_norm_rope runs these (qn, kn from
    _norm_of, neither None)."""
    if torch.compiler.is_compiling():  # Inductor fuses the same ops into its own kernels
        return False
    if len({n[1:] for n in (qn, kn) if n[0] is not None}) > 1:  # one eps and variant for both
        return False
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or cos.shape != sin.shape:
        return False
    d, r = q.shape[-1], cos.shape[-1]
    if k.shape[-1] != d or d > MAX_HEAD_DIM or r % 2 or not 2 <= r <= d or 2 * -(-r // 64) + -(-(d - r) // 32) > 8:
        return False  # norm_params.h: QK_ROPE_SLOTS
    tensors = [q, k, cos, sin] + [n[0] for n in (qn, kn) if n[0] is not None]
    if q.dtype not in _FLOAT or any(t.dtype != q.dtype for t in tensors):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):  # no derivative
        return False
    return kernels_for(q, "norm")


def qk_op_args(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               q_norm: nn.Module | None, k_norm: nn.Module | None) -> tuple | None:
    """(q_weight, k_weight, eps, variant): what torch.ops.mps_ext.qk_norm_rope
    (and qk_norm_rope_append) take after q, k, cos and sin, where it runs
    these (qk_norm_rope's docstring); None where it does not."""
    qn, kn = _norm_of(q_norm), _norm_of(k_norm)
    if qn is None or kn is None or not _op_takes(q, k, cos, sin, qn, kn):
        return None
    given = [n for n in (qn, kn) if n[0] is not None]
    eps, variant = given[0][1:] if given else (1e-6, "weight")  # no norm: unused
    return qn[0], kn[0], eps, variant


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 q_norm: nn.Module | None = None, k_norm: nn.Module | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """An attention's `q_norm(q).transpose(1, 2)`, `k_norm(k).transpose(1, 2)`
    and `apply_rotary_pos_emb(q, k, cos, sin)` (transformers' Qwen3, Qwen3-MoE,
    Qwen3.5/3.6-MoE, LFM2-MoE), from the pieces its forward has: q [B, T, Hq,
    D] and k [B, T, Hk, D] (the projections' outputs viewed as heads; strided
    views do), position_embeddings' cos and sin [B, T, R], and its q and k
    norm modules (None where the model has none). Returns q and k [B, H, T,
    D].

    One torch.ops.mps_ext.qk_norm_rope dispatch where mps_ext's kernels run
    (MPS with the norm family on; CPU tensors when a CPU backend is asked
    for) and the norms are FusedRMSNorm (mps_ext.optimize makes them so) of
    one eps and variant; elsewhere (no CPU backend asked for, under torch.compile, where
    autograd needs a derivative, other dtypes or norms) the same steps with
    torch's ops and the norm modules themselves."""
    args = qk_op_args(q, k, cos, sin, q_norm, k_norm)
    if args is not None:
        return torch.ops.mps_ext.qk_norm_rope(q, k, cos, sin, *args)
    return qk_norm_rope_reference(q, k, cos, sin, q_norm, k_norm)


def qk_norm_rope_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           q_norm: nn.Module | None = None, k_norm: nn.Module | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """qk_norm_rope with torch's ops and the norm modules themselves: the
    attention's own steps, in its order (what qk_norm_rope runs where the
    op does not, and what mps_ext.optimize probes an attention with)."""
    if q_norm is not None:
        q = q_norm(q)
    if k_norm is not None:
        k = k_norm(k)
    return rope_reference(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
