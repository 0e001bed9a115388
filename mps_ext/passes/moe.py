"""`mps_ext.optimize(model)`: a loaded model's mixture-of-experts blocks on
mps_ext's fastest path, one host call per MoE layer at decode.

Eager PyTorch pays about 20 us of CPU for each op it encodes on MPS, and a
transformers MoE block is dozens of ops per token (router, softmax, top-k,
renormalisation, the sort of the tokens by expert, two grouped products,
the weighted sum, a shared expert and its gate). Each block optimize
recognises becomes a FusedMoE, whose decode is torch.ops.mps_ext.moe_layer
(csrc/ops/moe_layer.cpp): router GEMV, moe_route, the gate/up moe_experts
product, and the down product fused with the combine, four dispatches
encoded by that one call, on every torch
release mps_ext supports, for floating (float32, float16, bfloat16) and
quantize_fp8's float8 expert banks. A shared expert of the experts' size
with a sigmoid gate (Qwen3-Next, Qwen3.5/3.6-MoE) becomes expert E of the
banks and row E of the router: no dispatch of its own. Prefill beyond the
op's 1024 token slots takes the grouped path (mps_ext's _grouped_mm, or
FP8Experts' fp8 products); CPU tensors take torch's own CPU ops unless the
executor is asked for (mps_ext._executor_request; the model runner).

What a block must be, checked by value on a probe rather than by class:
experts as 3-D banks with a SiLU gate (what quantize_fp8 converts, or an
FP8Experts), a router `gate` (or `router`) holding `weight` [E, H] whose
forward gives (logits, weights, indices) of softmax then top-k, or of
sigmoid scores ranked with an `expert_bias` and scaled (LFM2-MoE), weights
renormalised or not; optionally `shared_expert` (gate_proj, up_proj,
down_proj, SiLU) scaled by sigmoid(`shared_expert_gate`); nothing else;
then the FusedMoE's output must match the block's on the probe. Anything
else is left as it was, with the reason in the summary (model.
optimize_summary, OptimizeSummary).
"""

from __future__ import annotations

import dataclasses
import inspect

import torch
from torch import nn
from torch.nn import functional as F

from ..fp8 import FP8Experts, FP8Linear, _expert_banks, _gate_is_not_silu, _holds_expert_banks, sort_slots
from ._protocol import Pass, mismatch
from ._runtime import kernels_for

__all__ = ["FusedMoE", "MoEExperts", "MoEPass"]

MAX_SLOTS = 1024  # moe_route's limit (grouped_mm_moe_params.h MOE_MAX_SLOTS): tokens x (top_k + shared)
MAX_EXPERTS = 1024  # MOE_MAX_EXPERTS, the shared expert included
_FLOAT = (torch.float32, torch.float16, torch.bfloat16)


def _kernels_for(x: torch.Tensor) -> bool:
    return kernels_for(x, "grouped_mm")


