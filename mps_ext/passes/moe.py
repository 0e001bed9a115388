"""The MoE pass of `mps_ext.optimize`: a loaded model's mixture-of-experts
blocks on mps_ext's fastest path, one host call per MoE layer at decode.

Eager PyTorch pays about 20 us of CPU for each op it encodes on MPS, and a
transformers MoE block is dozens of ops per token (router, softmax, top-k,
renormalisation, the sort of the tokens by expert, two grouped products,
the weighted sum, a shared expert and its gate). Each block the pass
recognises keeps its modules and parameters and takes, as its class, a
subclass of its own (FusedMoEMixin first) whose decode is
torch.ops.mps_ext.moe_layer (csrc/ops/moe.cpp): router GEMV,
moe_route, the gate/up moe_experts product, and the down product fused
with the combine, four dispatches encoded by that one call, on every torch
release mps_ext supports, for floating (float32, float16, bfloat16) and
quantize_fp8's float8 expert banks. A shared expert of the experts' size
with a sigmoid gate (Qwen3-Next, Qwen3.5/3.6-MoE) is expert E of the banks
and row E of the router: no dispatch of its own. Everything else is the
block's own forward: prefill beyond the op's 1024 token slots (transformers'
experts, on mps_ext's _grouped_mm or FP8Experts' products), CPU tensors
unless a CPU backend is asked for, a forward that needs gradients (training,
LoRA) and one recording router logits (output_router_logits).

The op reads the banks where the block keeps them: the experts module's
gate_up_proj [E, 2I, H] (gate rows, then up rows) and down_proj [E, H, I],
as transformers 5 stores them. Where a shared expert becomes expert E, the
banks (and the router with the shared gate's row) are made once with it,
and the block's own parameters become views of them: experts[:E], the
shared expert's rows, so nothing is stored twice, the state dict keeps
the block's names and layout (save_pretrained writes what from_pretrained
reads), optimizers keep their parameters, and a move or cast of the model
moves the banks once (FusedMoEMixin._apply).

What a block must be, checked by value on a probe rather than by class:
experts as 3-D banks with a SiLU gate in that layout (what quantize_fp8
converts, or an FP8Experts), a router `gate` (or `router`) holding `weight`
[E, H] whose forward gives (logits, weights, indices) of softmax then
top-k, or of sigmoid scores ranked with an `expert_bias` and scaled
(LFM2-MoE), weights renormalised or not; optionally `shared_expert`
(gate_proj, up_proj, down_proj, SiLU) scaled by sigmoid(`shared_expert_gate`);
nothing else; then the fused path, computed with torch's ops, must give the
block's output on the probe. Anything else is left as it was, with the
reason in the summary (model.optimize_summary["moe"]).
"""

from __future__ import annotations

import dataclasses
import inspect

import torch
from torch import nn
from torch.nn import functional as F

from ..fp8 import FP8Experts, FP8Linear, _expert_banks, _gate_is_not_silu, _holds_expert_banks, without_casts
from ._classes import fused_subclass, original_class, register_maker, register_mixin
from ._protocol import Pass, mismatch
from ._runtime import kernels_for

__all__ = ["FusedMoEMixin", "MoEPass"]

MAX_SLOTS = 1024  # moe_route's limit (moe_params.h MOE_MAX_SLOTS): tokens x (top_k + shared)
MAX_EXPERTS = 1024  # MOE_MAX_EXPERTS, the shared expert included
_FLOAT = (torch.float32, torch.float16, torch.bfloat16)


