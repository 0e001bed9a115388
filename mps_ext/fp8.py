"""FP8 weights for nn.Linear and mixture-of-experts banks: `quantize_fp8(model)`
halves a model's weight memory against bf16.

Every selected nn.Linear becomes an FP8Linear holding its weight as
float8_e4m3fn plus fp32 de-quantisation scales:

    granularity="tensor"  one scale for the weight
    granularity="row"     one scale per output feature           (default)
    granularity="block"   one scale per 128 x 128 weight block   (DeepSeek-style)

The forward keeps the activation in its own dtype (bf16, fp16 or fp32) and
de-quantises the weight in registers (torch.ops.mps_ext.fp8_linear, the
kernels of kernels_metal/scaled_mm.metal): the same weight traffic as
quantising the activation to fp8 too, without the activation's rounding
error. On CPU tensors the modules compute the same product with torch's own
CPU ops (the weight de-quantised in memory): a backend that runs the Metal
kernels on CPU tensors (a test's: mps_ext/_cpu_backend.py) is thousands of
times slower than a CPU library, so it runs only inside its request() (tests,
the model runner).

Every selected module holding a mixture-of-experts layer's expert banks as
3-D parameters `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I]
(transformers 5's experts modules; also [E, H, 2I] / [E, I, H] where the
module says `is_transposed`, and gate and up rows interleaved where it says
`is_concatenated=False`) with a SiLU gate, called as experts(hidden_states,
top_k_index, top_k_weights), becomes an FP8Experts: float8_e4m3fn banks with
one fp32 scale per expert output row (whatever `granularity`: the recipe of
the grouped fp8 kernels, kernels_metal/grouped_mm.metal), run by mps_ext's
MoE ops. The gate is checked by value (the module's own gate evaluated on a
probe), since transformers' activations are classes of its own.

The fp8 modules keep their storage dtypes through `.to(dtype)`, `.half()`,
`.float()` and the like (device moves apply, casts do not), and quantize_fp8
says what it converted and what it left (FP8Summary).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import re
import sys
import warnings
from typing import Callable

import torch
from torch import nn

from . import _cpu_backend

__all__ = ["FP8Experts", "FP8Linear", "FP8Summary", "quantize_fp8", "quantize_weight"]

logger = logging.getLogger(__name__)

E4M3_MAX = 448.0
BLOCK = 128
GRANULARITIES = ("tensor", "row", "block")


# Bytes of float32 temporaries quantize_weight holds at a time: a weight is
# quantized a slab of rows at a time into its fp8 output, so converting a
# model needs its new fp8 weights and this much beyond them, not float32
# copies of a whole weight (2.25x an expert bank's bf16 bytes).
TEMP_BYTES = 16 << 20


def _amax(t: torch.Tensor, dim=None) -> torch.Tensor:
    """max |t| over `dim` (all if None) in float32, without a |t| copy."""
    hi, lo = (t.amax(), t.amin()) if dim is None else (t.amax(dim), t.amin(dim))
    return torch.maximum(hi, -lo).float()


def _scale_of(amax: torch.Tensor) -> torch.Tensor:
    return (amax / E4M3_MAX).clamp(min=torch.finfo(torch.float32).tiny)


def _row_slabs(rows: int, row_bytes: int, multiple: int = 1):
    """(start, stop) of consecutive row ranges whose float32 copies take at
    most TEMP_BYTES (at least `multiple` rows, a multiple of it)."""
    step = max(1, TEMP_BYTES // max(1, row_bytes * multiple)) * multiple
    return [(r, min(rows, r + step)) for r in range(0, rows, step)]


def _to_fp8_(q: torch.Tensor, w: torch.Tensor) -> None:
    """q[...] = w (float32, already divided by its scales), clamped first:
    the fp8 conversion saturates, but say so here."""
    q.copy_(w.clamp_(-E4M3_MAX, E4M3_MAX))


def quantize_weight(weight: torch.Tensor, granularity: str = "row") -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, fp32 scale) with weight ~= fp8 * scale; the
    largest magnitude of each scale group maps to 448. Rounding is done in
    float32 on the weight's device (then converted: the fp8 conversion of
    torch on CPU, mps_ext's on MPS), a slab of rows at a time (TEMP_BYTES of
    float32 at most beyond the fp8 output). A 2-D weight [N, K] takes any
    granularity (scales: [], [N, 1], [ceil(N/128), ceil(K/128)]); a 3-D
    expert bank [E, N, K] is quantized by row (scales [E, N], what the
    grouped fp8 kernels take)."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if weight.dim() not in (2, 3) or (weight.dim() == 3 and granularity != "row"):
        raise ValueError(f"expected a 2-D weight, or a 3-D expert bank with granularity 'row'; got "
                         f"{weight.dim()} dimensions and {granularity!r}")
    weight = weight.detach()
    n, k = weight.shape[-2:]
    dev, f32 = weight.device, torch.float32
    q = torch.empty(weight.shape, dtype=torch.float8_e4m3fn, device=dev)
    if granularity == "block":
        nb, kb = -(-n // BLOCK), -(-k // BLOCK)
        scale = torch.empty(nb, kb, dtype=f32, device=dev)
        for r0, r1 in _row_slabs(n, 4 * kb * BLOCK, BLOCK):
            rb = -(-(r1 - r0) // BLOCK)
            padded = torch.zeros(rb * BLOCK, kb * BLOCK, dtype=f32, device=dev)
            padded[:r1 - r0, :k] = weight[r0:r1]
            blocks = padded.view(rb, BLOCK, kb, BLOCK)
            s = _scale_of(_amax(blocks, (1, 3)))
            scale[r0 // BLOCK:r0 // BLOCK + rb] = s
            blocks.div_(s[:, None, :, None])
            _to_fp8_(q[r0:r1], padded[:r1 - r0, :k])
        return q, scale
    matrices = [(q, weight)] if weight.dim() == 2 else list(zip(q, weight))
    if granularity == "tensor":
        scale = _scale_of(torch.stack([_amax(weight[r0:r1]) for r0, r1 in _row_slabs(n, 4 * k)]).amax())
    else:  # [N, 1] for a matrix, [E, N] for a bank
        scale = torch.empty(weight.shape[:-1] + ((1,) if weight.dim() == 2 else ()), dtype=f32, device=dev)
    for i, (qm, wm) in enumerate(matrices):
        for r0, r1 in _row_slabs(n, 4 * k):
            w = wm[r0:r1].to(f32, copy=True)  # a float32 weight's own storage must not be divided in place
            if granularity == "row":
                s = _scale_of(_amax(w, -1))
                (scale[r0:r1, 0] if weight.dim() == 2 else scale[i, r0:r1]).copy_(s)
                w.div_(s[:, None])
            else:
                w.div_(scale)
            _to_fp8_(qm[r0:r1], w)
    return q, scale


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, granularity: str = "row") -> torch.Tensor:
    """The float32 weight that quantize_weight's (q, scale) stand for: what
    the kernels de-quantise in registers, for the CPU path of the fp8
    modules."""
    w = q.to(torch.float32)
    if granularity == "block":
        n, k = w.shape
        s = scale.repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]
    else:  # one scale, or one per row ([N, 1], or [E, N] for a 3-D bank)
        s = scale.reshape(w.shape[:-1] + (1,)) if granularity == "row" else scale.reshape(())
    return w * s


def _cpu_kernels_requested() -> bool:
    return _cpu_backend.requested()


# Dynamo cannot trace a ContextVar: it takes the answer when it traces a
# graph (compile inside request() to trace the kernels' path). This is what
# torch.compiler.assume_constant_result sets (torch 2.0-2.15), without
# importing dynamo at `import mps_ext`.
_cpu_kernels_requested._dynamo_marked_constant = True


def _use_torch_cpu_ops(x: torch.Tensor) -> bool:
    """CPU tensors take torch's own CPU ops unless a CPU backend's kernels
    were asked for: a Metal kernel on the CPU is thousands of times slower than a
    CPU library, and users quantize on the CPU and try a forward before
    moving the model to MPS."""
    return x.device.type == "cpu" and not _cpu_kernels_requested()


class _FP8Module(nn.Module):
    """Base of the fp8 modules: their buffers (float8 weights, fp32 scales)
    are stored in fixed dtypes, and a model-wide `.to(dtype)`, `.half()`,
    `.bfloat16()` or `.float()` must not cast them (a cast fp8 weight is no
    longer what the kernels take; an fp16 scale loses precision).
    Parameters (an FP8Linear's bias) follow the requested dtype; device
    moves, `to_empty` and the rest apply to everything."""

    def _apply(self, fn, recurse=True):
        kept = {id(b) for b in self._buffers.values() if b is not None}
        return super()._apply(lambda t: without_casts(fn, t) if id(t) in kept else fn(t), recurse)


def without_casts(fn, t: torch.Tensor) -> torch.Tensor:
    """What a module-wide `_apply` function `fn` does to t, but casts: a
    tensor stored in a fixed dtype (fp8 weights, fp32 scales) moves with
    the model and keeps its dtype."""
    # What fn does to floating-point tensors, learnt on empty ones of two
    # dtypes (any cast changes one of them; not float8, whose conversions on
    # MPS before torch 2.15 are mps_ext's fp8 family, which may be turned
    # off): if it casts, take its device only.
    probes = [(fn(torch.empty(0, dtype=d, device=t.device)), d) for d in (torch.float16, torch.float32)]
    if all(p.dtype == d for p, d in probes):
        return fn(t)
    return t.to(probes[0][0].device)


_INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, granularity: str,
               bias: torch.Tensor | None) -> torch.Tensor:
    """FP8Linear's product (x @ weight^T, de-quantised, + bias) in x's dtype,
    on any device: torch.ops.mps_ext.fp8_linear, or on CPU tensors without
    a CPU backend asked for the kernels' math with torch's ops. Differentiable in x and
    bias (the fp8 weight is frozen): on every path the gradient of x is
    grad_out @ the de-quantised weight (_FP8LinearFunction)."""
    bias = bias.to(x.dtype) if bias is not None and bias.dtype != x.dtype else bias
    if _needs_grad(x, bias):
        return _FP8LinearFunction.apply(x, weight, weight_scale, granularity, bias)
    return _fp8_linear_forward(x, weight, weight_scale, granularity, bias)


def _fp8_linear_forward(x, weight, weight_scale, granularity, bias):
    if _use_torch_cpu_ops(x):
        if x.dtype not in _INPUT_DTYPES:  # the op's own check, for the same error on every device
            raise RuntimeError(f"mps_ext fp8_linear: input must be float32, float16 or bfloat16, got {x.dtype}")
        # The kernels' math: weight de-quantised in float32, float32 sums.
        return nn.functional.linear(x.float(), dequantize_weight(weight, weight_scale, granularity),
                                    None if bias is None else bias.float()).to(x.dtype)
    return torch.ops.mps_ext.fp8_linear(x, weight, weight_scale, granularity, bias)


class _FP8LinearFunction(torch.autograd.Function):
    """fp8_linear with a backward: the forward is the same product (the
    kernels, or torch's CPU ops), and the gradients are those of
    x @ W^T + bias for W the de-quantised weight, computed in float32
    (the weight de-quantised in memory, for the backward only). The fp8
    weight and its scales get none: they are frozen buffers."""

    @staticmethod
    def forward(ctx, x, weight, weight_scale, granularity, bias):
        ctx.save_for_backward(weight, weight_scale)
        ctx.granularity, ctx.has_bias = granularity, bias is not None
        with torch.no_grad():
            return _fp8_linear_forward(x, weight, weight_scale, granularity, bias)

    @staticmethod
    def backward(ctx, grad_out):
        weight, weight_scale = ctx.saved_tensors
        g = grad_out.float()
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = (g @ dequantize_weight(weight, weight_scale, ctx.granularity)).to(grad_out.dtype)
        if ctx.has_bias and ctx.needs_input_grad[4]:
            grad_bias = g.reshape(-1, g.shape[-1]).sum(0).to(grad_out.dtype)
        return grad_x, None, None, None, grad_bias


class FP8Linear(_FP8Module):
    """nn.Linear with a float8_e4m3fn weight and fp32 scales. The output has
    the input's dtype (the bias is cast to it if it differs)."""

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
        self.bias = (
            nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None
        )

    @classmethod
    def from_linear(cls, linear: nn.Linear, granularity: str = "row") -> "FP8Linear":
        """`linear` quantized. Its bias is copied with its requires_grad (it
        can be trained); the fp8 weight is a buffer (frozen). Allocates only
        the new weight (and quantize_weight's TEMP_BYTES)."""
        dtype = linear.weight.dtype if linear.weight.dtype.is_floating_point else torch.bfloat16
        q, s = quantize_weight(linear.weight, granularity)
        m = cls(linear.in_features, linear.out_features, False, granularity, device="meta", dtype=dtype)
        m.weight, m.weight_scale = q, s
        if linear.bias is not None:
            m.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=linear.bias.requires_grad)
        return m

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [out_features, in_features] this layer stands for."""
        return dequantize_weight(self.weight, self.weight_scale, self.granularity)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale, self.granularity, self.bias)

    def extra_repr(self) -> str:
        recipe = {"tensor": "one fp32 scale", "row": "fp32 scale per output row",
                  "block": "fp32 scale per 128x128 block"}[self.granularity]
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"weight=float8_e4m3fn, granularity={self.granularity} ({recipe}), "
                f"activation kept in its dtype, weight de-quantised in registers")


@torch.library.custom_op("mps_ext::fp8_grouped_linear", mutates_args=())
def _fp8_grouped_linear(rows: torch.Tensor, bank: torch.Tensor, bank_scale: torch.Tensor,
                        offs: torch.Tensor) -> torch.Tensor:
    """FP8Experts' prefill product: rows [R, K] (bf16, sorted by expert,
    offs the cumulative row counts) @ bank[e]^T ([E, N, K] e4m3fn, [E, N]
    fp32 scales), the rows quantised to e4m3 row-wise first -> [R, N] bf16.
    One opaque op so that torch.compile hands inductor no float8 tensor op
    of aten to lower (inductor's Metal code generator has no float8 type,
    torch 2.9-2.15). Its Meta kernel is in mps_ext/_meta.py."""
    a8, sa = quantize_weight(rows, "row")
    out = torch.ops.mps_ext._scaled_grouped_mm(a8, bank.transpose(-2, -1), sa.reshape(-1), bank_scale, offs)
    return out.contiguous()  # the grouped kernels pad rows to 16 bytes; the Meta kernel says contiguous


def sort_slots(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(offs, slot_of_row, row_of_slot), int32, of the mixture-of-experts
    ops for routing top_k_index [T, k]: slot t * k + j sorted by expert on
    the device (argsort, index_add_, cumsum), nothing read on the host."""
    flat = top_k_index.reshape(-1)
    rows, device = flat.numel(), flat.device
    slot_of_row = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
    counts.index_add_(0, flat, torch.ones(rows, dtype=torch.int32, device=device))
    offs = counts.cumsum(0, dtype=torch.int32)
    row_of_slot = torch.empty_like(slot_of_row).scatter_(0, slot_of_row, torch.arange(rows, device=device))
    return offs, slot_of_row.to(torch.int32), row_of_slot.to(torch.int32)