class MoEExperts(nn.Module):
    """A mixture-of-experts layer's SiLU-gated experts as floating banks,
    gate_up_proj [E, 2I, H] (gate rows, then up rows) and down_proj
    [E, H, I], called as transformers' experts modules and FP8Experts are:
    forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]).
    Up to 1024 routed rows run moe_experts and moe_combine where the
    kernels run; more run _grouped_mm (mps_ext's kernels, or torch 2.15's);
    CPU tensors take torch's own ops, one expert at a time."""

    DECODE_ROWS = FP8Experts.DECODE_ROWS
    act_fn = staticmethod(F.silu)  # what the banks compute; quantize_fp8 checks it by value

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor):
        super().__init__()
        self.num_experts, two_i, self.hidden = gate_up.shape
        self.intermediate = two_i // 2
        self.gate_up_proj = nn.Parameter(gate_up, requires_grad=False)
        self.down_proj = nn.Parameter(down, requires_grad=False)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        x = hidden_states.reshape(-1, self.hidden)
        top_k_index = top_k_index.reshape(x.shape[0], -1)
        if x.device.type == "cpu" and not _kernels_for(x):
            out = self._forward_with_torch_ops(x, top_k_index, top_k_weights.reshape(top_k_index.shape))
        else:
            out = self._forward_grouped(x, top_k_index, top_k_weights.reshape(top_k_index.shape))
        return out.reshape(hidden_states.shape)

    def _forward_grouped(self, x, top_k_index, weights):
        ops = torch.ops.mps_ext
        k = top_k_index.shape[1]
        weights = weights.to(torch.float32).contiguous()
        offs, slot_of_row, row_of_slot = sort_slots(top_k_index, self.num_experts)
        if slot_of_row.numel() <= self.DECODE_ROWS and _kernels_for(x):
            h = ops.moe_experts(x, self.gate_up_proj, None, offs, slot_of_row, k, True)
            y = ops.moe_experts(h, self.down_proj, None, offs)
        else:
            xs = x[slot_of_row.long() // k]
            gate, up = torch._grouped_mm(xs, self.gate_up_proj.transpose(1, 2), offs).chunk(2, -1)
            y = torch._grouped_mm(F.silu(gate) * up, self.down_proj.transpose(1, 2), offs)
        if _kernels_for(x):
            return ops.moe_combine(y, weights, row_of_slot)
        return (y[row_of_slot.long()].view(*top_k_index.shape, -1).float() * weights[..., None]).sum(1).to(x.dtype)

    def _forward_with_torch_ops(self, x, top_k_index, weights):
        """transformers' eager experts: each expert's rows in the model's dtype."""
        out = torch.zeros_like(x)
        flat = top_k_index.reshape(-1)
        if flat.numel() and not 0 <= int(flat.min()) <= int(flat.max()) < self.num_experts:
            raise ValueError(f"MoEExperts: top_k_index must hold experts 0 to {self.num_experts - 1}, got "
                             f"{int(flat.min())} to {int(flat.max())}")
        for e in flat.unique().tolist():
            token, j = torch.where(top_k_index == e)
            gate, up = F.linear(x[token], self.gate_up_proj[e]).chunk(2, -1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e])
            out.index_add_(0, token, (y * weights[token, j, None].to(y.dtype)).to(out.dtype))
        return out

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden={self.hidden}, intermediate={self.intermediate}, "
                f"dtype={self.gate_up_proj.dtype}, SiLU gate")


@dataclasses.dataclass
class Scoring:
    """How a router scores experts (moe_route's MoeRouteParams): softmax of
    the logits, or (sigmoid, LFM2-MoE) sigmoid scores ranked with an
    optional expert_bias; renormalised weights get renorm_eps in their
    denominator, then all are multiplied by scale."""

    sigmoid: bool = False
    scale: float = 1.0
    renorm_eps: float = 0.0
    expert_bias: torch.Tensor | None = None

    def describe(self, bias: bool) -> str:
        return ("sigmoid" + (" with expert bias" if bias else "") if self.sigmoid else "softmax") + \
            (f", x{self.scale:g}" if self.scale != 1 else "")