class _ReferenceExperts(nn.Module):
    """The kernel's floating banks (gate_up [E, 2I, H], down [E, H, I]) as
    an experts module of torch's ops, one expert at a time, for the probe:
    forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor):
        super().__init__()
        self.num_experts, two_i, self.hidden = gate_up.shape
        self.gate_up_proj, self.down_proj = gate_up, down

    def forward(self, hidden_states, top_k_index, top_k_weights):
        x = hidden_states.reshape(-1, self.hidden)
        top_k_index = top_k_index.reshape(x.shape[0], -1)
        out = self._forward_with_torch_ops(x, top_k_index, top_k_weights.reshape(top_k_index.shape))
        return out.reshape(hidden_states.shape)

    def _forward_with_torch_ops(self, x, top_k_index, weights):
        """transformers' eager experts: each expert's rows in the model's dtype."""
        out = torch.zeros_like(x)
        flat = top_k_index.reshape(-1)
        if flat.numel() and not 0 <= int(flat.min()) <= int(flat.max()) < self.num_experts:
            raise ValueError(f"experts: top_k_index must hold experts 0 to {self.num_experts - 1}, got "
                             f"{int(flat.min())} to {int(flat.max())}")
        for e in flat.unique().tolist():
            token, j = torch.where(top_k_index == e)
            gate, up = F.linear(x[token], self.gate_up_proj[e]).chunk(2, -1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e])
            out.index_add_(0, token, (y * weights[token, j, None].to(y.dtype)).to(out.dtype))
        return out


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


# ------------------------------------------------------------------ the fused block --
@dataclasses.dataclass(eq=False)
class _Kernel:
    """What moe_layer reads for one block, and which of the block's own
    tensors are views of it (`aliases`: (module, name, source, index) with
    module.<name> = getattr(self, source)[index], a parameter or buffer)."""

    router: torch.Tensor                   # [E (+1: the shared expert's gate row), H]
    gate_up: torch.Tensor                  # [E (+1), 2I, H]
    down: torch.Tensor                     # [E (+1), H, I]
    gate_up_scale: torch.Tensor | None     # fp8 banks: [E (+1), 2I]
    down_scale: torch.Tensor | None        # fp8 banks: [E (+1), H]
    top_k: int
    renormalize: bool
    fused_shared: bool
    scoring: Scoring
    router_module: nn.Module               # the block's router, whose forward hooks record router logits
    uses_bias: bool = False                # the router ranks by score + the block's expert_bias
    shared_apart: bool = False             # a shared expert the op does not take: the block's own modules
    shared_reason: str | None = None
    aliases: list = dataclasses.field(default_factory=list)
    hooks: list = dataclasses.field(default_factory=list)  # handles of the block's state-dict hook

    TENSORS = ("router", "gate_up", "down", "gate_up_scale", "down_scale")

    @property
    def routed(self) -> int:
        return self.router.shape[0] - (1 if self.fused_shared else 0)

    def alias(self, module: nn.Module, name: str, source: str, index) -> None:
        """module.<name> becomes a view of getattr(self, source)[index] (and
        the module says so: other passes leave it where it is)."""
        self.aliases.append((module, name, source, index))
        module.__dict__["_mps_ext_view_of"] = "the MoE kernel's banks"

    def point_aliases(self) -> None:
        for module, name, source, index in self.aliases:
            view = getattr(self, source)[index]
            if name in module._parameters:
                old = module._parameters[name]
                view = view.view(old.shape)
                old.data = view
            else:
                module._buffers[name] = view.view(module._buffers[name].shape)

    def move(self, fn) -> None:
        """The kernel's tensors through a module-wide `_apply` function
        (fp8 banks and fp32 scales moved, never cast), each once, then the
        block's views of them again."""
        for name in self.TENSORS:
            t = getattr(self, name)
            if t is not None:
                fixed = t.dtype == torch.float8_e4m3fn or name.endswith("_scale")
                setattr(self, name, without_casts(fn, t) if fixed else fn(t))
        self.point_aliases()

    def frozen(self) -> bool:
        """Whether no tensor the op reads asks for a gradient."""
        return not any(t is not None and t.requires_grad for t in
                       (self.router, self.gate_up, self.down, *(getattr(m, n) for m, n, _, _ in self.aliases)))


def _router_logits_wanted(router: nn.Module) -> bool:
    """Whether transformers is recording router logits in this forward
    (output_router_logits): its output-capturing hooks on the router are
    active. Hooks are installed the first time a capture is asked for, and
    stay; their collector says whether this call records."""
    if not router._forward_hooks:
        return False
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # another release: hooks on the router, so assume they record
        return True
    collected = _active_collector.get()
    return bool(collected) and any(k != "hidden_states" for k in collected)


