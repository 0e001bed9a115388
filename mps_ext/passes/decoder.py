"""A decoder layer's residual adds around its post-attention norm on one
dispatch, for mps_ext.optimize: the layers of transformers' Qwen3 and
Qwen3-MoE, Qwen3.5/3.6-MoE (full and linear attention) and LFM2 / LFM2-MoE,
and the layers of the same structure in other models.

Eager, after the other swaps, such a layer still runs between its mixer
(attention, Gated DeltaNet or short convolution) and its feed-forward
`h = residual + mixer_out` (an add), `post_norm(h)` (FusedRMSNorm: one
rms_norm) and, after the feed-forward, `h + ffn(normed)` (an add). Here the
first two are one torch.ops.mps_ext.add_rms_norm dispatch
(mps_ext.passes.norm.add_rms_norm), and an optimized MoE feed-forward is called as
`ffn(normed, residual=h)`, which returns the sum itself (so that its op can
add it in its last dispatch); a dense MLP keeps `h + mlp(normed)`. Where an
optimized MoE feed-forward would run its op on the normed rows with the
sum inside, the add, the norm and the block are one
torch.ops.mps_ext.add_rms_norm_moe_layer call instead (the add and the norm
in the router GEMV's dispatch; FusedMoEMixin._mps_ext_add_norm_call). The rest
of the forward is the model's, line for line: the input norm, the mixer
called with the layer's arguments as the model's forward passes them.

A layer is recognised by its parts, not its class: an input norm, a post
norm and a feed-forward by the names of one of the layouts below, both
norms FusedRMSNorm (fuse_norms ran), one mixer of that layout's names,
nothing else, and a forward of transformers 5's arguments (hidden_states
and keywords among attention_mask, position_ids, past_key_values,
use_cache, position_embeddings, then **kwargs). Such a module gets a
subclass of its own class whose forward takes the fused path (`__class__`
swapped: the parameters, the state dict and the module tree stay as they
were); then, on a probe, its output and the call its mixer receives must
equal, bit for bit and object for object, its own forward's, both with
torch's ops and a stand-in mixer: so a forward that does anything else, or
calls its mixer otherwise, is found, and the layer is left as it was, with
the reason.

Where the fused path does not pay or cannot run, the layer runs its own
forward: under torch.compile (Inductor fuses the adds with the norms in its
own kernels), where mps_ext's kernels do not run (FusedRMSNorm.op_takes),
and where autograd needs a derivative.
"""

from __future__ import annotations

import dataclasses
import inspect

import torch
from torch import nn

from ._classes import fused_subclass, original_class, register_maker, register_mixin
from ._protocol import Pass, mismatch
from .moe import FusedMoEMixin
from .norm import FusedRMSNorm, add_rms_norm, add_then_norm
from .projections import norm_into_projection

__all__ = ["DecoderPass", "FusedDecoderLayerMixin"]


@dataclasses.dataclass(frozen=True)
class _Layout:
    input_norm: str
    post_norm: str
    ffn: str
    mixers: tuple[str, ...]


_LAYOUTS = (
    _Layout("input_layernorm", "post_attention_layernorm", "mlp", ("self_attn", "linear_attn")),  # Qwen3, Qwen3.5
    _Layout("operator_norm", "ffn_norm", "feed_forward", ("self_attn", "conv")),  # LFM2, LFM2-MoE
)
# The layer forward's arguments besides hidden_states (transformers 5). The
# layers pass the attention each of them they take; the linear attention
# and the short convolution none of the positions, and the Gated DeltaNet
# the cache as cache_params.
_ARGUMENTS = ("attention_mask", "position_ids", "past_key_values", "cache", "use_cache", "position_embeddings")
_NOT_PASSED = {"linear_attn": ("position_ids", "position_embeddings"), "conv": ("position_ids", "position_embeddings")}
_RENAMED = {"linear_attn": {"past_key_values": "cache_params"}}
_RETURNS_WEIGHTS = ("self_attn",)  # (output, attention weights)
_PROBE_TOKENS = 3