class FusedMoE(nn.Module):
    """A mixture-of-experts block as mps_ext runs it fastest:
    forward(hidden_states [..., H], residual=None) -> [..., H]: the block's
    output, plus `residual` if given (a decoder layer's `residual + mlp(x)`,
    added in moe_layer's last dispatch where the model's order allows, so
    that it costs no call of its own). `router` [E (+1), H]: the
    router's rows, then (when `fused_shared`) the shared expert's gate row;
    `experts`: MoEExperts or FP8Experts holding E (+1: the shared expert)
    experts. A shared expert that cannot be expert E (another size, or
    stored differently from the banks) stays `shared_expert` and
    `shared_expert_gate`, run as the model ran it."""

    def __init__(self, router: torch.Tensor, experts: nn.Module, top_k: int, renormalize: bool,
                 fused_shared: bool, shared_expert: nn.Module | None = None,
                 shared_expert_gate: nn.Module | None = None, scoring: Scoring | None = None):
        super().__init__()
        self.router = nn.Parameter(router, requires_grad=False)
        self.experts = experts
        self.top_k, self.renormalize, self.fused_shared = int(top_k), bool(renormalize), bool(fused_shared)
        self.shared_expert, self.shared_expert_gate = shared_expert, shared_expert_gate
        self.hidden = router.shape[1]
        self.scoring = scoring or Scoring()
        bias = self.scoring.expert_bias
        self.register_buffer("expert_bias", None if bias is None else bias.detach().float().clone())

    @property
    def routed_experts(self) -> int:
        return self.router.shape[0] - (1 if self.fused_shared else 0)

    def _banks(self):
        e = self.experts
        if isinstance(e, FP8Experts):
            return e.gate_up_proj, e.gate_up_scale, e.down_proj, e.down_scale
        return e.gate_up_proj, None, e.down_proj, None

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        x = hidden_states.reshape(-1, self.hidden)
        slots = self.top_k + (1 if self.fused_shared else 0)
        grad = torch.is_grad_enabled()
        if (_kernels_for(x) and x.shape[0] * slots <= MAX_SLOTS
                and not (grad and x.requires_grad)):  # moe_layer has no derivative
            # The model adds the residual last, after a shared expert run apart too; moe_layer takes it
            # as the layer's output is (else torch adds it as the model does, broadcasting or promoting).
            res_inside = (residual is not None and self.shared_expert is None
                          and residual.shape == hidden_states.shape and residual.dtype == x.dtype
                          and residual.device == x.device and residual.is_contiguous()
                          and not (grad and residual.requires_grad))
            gate_up, gate_up_scale, down, down_scale = self._banks()
            sc = self.scoring
            bias = None if self.expert_bias is None else self.expert_bias.float()  # a model-wide .to(dtype) casts it
            out = torch.ops.mps_ext.moe_layer(x, self.router, gate_up, gate_up_scale, down, down_scale,
                                               self.top_k, self.renormalize, self.fused_shared, bias, sc.sigmoid,
                                               sc.scale, sc.renorm_eps,
                                               residual.reshape(x.shape) if res_inside else None)
            if res_inside:
                return out.reshape(hidden_states.shape)
        else:
            out = self.experts(x, *self.route(x))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        out = out.reshape(hidden_states.shape)
        return out if residual is None else residual + out

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(top_k_index, top_k_weights) with torch's ops, as transformers'
        routers compute them (softmax in float32, top-k, renormalisation,
        the weights in the logits' dtype), the fused shared expert appended
        with weight sigmoid(its gate)."""
        e, sc = self.routed_experts, self.scoring
        # The router's rows apart from the shared expert's gate, as the model multiplies them: the same
        # logits to the bit (a CPU GEMM may sum in another order for another row count).
        logits = F.linear(x, self.router[:e])
        if sc.sigmoid:
            scores = logits.sigmoid()
            ranked = scores if self.expert_bias is None else scores + self.expert_bias
            index = torch.topk(ranked, self.top_k, dim=-1).indices
            weights = scores.gather(1, index)
        else:
            weights, index = torch.topk(F.softmax(logits, dim=-1, dtype=torch.float32), self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + sc.renorm_eps)
        weights = (weights * sc.scale if sc.scale != 1 else weights).to(logits.dtype)
        if self.fused_shared:
            index = torch.cat([index, torch.full_like(index[:, :1], e)], 1)
            weights = torch.cat([weights, torch.sigmoid(F.linear(x, self.router[e:]))], 1)
        return index, weights

    def extra_repr(self) -> str:
        shared = ("shared expert fused as expert %d" % self.routed_experts if self.fused_shared else
                  "shared expert run apart" if self.shared_expert is not None else "no shared expert")
        return (f"experts={self.routed_experts}, {self.scoring.describe(self.expert_bias is not None)} "
                f"top_k={self.top_k}, renormalize={self.renormalize}, {shared}; "
                f"decode: torch.ops.mps_ext.moe_layer, one call")


# ------------------------------------------------------------------ recognising a block --
_ROUTER_NAMES = ("gate", "router")
_SHARED_NAMES = ("shared_expert", "shared_expert_gate")


def _router_semantics(router: nn.Module, hidden: int, device, dtype,
                     expert_bias: torch.Tensor | None) -> tuple[int, bool, Scoring] | str:
    """(top_k, renormalize, scoring) of a top-k router, by value on a probe
    (softmax, or sigmoid with an optional expert bias, renormalised or
    not, scaled by its routed_scaling_factor), or why the router is none
    of them."""
    w = getattr(router, "weight", None)
    if not (isinstance(w, torch.Tensor) and w.dim() == 2 and w.shape[1] == hidden and w.dtype in _FLOAT):
        return (f"its router {type(router).__name__} has no floating weight [experts, {hidden}] "
                f"(optimize runs linear routers)")
    x = torch.randn(16, hidden, generator=torch.Generator().manual_seed(0)).to(device=device, dtype=w.dtype)
    takes_bias = len(inspect.signature(router.forward).parameters) > 1
    with torch.no_grad():
        try:
            got = router(x, expert_bias) if takes_bias else router(x)
        except Exception as e:
            return f"its router {type(router).__name__} raised on a probe: {type(e).__name__}: {e}"
        if not (isinstance(got, tuple) and len(got) == 3 and all(isinstance(t, torch.Tensor) for t in got)
                and got[2].dim() == 2 and got[1].shape == got[2].shape):
            return (f"its router {type(router).__name__} does not return (logits, weights, indices) as "
                    f"transformers 5's top-k routers do")
        _, weights, index = got
        k = index.shape[1]
        logits = F.linear(x, w)
        tol = 1e-2 if weights.dtype != torch.float32 else 1e-5
        candidates = [Scoring()]
        scores = logits.sigmoid()
        candidates.append(Scoring(True, float(getattr(router, "routed_scaling_factor", 1.0) or 1.0), 1e-6,
                                  expert_bias if takes_bias else None))
        for sc in candidates:
            if sc.sigmoid:
                ranked = scores if sc.expert_bias is None else scores + sc.expert_bias
                want_i = torch.topk(ranked, k, dim=-1).indices
                want_w = scores.gather(1, want_i).float()
            else:
                want_w, want_i = torch.topk(F.softmax(logits, dim=-1, dtype=torch.float32), k, dim=-1)
            if not torch.equal(index.long(), want_i):
                continue
            for renormalize in (True, False):
                ww = want_w / (want_w.sum(-1, keepdim=True) + sc.renorm_eps) if renormalize else want_w
                if torch.allclose(weights.float(), ww * sc.scale, rtol=tol, atol=tol * 1e-2):
                    return k, renormalize, sc
    return (f"its router {type(router).__name__} is neither softmax top-k nor sigmoid top-k (renormalised or "
            f"not): a grouped or otherwise scored router")


def _row_scaled(linear: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(fp8 weight [N, K], fp32 scale [N]) of an FP8Linear with one scale
    per row (or one in all), as FP8Experts stores its banks; else None."""
    if not (isinstance(linear, FP8Linear) and linear.bias is None and linear.granularity in ("row", "tensor")):
        return None
    return linear.weight, linear.weight_scale.reshape(-1).expand(linear.out_features).contiguous()


def _shared_parts(block: nn.Module, intermediate: int, fp8: bool, dtype):
    """(gate_up [2I, H], gate_up_scale, down [H, I], down_scale, gate row
    [1, H] in `dtype`) of the block's shared expert when it can be expert E
    of the banks; None when there is none; a str saying why it runs apart."""
    mlp, gate = getattr(block, "shared_expert", None), getattr(block, "shared_expert_gate", None)
    if mlp is None and gate is None:
        return None
    if mlp is None or gate is None:
        return "a shared expert without its sigmoid gate (or a gate without an expert)"
    parts = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if not all(isinstance(p, (nn.Linear, FP8Linear)) for p in parts) or any(p.bias is not None for p in parts):
        return f"its shared expert {type(mlp).__name__} is not gate_proj, up_proj, down_proj without biases"
    g, u, d = parts
    if g.out_features != intermediate:
        return f"its shared expert's size {g.out_features} is not the experts' {intermediate}"
    if not (isinstance(gate, (nn.Linear, FP8Linear)) and gate.out_features == 1 and gate.bias is None):
        return "its shared_expert_gate is not a Linear(hidden, 1) without bias"
    why = _gate_is_not_silu(mlp, intermediate, True, g.weight.device)
    if why:
        return "its shared expert's " + why
    gate_row = (gate.dequantize() if isinstance(gate, FP8Linear) else gate.weight).to(dtype)
    if fp8:
        q = [_row_scaled(p) for p in parts]
        if any(v is None for v in q):
            return "the expert banks are fp8 and the shared expert is not fp8 with a scale per row"
        return torch.cat([q[0][0], q[1][0]]), torch.cat([q[0][1], q[1][1]]), q[2][0], q[2][1], gate_row
    if any(isinstance(p, FP8Linear) for p in parts) or any(p.weight.dtype != dtype for p in parts):
        return "the shared expert is not stored as the expert banks are"
    return torch.cat([g.weight, u.weight]), None, d.weight, None, gate_row


def _plan(block: nn.Module) -> FusedMoE | str:
    """The FusedMoE standing for `block`, checked by value, or why not."""
    experts = block.experts
    known = {"experts", *_ROUTER_NAMES, *_SHARED_NAMES}
    extra = [n for n, m in block.named_children() if n not in known and any(True for _ in m.parameters())]
    extra += [n for n, b in block.named_buffers(recurse=False) if b is not None and n != "expert_bias"]
    if extra:
        return f"it holds {', '.join(extra)} beside its router and experts (optimize knows no such block)"
    router = _router(block)
    if router is None:
        return "no router module named gate or router"
    if isinstance(experts, FP8Experts):
        fp8, e = True, experts.num_experts
        gate_up, gate_up_scale = experts.gate_up_proj, experts.gate_up_scale
        down, down_scale = experts.down_proj, experts.down_scale
    else:
        banks = _expert_banks(experts)
        if isinstance(banks, str):  # worded for quantize_fp8: the same banks run the same kernels
            return f"its experts {type(experts).__name__}: {banks}"
        fp8, (gate_up, down), gate_up_scale, down_scale = False, banks, None, None
        e = gate_up.shape[0]
    hidden, intermediate = gate_up.shape[2], gate_up.shape[1] // 2
    rw = getattr(router, "weight", None)
    dtype = rw.dtype if isinstance(rw, torch.Tensor) else None
    bias = getattr(block, "expert_bias", None) if getattr(block, "use_expert_bias", True) else None
    sem = _router_semantics(router, hidden, gate_up.device, dtype, bias if isinstance(bias, torch.Tensor) else None)
    if isinstance(sem, str):
        return sem
    top_k, renormalize, scoring = sem
    if rw.shape[0] != e:
        return f"its router has {rw.shape[0]} rows for {e} experts"
    shared = _shared_parts(block, intermediate, fp8, dtype)
    fused_shared = isinstance(shared, tuple)
    if e + fused_shared > MAX_EXPERTS:
        return f"{e} experts: moe_route takes at most {MAX_EXPERTS}"
    if fused_shared:
        sgu, sgus, sdn, sdns, gate_row = shared
        gate_up, down = torch.cat([gate_up, sgu[None]]), torch.cat([down, sdn[None]])
        if fp8:
            gate_up_scale, down_scale = torch.cat([gate_up_scale, sgus[None]]), torch.cat([down_scale, sdns[None]])
        router_rows = torch.cat([rw.detach(), gate_row.detach()])
    else:
        router_rows = rw.detach()
    if fp8 and not fused_shared:
        new_experts = experts
    elif fp8:
        # On the meta device first: the banks are the concatenated ones, not a second allocation.
        new_experts = FP8Experts(gate_up.shape[0], hidden, intermediate, device="meta")
        for name, t in (("gate_up_proj", gate_up), ("gate_up_scale", gate_up_scale), ("down_proj", down),
                        ("down_scale", down_scale)):
            setattr(new_experts, name, t.detach().contiguous())
    else:
        # contiguous() keeps the model's own storage where its layout is already the banks'.
        new_experts = MoEExperts(gate_up.detach().contiguous(), down.detach().contiguous())
    unfused = shared is not None and not fused_shared
    fused = FusedMoE(router_rows, new_experts, top_k, renormalize, fused_shared,
                     block.shared_expert if unfused else None, block.shared_expert_gate if unfused else None,
                     scoring)
    fused.shared_reason = shared if unfused else None
    return fused


def _router(block: nn.Module) -> nn.Module | None:
    return next((getattr(block, n) for n in _ROUTER_NAMES if isinstance(getattr(block, n, None), nn.Module)), None)


def _dtype_refusal(block: nn.Module) -> str | None:
    """Why optimize refuses the whole model for this block's dtype (its
    banks or router in a floating type the kernels do not take), or None."""
    experts, router = block.experts, _router(block)
    what = "optimize runs float32, float16 or bfloat16 models (or quantize_fp8's fp8 experts); "
    if not isinstance(experts, FP8Experts):
        banks = _expert_banks(experts)
        if not isinstance(banks, str) and banks[0].dtype not in _FLOAT:
            return what + f"{type(experts).__name__} holds {banks[0].dtype} banks"
    rw = getattr(router, "weight", None)
    if isinstance(rw, torch.Tensor) and rw.dtype not in _FLOAT and rw.dtype.is_floating_point:
        return what + f"the router {type(router).__name__} is {rw.dtype}"
    return None


def _same_output(block, fused, hidden, device, dtype) -> str | None:
    """None if `fused` gives the block's output on a probe (torch's ops on
    both: the same routing), else why not."""
    x = torch.randn(1, 8, hidden, generator=torch.Generator().manual_seed(1)).to(device=device, dtype=dtype)
    with torch.no_grad():
        try:
            want = block(x)
        except Exception as e:
            return f"it raised on a probe [1, 8, {hidden}]: {type(e).__name__}: {e}"
        if not (isinstance(want, torch.Tensor) and want.shape == x.shape):
            return "its forward does not return one tensor of its input's shape"
        got = fused(x)
    err = float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30))
    # fp8 experts take bfloat16 activations, an fp8 shared expert of a
    # float32 model did not: bf16 rounding apart.
    tol = 1e-4 if dtype == torch.float32 and not isinstance(fused.experts, FP8Experts) else 3e-2
    if not err <= tol:
        return mismatch(f"its output differs from a softmax top-k block's on a probe (relative error {err:.2g}): "
                        f"it computes something optimize does not know")
    return None