class FP8Experts(_FP8Module):
    """A mixture-of-experts layer's expert banks in float8_e4m3fn with an fp32
    scale per expert output row, called as transformers' experts modules are:
    forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])
    -> [T, H] in hidden_states' dtype, each token's chosen experts'
    SiLU-gated MLPs summed with its weights. The tokens' slots are sorted by
    expert on the device (argsort, index_add_, cumsum): nothing is read on
    the host.

    Decode (up to 1024 routed rows, T * k): torch.ops.mps_ext.moe_experts
    (gather + gate/up + SiLU, then down; bfloat16 activations, the weights
    de-quantised in registers: each chosen expert's bytes read once) and
    moe_combine, four dispatches. More rows: the activations are quantised
    row-wise to e4m3 as well and the products are _scaled_grouped_mm's tiles
    (prefill accuracy is then that of fp8 activations; mps_ext::
    fp8_grouped_linear). On CPU tensors (unless a CPU backend is asked for)
    torch's CPU ops compute the decode math for any number of rows."""

    DECODE_ROWS = 1024  # moe_experts' limit

    def __init__(self, num_experts: int, hidden: int, intermediate: int, device=None):
        super().__init__()
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        f8 = dict(dtype=torch.float8_e4m3fn, device=device)
        self.register_buffer("gate_up_proj", torch.zeros(num_experts, 2 * intermediate, hidden, **f8))
        self.register_buffer("gate_up_scale", torch.ones(num_experts, 2 * intermediate, device=device))
        self.register_buffer("down_proj", torch.zeros(num_experts, hidden, intermediate, **f8))
        self.register_buffer("down_scale", torch.ones(num_experts, hidden, device=device))

    @staticmethod
    def why_not_convertible(module: nn.Module, on_meta: bool = False) -> str | None:
        """None if `module` holds expert banks FP8Experts can run, else why not
        (on_meta: see _bank_views)."""
        banks = _bank_views(module, on_meta)
        return banks if isinstance(banks, str) else None

    @staticmethod
    def convertible(module: nn.Module) -> bool:
        """Whether `module` holds expert banks FP8Experts can run."""
        return FP8Experts.why_not_convertible(module) is None

    @classmethod
    def from_experts(cls, module: nn.Module) -> "FP8Experts":
        """An FP8Experts holding `module`'s banks quantized; ValueError
        saying why if FP8Experts cannot run them. Allocates only the new
        banks (and quantize_weight's TEMP_BYTES, a slab at a time)."""
        banks = _bank_views(module)
        if isinstance(banks, str):
            raise ValueError(f"{type(module).__name__} cannot become an FP8Experts: {banks}")
        gate_up, down, concatenated = banks
        e, two_i, h = gate_up.shape
        m = cls(e, h, two_i // 2, device="meta")
        m.gate_up_proj, m.gate_up_scale = _quantize_bank(gate_up, concatenated)
        m.down_proj, m.down_scale = _quantize_bank(down)
        return m

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        if _needs_grad(hidden_states, top_k_weights):
            return _FP8ExpertsFunction.apply(self, hidden_states, top_k_index, top_k_weights)
        return self._compute(hidden_states, top_k_index, top_k_weights, _use_torch_cpu_ops(hidden_states))

    def _compute(self, hidden_states, top_k_index, top_k_weights, torch_ops: bool):
        x = hidden_states.reshape(-1, self.hidden).to(torch.bfloat16)
        top_k_index = top_k_index.reshape(x.shape[0], -1)
        weights = top_k_weights.reshape(top_k_index.shape).to(torch.float32).contiguous()
        if torch_ops:
            out = self._forward_with_torch_ops(x, top_k_index, weights)
        else:
            out = self._forward_with_kernels(x, top_k_index, weights)
        return out.to(hidden_states.dtype).reshape(hidden_states.shape)

    def _forward_with_kernels(self, x, top_k_index, weights):
        ops = torch.ops.mps_ext
        k = top_k_index.shape[1]
        offs, slot_of_row, row_of_slot = sort_slots(top_k_index, self.num_experts)
        if slot_of_row.numel() <= self.DECODE_ROWS:
            h = ops.moe_experts(x, self.gate_up_proj, self.gate_up_scale, offs, slot_of_row, k, True)
            y = ops.moe_experts(h, self.down_proj, self.down_scale, offs)
        else:
            xs = x[slot_of_row.long() // k]
            gate, up = ops.fp8_grouped_linear(xs, self.gate_up_proj, self.gate_up_scale, offs).float().chunk(2, -1)
            y = ops.fp8_grouped_linear((nn.functional.silu(gate) * up).bfloat16(), self.down_proj, self.down_scale,
                                       offs)
        return ops.moe_combine(y, weights, row_of_slot)

    def _forward_with_torch_ops(self, x, top_k_index, weights):
        """moe_experts' and moe_combine's math with torch's CPU ops: bf16
        activations, each chosen expert's weights de-quantised in float32
        (one expert at a time: no copy of a whole bank), float32 sums, the
        gated activations, each expert's output and the sum rounded to bf16
        where the kernels store them. Differentiable in x and weights (the
        backward of _FP8ExpertsFunction, on any device)."""
        tokens, k = top_k_index.shape
        flat = top_k_index.reshape(-1)
        if flat.numel() and not 0 <= int(flat.min()) <= int(flat.max()) < self.num_experts:
            raise ValueError(f"FP8Experts: top_k_index must hold experts 0 to {self.num_experts - 1}, got "
                             f"{int(flat.min())} to {int(flat.max())}")
        order = torch.argsort(flat, stable=True)
        xs = x[order // k].float()
        ys = torch.empty(flat.numel(), self.hidden, device=x.device)
        start = 0
        for e, n in enumerate(torch.bincount(flat, minlength=self.num_experts).tolist()):
            if n:
                gu = dequantize_weight(self.gate_up_proj[e], self.gate_up_scale[e])
                gate, up = (xs[start:start + n] @ gu.T).chunk(2, -1)
                h = (nn.functional.silu(gate) * up).bfloat16().float()
                dn = dequantize_weight(self.down_proj[e], self.down_scale[e])
                ys[start:start + n] = (h @ dn.T).bfloat16().float()
                start += n
        y = torch.empty_like(ys)
        y[order] = ys
        return (y.view(tokens, k, self.hidden) * weights[..., None]).sum(1).bfloat16()

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden={self.hidden}, intermediate={self.intermediate}, "
                f"weights=float8_e4m3fn, fp32 scale per expert output row, SiLU gate; decode: bfloat16 "
                f"activations, weights de-quantised in registers")


class _FP8ExpertsFunction(torch.autograd.Function):
    """FP8Experts with a backward: the forward runs the module's own path
    (the kernels, or torch's CPU ops); the backward recomputes the layer
    with torch's ops (the de-quantised float32 math of
    _forward_with_torch_ops, one expert at a time) with autograd on and
    returns its gradients of hidden_states and top_k_weights. The fp8
    banks get none: they are frozen buffers."""

    @staticmethod
    def forward(ctx, experts, hidden_states, top_k_index, top_k_weights):
        ctx.experts = experts
        ctx.save_for_backward(hidden_states, top_k_index, top_k_weights)
        with torch.no_grad():
            return experts._compute(hidden_states, top_k_index, top_k_weights, _use_torch_cpu_ops(hidden_states))

    @staticmethod
    def backward(ctx, grad_out):
        hidden_states, top_k_index, top_k_weights = ctx.saved_tensors
        wanted = [ctx.needs_input_grad[1], ctx.needs_input_grad[3]]
        with torch.enable_grad():
            x = hidden_states.detach().requires_grad_(wanted[0])
            w = top_k_weights.detach().requires_grad_(wanted[1])
            out = ctx.experts._compute(x, top_k_index, w, torch_ops=True)
            inputs = [t for t, want in zip((x, w), wanted) if want]
            grads = iter(torch.autograd.grad(out, inputs, grad_out))
        grad_x, grad_w = (next(grads) if want else None for want in wanted)
        return None, grad_x, None, grad_w


# ---------------------------------------------------------------- expert banks --
_BANK_NAMES = ("gate_up_proj", "up_proj", "down_proj")
_QUANTIZABLE = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _holds_expert_banks(module: nn.Module) -> bool:
    """A mixture-of-experts layer's experts as 3-D parameters (transformers
    5's layout), whether FP8Experts can run them or not."""
    return not isinstance(module, FP8Experts) and any(
        isinstance(getattr(module, n, None), torch.Tensor) and getattr(module, n).dim() == 3 for n in _BANK_NAMES)


def _takes_routing(module: nn.Module) -> bool:
    """Whether forward takes (hidden_states, top_k_index, top_k_weights), as
    FP8Experts does (Llama 4's experts take pre-grouped hidden states only)."""
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return True  # cannot tell
    kinds = [p.kind for p in params]
    positional = sum(k in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD) for k in kinds)
    return positional >= 3 or inspect.Parameter.VAR_POSITIONAL in kinds


def _silu_probe(inter: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """gate and up values [rows, inter] for _gate_is_not_silu: every value of
    a SiLU's shape (-20 to 20) and magnitudes past any clamp of a gate or up
    (GPT-OSS and DeepSeek-V4 clamp at 7-10), paired differently in gate and
    up."""
    # Made on the CPU explicitly: load_fp8 plans a bf16 load under transformers' torch.device("meta").
    values = torch.cat([torch.linspace(-20, 20, 401, device="cpu"),
                        torch.tensor([-1e4, -1e3, -100.0, -50.0, 50.0, 100.0, 1e3, 1e4], device="cpu")])  # 409, a prime
    rows = -(-values.numel() // inter)
    i = torch.arange(rows * inter, device="cpu")
    return (values[i % values.numel()].view(rows, inter).to(device),
            values[(7 * i + 3) % values.numel()].view(rows, inter).to(device))


def _gate_is_not_silu(module: nn.Module, inter: int, concatenated: bool, device) -> str | None:
    """None if the module's gate computes SiLU(gate) * up, else why not. By
    value, not by class: transformers' ACT2FN["silu"] is a class of its own,
    and a model's _apply_gate may clamp or scale (GPT-OSS, DeepSeek-V4,
    MiniMax-M3). transformers' experts gate through _apply_gate in every
    backend; other modules through act_fn(gate) * up."""
    apply, act = getattr(module, "_apply_gate", None), getattr(module, "act_fn", None)
    if callable(apply):
        what = f"{type(module).__name__}._apply_gate" + (f" with act_fn {_name(act)}" if act is not None else "")
    elif callable(act):
        what = f"act_fn {_name(act)}"
    else:
        return "no act_fn or _apply_gate to check its gate against SiLU(gate) * up"
    gate, up = _silu_probe(inter, device)
    gate_up = torch.cat([gate, up], -1) if concatenated else torch.stack([gate, up], -1).flatten(-2)
    with torch.no_grad():
        try:
            got = apply(gate_up) if callable(apply) else act(gate) * up
        except Exception as e:  # a gate that cannot take the probe is not one FP8Experts can stand for
            return f"its gate ({what}) raised on a probe: {type(e).__name__}: {e}"
    want = nn.functional.silu(gate) * up
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return f"its gate ({what}) did not give [rows, {inter}] on a probe"
    got = got.float()
    err = (got - want).abs() / (want.abs() + 1e-3)
    if torch.isfinite(got).all() and err.max() <= 1e-2:  # SiLU evaluated in bf16 passes
        return None
    i = int(err.flatten().argmax())
    return (f"its gate ({what}) is not SiLU(gate) * up: gate={gate.flatten()[i].item():g}, "
            f"up={up.flatten()[i].item():g} gives {got.flatten()[i].item():g}, SiLU {want.flatten()[i].item():g}; "
            f"FP8Experts' kernels fuse SiLU")


def _name(fn) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def _expert_banks(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | str:
    """(gate_up [E, 2I, H], down [E, H, I]) as FP8Experts stores them
    (gate rows first: views of the module's banks, or for interleaved gate
    and up rows a copy), or why the module's experts cannot be an
    FP8Experts."""
    banks = _bank_views(module)
    if isinstance(banks, str):
        return banks
    gu, dn, concatenated = banks
    return (gu if concatenated else torch.cat([gu[:, 0::2], gu[:, 1::2]], 1)), dn


def _quantize_bank(bank: torch.Tensor, concatenated: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn bank, fp32 scales [E, N]) of an expert bank [E, N, K]
    in FP8Experts' orientation (a view of the module's bank, _bank_views);
    concatenated False: gate and up rows interleaved, stored gate rows first
    (one expert's copy at a time). What FP8Experts.from_experts and
    load_fp8 of a bf16 checkpoint (each bank as it is read) both store."""
    if concatenated:
        return quantize_weight(bank, "row")
    e, two_i, _ = bank.shape
    q = torch.empty(bank.shape, dtype=torch.float8_e4m3fn, device=bank.device)
    scale = torch.empty(e, two_i, device=bank.device)
    for x in range(e):
        q[x], s = quantize_weight(_gate_rows_first(bank[x]), "row")
        scale[x] = s[:, 0]
    return q, scale


def _gate_rows_first(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2I, H] with gate and up rows interleaved (g0 u0 g1 u1 ...) as
    gate rows, then up rows (a copy)."""
    return torch.cat([gate_up[..., 0::2, :], gate_up[..., 1::2, :]], -2)


def _bank_views(module: nn.Module, on_meta: bool = False) -> tuple[torch.Tensor, torch.Tensor, bool] | str:
    """(gate_up [E, 2I, H], down [E, H, I], concatenated): views of the
    module's banks in FP8Experts' orientation, concatenated False where gate
    and up rows are interleaved; or why the module's experts cannot be an
    FP8Experts. Layout flags are those transformers'
    use_experts_implementation sets on its experts modules. on_meta: banks
    on the meta device are a model skeleton about to be loaded (load_fp8 of
    a bf16 checkpoint), not a model whose banks were never loaded; the gate
    is then probed on the CPU."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(gate_up, torch.Tensor) and gate_up.dim() == 3):
        return ("no 3-D gate_up_proj (experts without a gate, has_gate=False): FP8Experts runs gated experts, "
                "SiLU(gate) * up")
    if not (isinstance(down, torch.Tensor) and down.dim() == 3):
        return "no 3-D down_proj"
    if gate_up.dtype not in _QUANTIZABLE or down.dtype not in _QUANTIZABLE:
        return f"expert banks of {gate_up.dtype} and {down.dtype}: quantize_fp8 quantizes floating-point banks"
    if gate_up.device.type == "meta" and not on_meta:
        return "expert banks on the meta device (not loaded)"
    biases = [n for n in ("gate_up_proj_bias", "down_proj_bias") if isinstance(getattr(module, n, None), torch.Tensor)]
    if getattr(module, "has_bias", False) or biases:
        return f"expert biases ({', '.join(biases) or 'has_bias'}): FP8Experts has none"
    if getattr(module, "has_post_expert_norm", False):
        return "a norm after each expert (has_post_expert_norm): FP8Experts has none"
    if getattr(module, "_is_expert_parallel", False):
        return "expert parallel (experts sharded across processes): FP8Experts holds every expert"
    if not _takes_routing(module):
        return (f"forward{inspect.signature(module.forward)} does not take (hidden_states, top_k_index, "
                f"top_k_weights), as FP8Experts does")
    transposed = bool(getattr(module, "is_transposed", False))
    gu, dn = (gate_up.transpose(1, 2), down.transpose(1, 2)) if transposed else (gate_up, down)
    e, two_i, h = gu.shape
    if two_i % 2 or tuple(dn.shape) != (e, h, two_i // 2):
        want = "[E, H, 2I] and [E, I, H] (is_transposed)" if transposed else "[E, 2I, H] and [E, H, I]"
        return f"gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} are not {want}"
    concatenated = bool(getattr(module, "is_concatenated", True))
    why = _gate_is_not_silu(module, two_i // 2, concatenated, "cpu" if gu.device.type == "meta" else gu.device)
    if why:
        return why
    return gu, dn, concatenated


# ------------------------------------------------------------------ quantize_fp8 --
# Hidden states an fp8 LM head's logit error is measured on (HeadError).
HEAD_PROBES = 16


@dataclasses.dataclass(frozen=True)
class HeadError:
    """An fp8 LM head's logits against its original weight's, on HEAD_PROBES
    hidden states drawn from N(0, 1) with a fixed seed (a final RMSNorm hands
    the head unit-RMS states, before its own weight), both computed in
    float32 from the same states, a slab of rows at a time. rms_relative:
    ||fp8 - original|| / ||original|| over all logits; max_abs: the largest
    |fp8 - original|, beside logit_rms, the original logits' RMS;
    top1_agreement: the fraction of states whose most likely token is the
    same (greedy decoding's choice)."""

    rms_relative: float
    max_abs: float
    logit_rms: float
    top1_agreement: float

    def __str__(self) -> str:
        return (f"LM head in fp8: logits {self.rms_relative:.2%} RMS off the original head's (largest error "
                f"{self.max_abs:.3g} against a logit RMS of {self.logit_rms:.3g}), same top token for "
                f"{self.top1_agreement:.0%} of {HEAD_PROBES} random unit-RMS hidden states")


@torch.no_grad()
def head_error(weight: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, granularity: str) -> HeadError:
    """HeadError of (q, scale) (quantize_weight's, of `weight` [vocab, hidden])
    against `weight`. The weights are read TEMP_BYTES of float32 rows at a
    time; the logits are small (HEAD_PROBES x vocab) and kept whole."""
    n, k = weight.shape
    probes = torch.randn(HEAD_PROBES, k, generator=torch.Generator().manual_seed(0)).to(weight.device)
    ref, got = [], []
    for r0, r1 in _row_slabs(n, 4 * k, BLOCK):  # whole 128-row blocks, so a block grid's rows slice with them
        s = scale if granularity == "tensor" else scale[r0 // BLOCK:-(-r1 // BLOCK)] if granularity == "block" \
            else scale[r0:r1]
        ref.append(probes @ weight[r0:r1].float().T)
        got.append(probes @ dequantize_weight(q[r0:r1], s, granularity).T)
    ref, got = torch.cat(ref, 1).cpu().double(), torch.cat(got, 1).cpu().double()  # MPS has no float64
    return HeadError(rms_relative=float((got - ref).norm() / ref.norm().clamp(min=1e-300)),
                     max_abs=float((got - ref).abs().max()), logit_rms=float(ref.square().mean().sqrt()),
                     top1_agreement=float((ref.argmax(-1) == got.argmax(-1)).double().mean()))


@dataclasses.dataclass
class FP8Summary:
    """What quantize_fp8 did. `converted`: kind ("FP8Linear", "FP8Experts")
    -> qualified names of the modules replaced. `left`: qualified name of
    each nn.Linear or expert-bank module kept as it was -> why.
    `bytes_before` / `bytes_after`: the model's parameters and buffers.
    `head_error`: the converted LM head's logits against its own (quantize_fp8's
    lm_head=True; HeadError), None when the head was not converted."""

    converted: dict[str, list[str]]
    left: dict[str, str]
    bytes_before: int
    bytes_after: int
    head_error: HeadError | None = None

    def __str__(self) -> str:
        kinds = ", ".join(f"{len(names)} {kind}" for kind, names in self.converted.items() if names) or "nothing"
        lines = [f"quantize_fp8 converted {kinds}: parameters and buffers {self.bytes_before:,} -> "
                 f"{self.bytes_after:,} bytes ({self.bytes_after / max(self.bytes_before, 1):.2f}x)"]
        if any(self.converted.values()):
            lines.append(f"  {FROZEN}")
        if self.head_error is not None:
            lines.append(f"  {self.head_error}")
        lines += [f"  left {name}: {why}" for name, why in self.left.items()]
        return "\n".join(lines)


# What LM heads are named where a model does not say (get_output_embeddings).
_HEAD_NAMES = ("lm_head", "output", "embed_out")


def _default_filter(name: str, module: nn.Module) -> bool:
    # The LM head (unless quantize_fp8's lm_head=True: the logits decide
    # every token), and a mixture-of-experts router (transformers names it
    # `gate` or `router`): its logits pick the experts, and fp8 rounding would
    # flip near ties to other experts; it is a small matrix.
    leaf = name.rsplit(".", 1)[-1]
    return leaf not in (*_HEAD_NAMES, "gate", "router")


def _lm_head_name(model: nn.Module) -> str | None:
    """The qualified name of the model's LM head: the module transformers'
    get_output_embeddings() gives, or else the one nn.Linear named lm_head,
    output or embed_out; None if there is none."""
    try:
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    except NotImplementedError:
        head = None
    found = [n for n, m in model.named_modules() if m is head] if head is not None else \
        [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] in _HEAD_NAMES]
    return found[0] if len(found) == 1 else None


def _model_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


FROZEN = ("the converted weights are frozen (float8 buffers, not parameters): gradients flow to the inputs "
          "and to FP8Linear biases, which keep their requires_grad")


def _keep_in_fp32(model: nn.Module) -> list[tuple[str, re.Pattern]]:
    """transformers' _keep_in_fp32_modules and _keep_in_fp32_modules_strict
    of the model and every model inside it: (attribute, pattern), a pattern
    matching the names of the parameters it keeps in float32 as
    transformers' loader matches them (re.search, `*` any characters)."""
    found = []
    for mod in model.modules():
        for attr in ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict"):
            for pattern in getattr(mod, attr, None) or ():
                if isinstance(pattern, str):
                    found.append((attr, re.compile(pattern.replace("*", ".*"))))
    return found


# `self.<path>.weight` (or an expert bank's name) in a forward's source: the
# module reads that tensor itself (nn.MultiheadAttention passes out_proj's
# weight to F.multi_head_attention_forward; T5's DenseReluDense casts its
# activations to wo.weight.dtype), which an fp8 module would break.
_READS = re.compile(r"self\.([A-Za-z_][\w.]*)\.(weight|gate_up_proj|up_proj|down_proj)\b")
_reads_by_class: dict[type, list[tuple[str, str]]] = {}


def _read_tensors(model: nn.Module) -> dict[str, str]:
    """Qualified name of each module whose weight (or bank) another
    module's forward reads directly -> that reader, as "Class.forward reads
    path.weight"."""
    reads = {}
    for name, mod in model.named_modules():
        cls = type(mod)
        if cls not in _reads_by_class:
            try:
                source = inspect.getsource(cls.forward)
            except (TypeError, OSError):  # no Python source (a builtin or generated forward)
                source = ""
            _reads_by_class[cls] = sorted(set(_READS.findall(source)))
        for path, attr in _reads_by_class[cls]:
            target = f"{name}.{path}" if name else path
            reads.setdefault(target, f"{cls.__name__}.forward reads {path}.{attr}")
    return reads


def _peft_layers(model: nn.Module) -> dict[str, str]:
    """Qualified name of each PEFT tuner layer (a LoRA layer wrapping its
    base layer) -> its class name. Without peft imported there are none."""
    utils = sys.modules.get("peft.tuners.tuners_utils")
    base = getattr(utils, "BaseTunerLayer", None)
    if base is None:
        return {}
    return {name: type(mod).__name__ for name, mod in model.named_modules() if isinstance(mod, base)}


def _unsafe(name: str, mod: nn.Module, keep_fp32, reads, peft) -> str | None:
    """Why converting `mod` would change what the model computes or does, or
    None. Each rule is a way a converted module broke a real model."""
    tensors = [f"{name}.{n}" for n, _ in mod.named_parameters(recurse=False)] or [name]
    for attr, pattern in keep_fp32:
        if any(pattern.search(t) for t in tensors):
            return (f"the model keeps it in float32 ({attr} has {pattern.pattern!r}): "
                    f"transformers runs it in float32 for accuracy")
    owner = next((p for p in peft if name == p or name.startswith(p + ".")), None)
    if owner is not None:
        return (f"part of a PEFT adapter layer ({owner}: {peft[owner]}): PEFT merges its adapters into the base "
                f"layer's weight and trains lora_A / lora_B")
    if name in reads:
        return f"{reads[name]} (an fp8 module would hand it float8 values)"
    if isinstance(mod, nn.Linear) and type(mod) is not nn.Linear:
        return (f"a subclass of nn.Linear ({type(mod).__module__}.{type(mod).__qualname__}): its forward or its "
                f"owner may do more than nn.Linear's; quantize_fp8 converts nn.Linear itself "
                f"(FP8Linear.from_linear converts any on request)")
    return None


def quantize_fp8(model: nn.Module | str | os.PathLike, granularity: str = "row",
                 filter: Callable[[str, nn.Module], bool] | None = None, lm_head: bool = False,
                 **from_pretrained_kwargs) -> nn.Module:
    """Replace every nn.Linear for which filter(qualified_name, module) is
    true (default: all but an LM head named lm_head / output / embed_out and
    a MoE router named gate / router) by an FP8Linear, and every expert-bank
    module the filter keeps that FP8Experts can run by an FP8Experts, in
    place; returns the model, with an FP8Summary of what was converted and
    what was left (and why) as `model.fp8_summary`, also logged (logger
    "mps_ext.fp8", INFO). Expert banks left for any reason but the filter
    give a warning: they keep their memory.

    lm_head=True converts the LM head too (get_output_embeddings(), or the
    nn.Linear named lm_head / output / embed_out), whatever the filter says:
    at decode the head is a large share of the bytes a token reads (a bf16
    248k x 2048 head is 1 GB), and fp8 halves it. Its logit error against
    the original head is measured as it is converted and reported in
    fp8_summary.head_error (HeadError). A head tied to the input embedding
    gets an fp8 copy of its own; the embedding keeps the original weights.

    `model` may also be a Hub name or a directory of a bf16 / fp16 / fp32
    safetensors checkpoint: the model is then read shard by shard, each
    weight quantized as it is read, never holding the bf16 model
    (mps_ext.checkpoint.load_fp8 with device "cpu", which see; the other
    keyword arguments go to transformers' from_pretrained). The result is
    that of quantize_fp8(AutoModelForCausalLM.from_pretrained(path, ...)).

    Whatever the filter says, it leaves what converting would break (_unsafe):
    modules the model keeps in float32 (transformers' _keep_in_fp32_modules
    and _keep_in_fp32_modules_strict), modules whose weight another module's
    forward reads (nn.MultiheadAttention's out_proj, T5's wo), PEFT adapter
    layers and what they wrap, and subclasses of nn.Linear.

    One module at a time: its fp8 replacement is made, put in its place, and
    the original let go before the next (quantize_weight keeps its float32
    temporaries to TEMP_BYTES), so the peak is about the model plus one
    module's fp8 weights. The converted weights are frozen (FROZEN); what
    is not converted keeps its requires_grad. A transformers model saved
    with save_pretrained is written in transformers' fine-grained FP8 format
    (mps_ext.checkpoint: granularity "block" or "tensor"; it refuses what
    the format cannot hold)."""
    if isinstance(model, (str, os.PathLike)):
        from .checkpoint import load_fp8
        return load_fp8(model, "cpu", granularity=granularity, filter=filter, lm_head=lm_head,
                        **from_pretrained_kwargs)
    if from_pretrained_kwargs:
        raise TypeError(f"quantize_fp8 of a model takes no {sorted(from_pretrained_kwargs)} (from_pretrained's "
                        f"arguments go with a checkpoint's name or path)")
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    # Blocks mps_ext.optimize put on moe_layer read banks quantize_fp8 replaces: they are taken back to
    # their own class first and optimized again after (their shared expert quantized as the banks are).
    from .passes.moe import unfuse_blocks
    optimized = unfuse_blocks(model)
    bytes_before = _model_bytes(model)
    plan = _plan(model, filter, lm_head=lm_head)
    error = None
    for name, kind in plan.targets:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        mod = getattr(parent, leaf)
        new = FP8Linear.from_linear(mod, granularity) if kind == "FP8Linear" else FP8Experts.from_experts(mod)
        if name == plan.head:
            error = head_error(mod.weight.detach(), new.weight, new.weight_scale, granularity)
        setattr(parent, leaf, new)
        del mod, new  # the original's memory goes now, before the next module's fp8 copy is made
    if optimized:
        from .passes import optimize
        optimize(model)
    _finish(model, plan, bytes_before, head_error=error)
    return model


@dataclasses.dataclass
class _Plan:
    """What quantize_fp8 converts in a model: targets (qualified name,
    "FP8Linear" or "FP8Experts") in the model's module order, the modules
    left -> why, the expert banks among them left for another reason
    than the filter (warned about), and the LM head's name if lm_head=True
    made it a target."""

    targets: list[tuple[str, str]]
    left: dict[str, str]
    banks_left: dict[str, str]
    head: str | None = None


def _plan(model: nn.Module, filter: Callable[[str, nn.Module], bool] | None, on_meta: bool = False,
          lm_head: bool = False) -> _Plan:
    """The one decision of what quantize_fp8 converts: by quantize_fp8 on a
    loaded model, and by load_fp8 of a bf16 checkpoint on the model's
    skeleton (on_meta: its weights on the meta device, not yet read)."""
    keep = filter or _default_filter
    excluded = "excluded by the filter" + ("" if filter else " (LM head, MoE router: quantize_fp8's default)")
    keep_fp32, reads, peft = _keep_in_fp32(model), _read_tensors(model), _peft_layers(model)
    head = _lm_head_name(model) if lm_head else None
    if lm_head and not isinstance(model.get_submodule(head) if head is not None else None, nn.Linear):
        raise ValueError(f"quantize_fp8(lm_head=True): {type(model).__name__} has no nn.Linear LM head "
                         f"(get_output_embeddings() gives {head!r}; no single nn.Linear named "
                         f"{' / '.join(_HEAD_NAMES)}); pass lm_head=False, or a filter that names the head")
    plan = _Plan([], {}, {})
    for name, mod in model.named_modules():
        is_linear = isinstance(mod, nn.Linear)
        if not (is_linear or _holds_expert_banks(mod)):
            continue
        if not keep(name, mod) and name != head:
            plan.left[name] = excluded
        elif not name:
            plan.left[name] = "the model itself: quantize_fp8 replaces modules inside it (FP8Linear.from_linear, " \
                              "FP8Experts.from_experts convert a module)"
        elif (why := _unsafe(name, mod, keep_fp32, reads, peft)) is not None:
            plan.left[name] = why
            if not is_linear:
                plan.banks_left[name] = why
        elif is_linear:
            plan.targets.append((name, "FP8Linear"))
            if name == head:
                plan.head = name
        elif (why := FP8Experts.why_not_convertible(mod, on_meta)) is not None:
            plan.left[name] = plan.banks_left[name] = why
        else:
            plan.targets.append((name, "FP8Experts"))
    return plan


def _finish(model: nn.Module, plan: _Plan, bytes_before: int, stacklevel: int = 2,
            head_error: HeadError | None = None) -> FP8Summary:
    """model.fp8_summary (logged), the warning for expert banks left, and
    the save format: the end of quantize_fp8 and of load_fp8 of a bf16
    checkpoint. stacklevel: the warning's, as seen from _finish's caller;
    head_error: the converted LM head's."""
    converted: dict[str, list[str]] = {"FP8Linear": [], "FP8Experts": []}
    for name, kind in plan.targets:
        converted[kind].append(name)
    summary = FP8Summary(converted, dict(plan.left), bytes_before, _model_bytes(model), head_error)
    model.fp8_summary = summary
    _attach_save_format(model)
    logger.info("%s", summary)
    if plan.banks_left:
        warnings.warn("quantize_fp8 left expert banks in their dtype (they keep their memory): " +
                      "; ".join(f"{n}: {why}" for n, why in plan.banks_left.items()), stacklevel=stacklevel + 1)
    return summary


def _attach_save_format(model: nn.Module) -> None:
    """A transformers model's save_pretrained then writes the fine-grained
    FP8 format (or refuses): mps_ext.checkpoint's quantizer, through
    transformers' own hook (model.hf_quantizer). Models transformers
    quantized otherwise keep their quantizer."""
    transformers = sys.modules.get("transformers")
    pretrained = getattr(transformers, "PreTrainedModel", None)
    if pretrained is None or not isinstance(model, pretrained) or getattr(model, "hf_quantizer", None) is not None:
        return
    from . import checkpoint

    model.hf_quantizer = checkpoint.save_quantizer()