@dataclasses.dataclass(frozen=True)
class _Plan:
    layout: _Layout
    mixer: str
    signature: inspect.Signature  # the original forward's (the probe's)
    passed: tuple[tuple[str, str], ...]  # (the layer's argument, the mixer's keyword)
    var_keyword: str  # the name of the forward's **kwargs
    positional: tuple[str, ...] = ()  # its parameters after self a caller may pass by position, in order
    names: frozenset = frozenset()  # all its named parameters after self
    defaults: tuple[tuple[str, object], ...] = ()  # (name, default) of those that have one

    def bind(self, args: tuple, kwargs: dict) -> dict | None:
        """The forward's arguments by name, defaults applied and the other
        keywords under var_keyword, as signature.bind(...).arguments gives
        them; None where bind would raise (the layer's own forward then
        runs, and raises). Not inspect.Signature.bind: this runs once a
        layer and token, where bind took about 7 us of host time."""
        if len(args) > len(self.positional):
            return None
        given = self.positional[:len(args)]
        arguments = dict(self.defaults)
        arguments.update(zip(given, args))
        rest = {}
        for k, v in kwargs.items():
            if k in given:
                return None  # given twice
            if k in self.names:
                arguments[k] = v
            else:
                rest[k] = v
        if len(arguments) != len(self.names):
            return None  # a required argument missing
        arguments[self.var_keyword] = rest
        return arguments


@register_mixin
class FusedDecoderLayerMixin:
    """The forward of a transformers 5 decoder layer with its residual add
    and post-attention norm as one mps_ext.passes.norm.add_rms_norm call
    (an optimized MoE feed-forward adding the second residual); the layer's own
    forward (the next class in the MRO) where that does not run (module
    docstring)."""

    def forward(self, *args, **kwargs):
        call = self._mps_ext_fused_call(False, args, kwargs)
        return super().forward(*args, **kwargs) if call is None else call()

    def _mps_ext_fused_call(self, reference: bool, args: tuple, kwargs: dict):
        """The call on the fused path (reference: torch's add and the norm
        module for add_rms_norm, wherever it would run), as a function of no
        arguments; None where the layer's own forward runs."""
        plan = self._mps_ext_decoder
        arguments = plan.bind(args, kwargs)
        x = None if arguments is None else arguments["hidden_states"]
        if not isinstance(x, torch.Tensor):
            return None
        if reference:
            return lambda: self._fused_forward(add_then_norm, arguments)
        if not getattr(self, plan.layout.post_norm).op_takes(x, compiled=True):
            return None
        return lambda: self._fused_forward(add_rms_norm, arguments)

    def _fused_forward(self, add_norm, arguments: dict):
        """The model's forward from its bound arguments, with `add_norm(x,
        residual, norm)` (add_rms_norm; the probe: add_then_norm) in place of
        `h = residual + x; normed = norm(h)`."""
        plan, layout = self._mps_ext_decoder, self._mps_ext_decoder.layout
        residual = arguments["hidden_states"]
        passed = {keyword: arguments[name] for name, keyword in plan.passed}
        mixer = getattr(self, plan.mixer)
        norm = getattr(self, layout.input_norm)
        kwargs = {**passed, **arguments[plan.var_keyword]}
        # A mixer that takes its first projection's product only on its own decode step (the short
        # convolution's in_proj) says whether this call runs it.
        takes = getattr(mixer, "_mps_ext_takes_product", None)
        if add_norm is add_then_norm or (takes is not None and not takes(residual, kwargs)):
            normed = norm(residual)
        else:
            normed = norm_into_projection(residual, norm, mixer)
        hidden_states = mixer(hidden_states=normed, **kwargs)
        if plan.mixer in _RETURNS_WEIGHTS:
            hidden_states, _ = hidden_states
        ffn, post_norm = getattr(self, layout.ffn), getattr(self, layout.post_norm)
        if add_norm is add_rms_norm and isinstance(ffn, FusedMoEMixin):
            # The add and the norm in the MoE router's dispatch, where both ops would run.
            call = ffn._mps_ext_add_norm_call(hidden_states, residual, post_norm)
            if call is not None:
                return call()
        hidden_states, normed = add_norm(hidden_states, residual, post_norm)
        if isinstance(ffn, FusedMoEMixin):
            return ffn(normed, residual=hidden_states)
        out = ffn(normed)
        if isinstance(out, tuple):  # Qwen3.5's MoE blocks return (output, router logits) when left unfused
            out, _ = out
        return hidden_states + out