@register_mixin
class FusedMoEMixin:
    """A mixture-of-experts block whose decode is one moe_layer call
    (module docstring); everything else the block's own forward (the next
    class in the MRO). forward(hidden_states, residual=None): `residual`,
    the decoder layer's `residual + mlp(x)`, is added in moe_layer's last
    dispatch where the block's order allows (mps_ext.passes.decoder)."""

    def forward(self, hidden_states, *args, residual=None, **kwargs):
        call = self._mps_ext_fused_call(False, (hidden_states, *args), kwargs, residual)
        if call is not None:
            return call()
        out = super().forward(hidden_states, *args, **kwargs)
        return out if residual is None else residual + out

    def _mps_ext_fused_call(self, reference: bool, args: tuple, kwargs: dict, residual=None):
        """The call on moe_layer (reference: the same routing and experts
        with torch's ops, wherever the kernel would run), as a function of
        no arguments; None where the block's own forward runs."""
        k = self._mps_ext_moe
        if len(args) != 1 or kwargs:
            return None
        x = args[0]
        hidden = k.router.shape[1]
        if not (isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[-1] == hidden
                and x.dtype == k.router.dtype):
            return None
        slots = k.top_k + (1 if k.fused_shared else 0)
        tokens = x.numel() // hidden
        if tokens * slots > MAX_SLOTS or not (reference or kernels_for(x, "moe")):
            return None
        if torch.is_grad_enabled() and (x.requires_grad or not k.frozen()):  # moe_layer has no derivative
            return None
        if not torch.compiler.is_compiling() and _router_logits_wanted(k.router_module):
            return None
        return lambda: self._fused(reference, x, residual)

    def _mps_ext_add_norm_call(self, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module):
        """A decoder layer's `h = residual + x`, `normed = norm(h)` and `h +
        self(normed)` as one add_rms_norm_moe_layer call (the add and the norm
        in the router GEMV's dispatch), as a function of no arguments giving
        the layer's output; None where that call would not stand for
        add_rms_norm then this block's moe_layer with the residual inside it
        (mps_ext.passes.decoder then runs those): the norm's op would not run
        (FusedRMSNorm.op_takes, compiled as eager: the decoder layer's fused
        path), the block's fused call would not
        (_mps_ext_fused_call, asked of x: normed has its shape and dtype), or
        a shared expert runs apart."""
        k = self._mps_ext_moe
        if k.shared_apart or not norm.op_takes(x, residual, compiled=True) or \
                self._mps_ext_fused_call(False, (x,), {}) is None:
            return None
        return lambda: self._fused_add_norm(x, residual, norm)

    def _fused_add_norm(self, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        k, sc = self._mps_ext_moe, self._mps_ext_moe.scoring
        rows = (-1, k.router.shape[1])
        _, _, out = torch.ops.mps_ext.add_rms_norm_moe_layer(
            x.reshape(rows), residual.reshape(rows), norm.weight, norm.eps, norm.variant, k.router, k.gate_up,
            k.gate_up_scale, k.down, k.down_scale, k.top_k, k.renormalize, k.fused_shared,
            self._float_expert_bias() if k.uses_bias else None, sc.sigmoid, sc.scale, sc.renorm_eps)
        return out.reshape(x.shape)

    def _fused(self, reference: bool, hidden_states: torch.Tensor, residual):
        k = self._mps_ext_moe
        x = hidden_states.reshape(-1, k.router.shape[1])
        # The model adds the residual last, after a shared expert run apart too; moe_layer takes it as the
        # layer's output is (else torch adds it as the model does, broadcasting or promoting).
        res_inside = (residual is not None and not k.shared_apart and residual.shape == hidden_states.shape
                      and residual.dtype == x.dtype and residual.device == x.device and residual.is_contiguous())
        sc = k.scoring
        bias = self._float_expert_bias() if k.uses_bias else None
        if reference:
            out = _reference_experts(k)(x, *_route_reference(k, x, bias))
        else:
            out = torch.ops.mps_ext.moe_layer(x, k.router, k.gate_up, k.gate_up_scale, k.down, k.down_scale,
                                               k.top_k, k.renormalize, k.fused_shared, bias, sc.sigmoid, sc.scale,
                                               sc.renorm_eps, residual.reshape(x.shape) if res_inside else None)
            if res_inside:
                return out.reshape(hidden_states.shape)
        if k.shared_apart:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        out = out.reshape(hidden_states.shape)
        return out if residual is None else residual + out

    def _float_expert_bias(self) -> torch.Tensor:
        """The block's expert_bias in float32, as moe_route reads it. A
        model-wide .to(dtype) casts the buffer, and casting it back at every
        call is a dispatch a MoE layer and token (LFM2.5: 22 of a decoded
        token's ~300): eager, the cast is kept and made again only when the
        buffer is another tensor (.to(), load_state_dict(assign=True)) or was
        changed in place (its version counter: copy_, load_state_dict, a
        training step's update). Compiled, Inductor fuses the cast."""
        b = self.expert_bias
        if b.dtype == torch.float32 or torch.compiler.is_compiling():
            return b.float()
        kept = self.__dict__.get("_mps_ext_float_bias")
        if kept is None or kept[0] is not b or kept[1] != b._version:
            kept = (b, b._version, b.detach().float())
            self.__dict__["_mps_ext_float_bias"] = kept
        return kept[2]

    def _apply(self, fn, recurse=True):
        # The banks first, once, and the block's views of them pointed there again: moved one by one,
        # each view would become a tensor of its own (the banks twice).
        k = self.__dict__.get("_mps_ext_moe")
        if recurse and k is not None:
            k.move(fn)
        return super()._apply(fn, recurse)


def _fused_class(cls: type) -> type:
    return fused_subclass(FusedMoEMixin, cls, f"{cls.__name__} with its decode on one torch.ops.mps_ext.moe_layer "
                          "call (mps_ext.optimize).")


register_maker(FusedMoEMixin, _fused_class)


def _route_reference(k: _Kernel, x: torch.Tensor, bias) -> tuple[torch.Tensor, torch.Tensor]:
    """(top_k_index, top_k_weights) with torch's ops, as transformers'
    routers compute them (softmax in float32, top-k, renormalisation, the
    weights in the logits' dtype), the fused shared expert appended with
    weight sigmoid(its gate): what moe_route computes."""
    e, sc = k.routed, k.scoring
    logits = F.linear(x, k.router[:e])
    if sc.sigmoid:
        scores = logits.sigmoid()
        ranked = scores if bias is None else scores + bias
        index = torch.topk(ranked, k.top_k, dim=-1).indices
        weights = scores.gather(1, index)
    else:
        weights, index = torch.topk(F.softmax(logits, dim=-1, dtype=torch.float32), k.top_k, dim=-1)
    if k.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + sc.renorm_eps)
    weights = (weights * sc.scale if sc.scale != 1 else weights).to(logits.dtype)
    if k.fused_shared:
        index = torch.cat([index, torch.full_like(index[:, :1], e)], 1)
        weights = torch.cat([weights, torch.sigmoid(F.linear(x, k.router[e:]))], 1)
    return index, weights