def _describe(block: nn.Module, fused: FusedMoE) -> str:
    kind = "fp8" if isinstance(fused.experts, FP8Experts) else str(fused.router.dtype).replace("torch.", "")
    shared = ("shared expert fused as expert %d" % fused.routed_experts if fused.fused_shared else
              f"shared expert run apart ({fused.shared_reason})" if fused.shared_expert is not None else
              "no shared expert")
    return (f"{type(block).__name__} -> FusedMoE: {fused.routed_experts} {kind} experts, top-{fused.top_k}"
            f"{', renormalised' if fused.renormalize else ''}, {shared}"
            + (f"; {fused.scoring.describe(fused.expert_bias is not None)} router" if fused.scoring.sigmoid else ""))


def _is_block(module: nn.Module) -> bool:
    experts = getattr(module, "experts", None)
    return isinstance(experts, nn.Module) and (isinstance(experts, FP8Experts) or _holds_expert_banks(experts))


class MoEPass(Pass):
    """A mixture-of-experts block (module docstring) -> FusedMoE."""

    name = "moe"
    title = "MoE blocks on torch.ops.mps_ext.moe_layer (one call per layer at decode)"

    def candidates(self, model):
        names, inside = [], []  # blocks found: their banks are not candidates again
        for name, mod in model.named_modules():
            if any(name.startswith(p + ".") for p in inside):
                continue
            if isinstance(mod, FusedMoE) or _is_block(mod):
                inside.append(name)
                names.append(name)
            elif _holds_expert_banks(mod) and not isinstance(mod, MoEExperts):
                names.append(name)
        return names

    def refuse(self, model):
        for name in self.candidates(model):
            block = model.get_submodule(name)
            why = _is_block(block) and not isinstance(block, FusedMoE) and _dtype_refusal(block)
            if why:
                raise ValueError(why)

    def already(self, module):
        return isinstance(module, FusedMoE)

    def plan(self, model, name, module):
        if not _is_block(module):
            return "expert banks outside a block with an `experts` child (optimize knows no such block)"
        if not name:
            return "the model itself: optimize replaces blocks inside it"
        return _plan(module)

    def probe(self, model, name, module, plan):
        return _same_output(module, plan, plan.hidden, plan.router.device, plan.router.dtype)

    def apply(self, model, name, module, plan):
        parent_name, _, leaf = name.rpartition(".")
        plan.train(module.training)
        setattr(model.get_submodule(parent_name) if parent_name else model, leaf, plan)
        return _describe(module, plan)