def _fused_class(cls: type) -> type:
    return fused_subclass(
        FusedDecoderLayerMixin, cls,
        f"{cls.__name__} with its residual add and post-attention norm on one torch.ops.mps_ext.add_rms_norm "
        "call (mps_ext.optimize).")


register_maker(FusedDecoderLayerMixin, _fused_class)


def _plan(mod: nn.Module, layout: _Layout) -> _Plan | str:
    """What the fused forward needs to know of `mod`, or why it cannot
    stand for mod's forward (before the probe)."""
    norms = [getattr(mod, n) for n in (layout.input_norm, layout.post_norm)]
    if not all(isinstance(n, FusedRMSNorm) for n in norms):
        return (f"its {layout.input_norm} and {layout.post_norm} ({', '.join(type(n).__name__ for n in norms)}) "
                "are not RMSNorms optimize fuses")
    mixers = [n for n in layout.mixers if isinstance(getattr(mod, n, None), nn.Module)]
    if len(mixers) != 1:
        return f"it holds {len(mixers)} of the mixers {', '.join(layout.mixers)} (optimize knows layers of one)"
    extra = [n for n, _ in mod.named_children() if n not in (layout.input_norm, layout.post_norm, layout.ffn, *mixers)]
    if extra:
        return (
            f"it holds {', '.join(extra)} beside its norms, {mixers[0]} and {layout.ffn} (optimize knows no such layer)"
        )
    try:
        signature = inspect.signature(type(mod).forward)
    except (TypeError, ValueError):
        return "its forward has no signature to bind the caller's arguments with"
    params = list(signature.parameters.values())
    named = [p.name for p in params[2:] if p.kind != inspect.Parameter.VAR_KEYWORD]
    if len(params) < 3 or [p.name for p in params[:2]] != ["self", "hidden_states"] or \
            params[-1].kind != inspect.Parameter.VAR_KEYWORD or any(n not in _ARGUMENTS for n in named) or \
            any(p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in params[1:-1]):
        return ("its forward is not transformers 5's (hidden_states, then among " + ", ".join(_ARGUMENTS)
                + ", then **kwargs)")
    mixer = mixers[0]
    renamed = _RENAMED.get(mixer, {})
    passed = tuple((n, renamed.get(n, n)) for n in named if n not in _NOT_PASSED.get(mixer, ()))
    named_params = params[1:-1]
    return _Plan(layout, mixer, signature, passed, params[-1].name,
                 positional=tuple(p.name for p in named_params if p.kind == p.POSITIONAL_OR_KEYWORD),
                 names=frozenset(p.name for p in named_params),
                 defaults=tuple((p.name, p.default) for p in named_params if p.default is not p.empty))