def _reference_experts(k: _Kernel) -> nn.Module:
    """The kernel's banks as an experts module of torch's ops (no copy)."""
    if k.gate_up_scale is None:
        return _ReferenceExperts(k.gate_up, k.down)
    e, two_i, h = k.gate_up.shape
    experts = FP8Experts(e, h, two_i // 2, device="meta")
    for name in ("gate_up", "down"):
        setattr(experts, name + "_proj", getattr(k, name))
        setattr(experts, name + "_scale", getattr(k, name + "_scale"))
    return experts


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


def _row_scaled(linear: nn.Module) -> bool:
    """Whether an FP8Linear has one scale per row (or one in all), as
    FP8Experts stores its banks."""
    return isinstance(linear, FP8Linear) and linear.bias is None and linear.granularity in ("row", "tensor")


def _shared_parts(block: nn.Module, intermediate: int, fp8: bool, dtype) -> tuple | str | None:
    """The shared expert's modules (gate_proj, up_proj, down_proj, the
    gate) when it can be expert E of the banks; None when the block has
    none; a str saying why it runs apart."""
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
    if fp8:
        if not all(_row_scaled(p) for p in parts):
            return "the expert banks are fp8 and the shared expert is not fp8 with a scale per row"
    elif any(isinstance(p, FP8Linear) for p in parts) or any(p.weight.dtype != dtype for p in parts):
        return "the shared expert is not stored as the expert banks are"
    return g, u, d, gate


def _is_block(module: nn.Module) -> bool:
    experts = getattr(module, "experts", None)
    return isinstance(experts, nn.Module) and (isinstance(experts, FP8Experts) or _holds_expert_banks(experts))


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


def _bank_names(experts: nn.Module) -> str | None:
    """Why the experts' banks are not where the kernel can read them
    (gate_up_proj [E, 2I, H] gate rows first, down_proj [E, H, I],
    contiguous), or None."""
    if getattr(experts, "is_transposed", False) or getattr(experts, "is_concatenated", True) is False:
        return ("its banks are stored transposed or with gate and up rows interleaved: the kernel's layout "
                "would be a second copy of them")
    for name in ("gate_up_proj", "down_proj"):
        if not getattr(experts, name).is_contiguous():
            return f"its {name} is not contiguous"
    return None


def _plan(block: nn.Module) -> _Kernel | str:
    """The tensors moe_layer reads for `block` (made here where a shared
    expert joins the banks), or why the block is left."""
    experts = block.experts
    known = {"experts", *_ROUTER_NAMES, *_SHARED_NAMES}
    extra = [n for n, m in block.named_children() if n not in known and any(True for _ in m.parameters())]
    extra += [n for n, b in block.named_buffers(recurse=False) if b is not None and n != "expert_bias"]
    if extra:
        return f"it holds {', '.join(extra)} beside its router and experts (optimize knows no such block)"
    router = _router(block)
    if router is None:
        return "no router module named gate or router"
    if any(p.device.type == "meta" for p in block.parameters()) or hasattr(block, "_hf_hook") or \
            any(hasattr(m, "_hf_hook") for m in block.modules()):
        return "offloaded (accelerate's hook or the meta device): its weights are not where the kernel reads them"
    fp8 = isinstance(experts, FP8Experts)
    if not fp8:
        banks = _expert_banks(experts)
        if isinstance(banks, str):  # worded for quantize_fp8: the same banks run the same kernels
            return f"its experts {type(experts).__name__}: {banks}"
        why = _bank_names(experts)
        if why:
            return why
    gate_up, down = experts.gate_up_proj, experts.down_proj
    e, hidden, intermediate = gate_up.shape[0], gate_up.shape[2], gate_up.shape[1] // 2
    rw = getattr(router, "weight", None)
    dtype = rw.dtype if isinstance(rw, torch.Tensor) else None
    bias = getattr(block, "expert_bias", None) if getattr(block, "use_expert_bias", True) else None
    sem = _router_semantics(router, hidden, gate_up.device, dtype, bias if isinstance(bias, torch.Tensor) else None)
    if isinstance(sem, str):
        return sem
    top_k, renormalize, scoring = sem
    uses_bias = scoring.expert_bias is not None
    scoring = dataclasses.replace(scoring, expert_bias=None)  # the block's own buffer is read at each call
    if rw.shape[0] != e:
        return f"its router has {rw.shape[0]} rows for {e} experts"
    shared = _shared_parts(block, intermediate, fp8, dtype)
    if isinstance(shared, str) and not (isinstance(getattr(block, "shared_expert", None), nn.Module)
                                        and isinstance(getattr(block, "shared_expert_gate", None), nn.Module)):
        return (
            f"{shared}: optimize runs a shared expert apart only as sigmoid(shared_expert_gate(x)) * shared_expert(x)"
        )
    fused_shared = isinstance(shared, tuple)
    if e + fused_shared > MAX_EXPERTS:
        return f"{e} experts: moe_route takes at most {MAX_EXPERTS}"
    gate_up_scale = experts.gate_up_scale if fp8 else None
    down_scale = experts.down_scale if fp8 else None
    k_router = rw.detach()
    if fused_shared:
        g, u, d, gate = shared
        with torch.no_grad():
            gate_up = torch.cat([gate_up, torch.cat([g.weight, u.weight])[None]])
            down = torch.cat([down, d.weight[None]])
            if fp8:
                rows = [p.weight_scale.reshape(-1).expand(p.out_features) for p in (g, u, d)]
                gate_up_scale = torch.cat([gate_up_scale, torch.cat(rows[:2])[None]])
                down_scale = torch.cat([down_scale, rows[2][None]])
            gate_row = gate.dequantize() if isinstance(gate, FP8Linear) else gate.weight
            k_router = torch.cat([k_router, gate_row.detach().to(dtype)])
    kernel = _Kernel(k_router, gate_up.detach(), down.detach(), gate_up_scale, down_scale, top_k, renormalize,
                     fused_shared, scoring, router, uses_bias, shared_apart=isinstance(shared, str),
                     shared_reason=shared if isinstance(shared, str) else None)
    if fused_shared:
        g, u, d, gate = shared
        i = intermediate
        kernel.alias(experts, "gate_up_proj", "gate_up", slice(0, e))
        kernel.alias(experts, "down_proj", "down", slice(0, e))
        kernel.alias(router, "weight", "router", slice(0, e))
        kernel.alias(g, "weight", "gate_up", (e, slice(0, i)))
        kernel.alias(u, "weight", "gate_up", (e, slice(i, 2 * i)))
        kernel.alias(d, "weight", "down", e)
        if fp8:
            kernel.alias(experts, "gate_up_scale", "gate_up_scale", slice(0, e))
            kernel.alias(experts, "down_scale", "down_scale", slice(0, e))
            for p, source, index in ((g, "gate_up_scale", (e, slice(0, i))), (u, "gate_up_scale", (e, slice(i, 2 * i))),
                                     (d, "down_scale", e)):
                if p.granularity == "row":  # (a tensor scale repeated over the rows stays the module's own)
                    kernel.alias(p, "weight_scale", source, index)
        if not isinstance(gate, FP8Linear) and gate.weight.dtype == dtype:
            kernel.alias(gate, "weight", "router", slice(e, e + 1))
    return kernel


def _same_output(block, kernel: _Kernel) -> str | None:
    """None if the fused path, with torch's ops, gives the block's output on
    a probe, else why not. `block` is already of the fused class."""
    hidden, device, dtype = kernel.router.shape[1], kernel.router.device, kernel.router.dtype
    x = torch.randn(1, 8, hidden, generator=torch.Generator().manual_seed(1)).to(device=device, dtype=dtype)
    own = original_class(type(block)).forward
    with torch.no_grad():
        try:
            want = own(block, x)
        except Exception as e:  # noqa: BLE001 - a block that is not transformers'
            return f"it raised on a probe [1, 8, {hidden}]: {type(e).__name__}: {e}"
        if not (isinstance(want, torch.Tensor) and want.shape == x.shape):
            return "its forward does not return one tensor of its input's shape"
        try:
            got = block._fused(True, x, None)
        except Exception as e:  # noqa: BLE001 - parts of another shape than the plan read them
            return mismatch(f"its fused path raised on a probe: {type(e).__name__}: {e}")
    err = float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30))
    # The block's experts and the reference's sum in other orders; fp8 experts take bfloat16 activations,
    # an fp8 shared expert of a float32 model did not: bf16 rounding apart.
    tol = 1e-4 if dtype == torch.float32 and kernel.gate_up_scale is None else 3e-2
    if not err <= tol:
        return mismatch(f"its output differs from a softmax top-k block's on a probe (relative error {err:.2g}): "
                        f"it computes something optimize does not know")
    return None


