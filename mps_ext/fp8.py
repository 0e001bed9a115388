"""FP8 weights for nn.Linear and mixture-of-experts banks: `quantize_fp8(model)`
halves a model's weight memory against bf16.

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

Every selected module holding a mixture-of-experts layer's expert banks as
3-D parameters `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I] with a
SiLU gate (transformers' layout: Qwen3-MoE, Qwen3.5/3.6, LFM2-MoE experts,
called as experts(hidden_states, top_k_index, top_k_weights)) becomes an
FP8Experts: float8_e4m3fn banks with one fp32 scale per expert output row
(whatever `granularity`: the recipe of the grouped fp8 kernels,
kernels_metal/grouped_mm.metal), run by mps_ext's MoE ops.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

__all__ = ["FP8Experts", "FP8Linear", "quantize_fp8", "quantize_weight"]

E4M3_MAX = 448.0
BLOCK = 128
GRANULARITIES = ("tensor", "row", "block")


def quantize_weight(weight: torch.Tensor, granularity: str = "row") -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, fp32 scale) with weight ~= fp8 * scale; the
    largest magnitude of each scale group maps to 448. Rounding is done in
    float32 on the weight's device (then converted: the fp8 conversion of
    torch on CPU, mps_ext's on MPS). A 2-D weight [N, K] takes any
    granularity (scales: [], [N, 1], [ceil(N/128), ceil(K/128)]); a 3-D
    expert bank [E, N, K] is quantized by row (scales [E, N], what the
    grouped fp8 kernels take)."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if weight.dim() not in (2, 3) or (weight.dim() == 3 and granularity != "row"):
        raise ValueError(f"expected a 2-D weight, or a 3-D expert bank with granularity 'row'; got "
                         f"{weight.dim()} dimensions and {granularity!r}")
    w = weight.detach().float()
    n, k = w.shape[-2:]
    if granularity == "tensor":
        amax = w.abs().amax().reshape(())
        scale = (amax / E4M3_MAX).clamp(min=torch.finfo(torch.float32).tiny)
        q = w / scale
    elif granularity == "row":
        amax = w.abs().amax(dim=-1, keepdim=True)
        scale = (amax / E4M3_MAX).clamp(min=torch.finfo(torch.float32).tiny)
        q = w / scale
        if w.dim() == 3:
            scale = scale.squeeze(-1)
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


class FP8Experts(nn.Module):
    """A mixture-of-experts layer's expert banks in float8_e4m3fn with an fp32
    scale per expert output row, called as transformers' experts modules are:
    forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])
    -> [T, H], each token's chosen experts' SiLU-gated MLPs summed with its
    weights. The tokens' slots are sorted by expert on the device (argsort,
    index_add_, cumsum): nothing is read on the host.

    Decode (up to 1024 routed rows, T * k): torch.ops.mps_ext.moe_experts
    (gather + gate/up + SiLU, then down; bfloat16 activations, the weights
    de-quantised in registers: each chosen expert's bytes read once) and
    moe_combine, four dispatches. More rows: the activations are quantised
    row-wise to e4m3 as well and the products are _scaled_grouped_mm's tiles
    (prefill accuracy is then that of fp8 activations)."""

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
    def convertible(module: nn.Module) -> bool:
        """Whether `module` holds expert banks in the layout FP8Experts takes."""
        gu, d = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        if not (isinstance(gu, torch.Tensor) and isinstance(d, torch.Tensor) and gu.dim() == 3 and d.dim() == 3):
            return False
        e, two_i, h = gu.shape
        act = getattr(module, "act_fn", None)
        return (gu.is_floating_point() and two_i % 2 == 0 and tuple(d.shape) == (e, h, two_i // 2)
                and (isinstance(act, nn.SiLU) or act is nn.functional.silu))

    @classmethod
    def from_experts(cls, module: nn.Module) -> "FP8Experts":
        e, two_i, h = module.gate_up_proj.shape
        m = cls(e, h, two_i // 2, device=module.gate_up_proj.device)
        for name in ("gate_up", "down"):
            q, s = quantize_weight(getattr(module, name + "_proj"), "row")
            getattr(m, name + "_proj").copy_(q)
            getattr(m, name + "_scale").copy_(s)
        return m

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        ops = torch.ops.mps_ext
        x = hidden_states.reshape(-1, self.hidden).to(torch.bfloat16)
        tokens, k = top_k_index.reshape(x.shape[0], -1).shape
        flat = top_k_index.reshape(-1)
        rows = flat.numel()
        slot_of_row = torch.argsort(flat, stable=True)  # slot t * k + j, sorted by expert
        counts = torch.zeros(self.num_experts, dtype=torch.int32, device=x.device)
        counts.index_add_(0, flat, torch.ones(rows, dtype=torch.int32, device=x.device))
        offs = counts.cumsum(0, dtype=torch.int32)
        row_of_slot = torch.empty_like(slot_of_row).scatter_(0, slot_of_row, torch.arange(rows, device=x.device))
        slot_of_row, row_of_slot = slot_of_row.to(torch.int32), row_of_slot.to(torch.int32)
        weights = top_k_weights.reshape(tokens, k).to(torch.float32).contiguous()
        if rows <= self.DECODE_ROWS:
            h = ops.moe_experts(x, self.gate_up_proj, self.gate_up_scale, offs, slot_of_row, k, True)
            y = ops.moe_experts(h, self.down_proj, self.down_scale, offs)
        else:
            xs = x[slot_of_row.long() // k]
            gate, up = self._scaled(xs, self.gate_up_proj, self.gate_up_scale, offs).float().chunk(2, -1)
            y = self._scaled((nn.functional.silu(gate) * up).bfloat16(), self.down_proj, self.down_scale, offs)
        out = ops.moe_combine(y, weights, row_of_slot)
        return out.to(hidden_states.dtype).reshape(hidden_states.shape)

    @staticmethod
    def _scaled(rows: torch.Tensor, bank: torch.Tensor, scale: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """rows [R, K] (bf16, sorted by expert) @ bank[e]^T, the rows quantised to e4m3 row-wise."""
        a8, sa = quantize_weight(rows, "row")
        return torch.ops.mps_ext._scaled_grouped_mm(a8, bank.transpose(-2, -1), sa.reshape(-1), scale, offs)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden={self.hidden}, intermediate={self.intermediate}, "
                f"weights=float8_e4m3fn, fp32 scale per expert output row, SiLU gate; decode: bfloat16 "
                f"activations, weights de-quantised in registers")


def _default_filter(name: str, module: nn.Module) -> bool:
    # The LM head, and a mixture-of-experts router (transformers names it
    # `gate` or `router`): its logits pick the experts, and fp8 rounding would
    # flip near ties to other experts; it is a small matrix.
    leaf = name.rsplit(".", 1)[-1]
    return leaf not in ("lm_head", "output", "embed_out", "gate", "router")


def quantize_fp8(model: nn.Module, granularity: str = "row",
                 filter: Callable[[str, nn.Module], bool] | None = None) -> nn.Module:
    """Replace every nn.Linear for which filter(qualified_name, module) is
    true (default: all but an LM head named lm_head / output / embed_out and
    a MoE router named gate / router) by an FP8Linear, and every expert-bank module (FP8Experts.convertible)
    the filter keeps by an FP8Experts, in place; returns the model."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    keep = filter or _default_filter
    targets = [(name, mod) for name, mod in model.named_modules()
               if (isinstance(mod, nn.Linear) or FP8Experts.convertible(mod)) and keep(name, mod)]
    for name, mod in targets:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        new = FP8Linear.from_linear(mod, granularity) if isinstance(mod, nn.Linear) else FP8Experts.from_experts(mod)
        setattr(parent, leaf, new)
    return model