def _probe(mod: nn.Module, original, plan: _Plan) -> str | None:
    """Why mod (already swapped) does not give its own forward's output and
    mixer call on a probe, or None if it does (module docstring)."""
    w = getattr(mod, plan.layout.post_norm).weight
    if w.device.type == "meta":
        return "on the meta device: nothing to probe"
    g = torch.Generator().manual_seed(0)
    x, mixed = (torch.randn(1, _PROBE_TOKENS, w.shape[0], generator=g).to(w.device, w.dtype) for _ in range(2))
    # Stand-ins the forward passes on to its mixer untouched: each must arrive as itself.
    arguments = {name: object() for name in plan.signature.parameters if name in _ARGUMENTS}
    extra = {"_mps_ext_probe": object()}
    mixer = getattr(mod, plan.mixer)
    calls = []

    def stand_in(*args, **kwargs):
        calls.append((args, kwargs))
        return (mixed, None) if plan.mixer in _RETURNS_WEIGHTS else mixed

    modes = [(m, m.training) for m in mod.modules()]
    mod.train(False)  # dropout apart
    own = mixer.__dict__.get("forward")  # a hook's wrapper (accelerate's offload sets one) stays
    mixer.forward = stand_in  # an instance attribute: nn.Module.__call__ finds it before the class's
    try:
        with torch.no_grad():
            try:
                want = original(mod, x, **arguments, **extra)
            except Exception as e:  # noqa: BLE001 - a forward that uses an argument itself
                return f"its own forward raised on a probe ({type(e).__name__}: {e})"
            got = mod._fused_forward(add_then_norm, {"hidden_states": x, **arguments,
                                                              plan.var_keyword: extra})
    finally:
        if own is None:
            del mixer.forward
        else:
            mixer.forward = own
        for m, training in modes:
            m.training = training
    if len(calls) != 2:
        return f"its forward called {plan.mixer} {len(calls) - 1} times on a probe (optimize knows layers that call it once)"  # noqa: E501
    (want_args, want_kwargs), (got_args, got_kwargs) = calls
    same_call = (not want_args and not got_args and want_kwargs.keys() == got_kwargs.keys()
                 and torch.equal(want_kwargs["hidden_states"], got_kwargs["hidden_states"])
                 and all(want_kwargs[k] is got_kwargs[k] for k in want_kwargs if k != "hidden_states"))
    if not same_call:
        return (f"its forward calls {plan.mixer} otherwise than optimize would (keywords "
                f"{sorted(want_kwargs)} against {sorted(got_kwargs)})")
    if not (isinstance(want, torch.Tensor) and want.shape == got.shape and torch.equal(got, want)):
        return mismatch("its output differs on a probe: its forward does something else than the residual adds "
                        "and norms")
    return None


def _layout_of(mod: nn.Module) -> _Layout | None:
    return next((lay for lay in _LAYOUTS if all(isinstance(getattr(mod, n, None), nn.Module)
                                                 for n in (lay.input_norm, lay.post_norm, lay.ffn))), None)


class DecoderPass(Pass):
    """A decoder layer of one of the layouts (module docstring) -> its
    residual add and post-attention norm on add_rms_norm (its class
    swapped)."""

    name = "decoder_layers"
    title = "decoder layers with the residual add and post-attention norm on torch.ops.mps_ext.add_rms_norm " \
            "(one dispatch)"
    # Its probe runs each layer's mixer and feed-forward as they will run.
    after = ("moe", "linear_attention", "short_conv", "norms", "projections", "attention")
    stateful = True

    def candidates(self, model):
        return [n for n, m in model.named_modules() if isinstance(m, FusedDecoderLayerMixin) or _layout_of(m)]

    def already(self, module):
        return isinstance(module, FusedDecoderLayerMixin)

    def plan(self, model, name, module):
        return _plan(module, _layout_of(module))

    def probe(self, model, name, module, plan):
        cls = type(module)
        module.__class__ = _fused_class(cls)
        module._mps_ext_decoder = plan
        try:
            return _probe(module, cls.forward, plan)
        finally:
            module.__class__ = cls
            del module._mps_ext_decoder

    def apply(self, model, name, module, plan):
        cls = type(module)
        module.__class__ = _fused_class(cls)
        module._mps_ext_decoder = plan
        ffn = getattr(module, plan.layout.ffn)
        return f"{cls.__name__} -> {plan.mixer}'s residual add and {plan.layout.post_norm} on add_rms_norm" + (
            " (at decode in the MoE router's dispatch: add_rms_norm_moe_layer), the second residual add in the MoE "
            "block's moe_layer call" if isinstance(ffn, FusedMoEMixin) else ""
        )

    def witness(self, model, name):
        return getattr(model.get_submodule(name), model.get_submodule(name)._mps_ext_decoder.layout.post_norm).weight

    def revert(self, model, name):
        module = model.get_submodule(name) if name else model
        module.__class__ = original_class(type(module))
        module.__dict__.pop("_mps_ext_decoder", None)