def _describe(block: nn.Module, k: _Kernel) -> str:
    kind = "fp8" if k.gate_up_scale is not None else str(k.router.dtype).replace("torch.", "")
    shared = (f"shared expert fused as expert {k.routed}" if k.fused_shared else
              f"shared expert run apart ({k.shared_reason})" if k.shared_apart else "no shared expert")
    return (f"{original_class(type(block)).__name__} -> moe_layer: {k.routed} {kind} experts, top-{k.top_k}"
            f"{', renormalised' if k.renormalize else ''}, {shared}"
            + (f"; {k.scoring.describe(k.uses_bias)} router"
               if k.scoring.sigmoid else ""))


class MoEPass(Pass):
    """A mixture-of-experts block (module docstring) -> its decode on
    moe_layer (its class swapped; its parameters stay, as views of the
    kernel's banks where a shared expert joins them)."""

    name = "moe"
    title = "MoE blocks on torch.ops.mps_ext.moe_layer (one call per layer at decode)"

    def candidates(self, model):
        names, inside = [], []  # blocks found: their banks are not candidates again
        for name, mod in model.named_modules():
            if any(name.startswith(p + ".") for p in inside):
                continue
            if isinstance(mod, FusedMoEMixin) or _is_block(mod):
                inside.append(name)
                names.append(name)
            elif _holds_expert_banks(mod):
                names.append(name)
        return names

    def refuse(self, model):
        for name in self.candidates(model):
            block = model.get_submodule(name) if name else model
            why = _is_block(block) and not isinstance(block, FusedMoEMixin) and _dtype_refusal(block)
            if why:
                raise ValueError(why)

    def already(self, module):
        return isinstance(module, FusedMoEMixin)

    def plan(self, model, name, module):
        if not _is_block(module):
            return "expert banks outside a block with an `experts` child (optimize knows no such block)"
        return _plan(module)

    def probe(self, model, name, module, plan):
        cls = type(module)
        module.__class__ = _fused_class(cls)
        module._mps_ext_moe = plan
        try:
            return _same_output(module, plan)
        finally:
            module.__class__ = cls
            del module._mps_ext_moe

    def apply(self, model, name, module, plan):
        module.__class__ = _fused_class(type(module))
        module._mps_ext_moe = plan
        with torch.no_grad():
            plan.point_aliases()  # the block's old bank storage, if a shared expert joined, is freed here
        if plan.fused_shared:
            plan.hooks.append(module.register_state_dict_post_hook(_shared_expert_state))
        return _describe(module, plan)

    def witness(self, model, name):
        return model.get_submodule(name)._mps_ext_moe.gate_up

    def revert(self, model, name):
        module = model.get_submodule(name) if name else model
        k = module._mps_ext_moe
        for handle in k.hooks:
            handle.remove()
        for m, *_ in k.aliases:  # (their tensors stay views of the banks, which they keep alive)
            m.__dict__.pop("_mps_ext_view_of", None)
        module.__class__ = original_class(type(module))
        del module._mps_ext_moe


def unfuse_blocks(model: nn.Module) -> list[str]:
    """Every optimized MoE block of `model` back to its own class (its
    parameters stay where they are): what quantize_fp8 converts, before it
    replaces their experts and shared expert; the names of those blocks."""
    names = [n for n, m in model.named_modules() if isinstance(m, FusedMoEMixin)]
    for name in names:
        MoEPass().revert(model, name)
    return names


def _shared_expert_state(module, state_dict, prefix, local_metadata):
    """The shared expert's entries as tensors of their own: its weights are
    views of the banks' row E (and its gate of the router's), and
    save_pretrained, which writes no two tensors of one storage, would
    otherwise copy the whole bank they share it with."""
    for key in state_dict:
        if key.startswith((prefix + "shared_expert.", prefix + "shared_expert_gate.")):
            state_dict[key] = state_dict[key].clone()
