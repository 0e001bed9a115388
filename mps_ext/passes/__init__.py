"""`mps_ext.optimize(model)`: a loaded model on mps_ext's fastest path, in
place, as a sequence of passes.

Each pass (_protocol.Pass) converts one kind of module: it recognises
candidates by their parts, plans each, proves on a probe that the
conversion gives the original's outputs, then converts it; a module it
cannot prove is left as it was, with the reason. The passes that touch a
generate cache are proved again together in a generate episode
(_episode.py). PASSES is the order they run in, each after the passes it
needs (`Pass.after`):

| pass | converts | into |
|---|---|---|
| moe | mixture-of-experts blocks (router, experts, shared expert) | their decode on moe_layer, one call |
| linear_attention | Gated DeltaNet layers (Qwen3.5/3.6) | their decode step on linear_attention_decode |
| short_conv | LFM2's short-convolution layers | their decode step on short_conv_decode |
| norms | RMSNorm modules | FusedRMSNorm: rms_norm |
| projections | projections reading one input (q/k/v, gate/up, ...) | one linear layer, one GEMV |
| attention | attention with per-head q/k norms | q/k norms + rotary on qk_norm_rope; gate, KV cache append |
| decoder_layers | decoder layers | residual add + post-attention norm on add_rms_norm |
| rotary | text models' rotary embeddings (cos, sin of positions) | eager, one gather from a table of their outputs |

What each did is `model.optimize_summary` (OptimizeSummary: one Section per
pass), also logged; a probe that finds a module computing something else
than the pass knows is logged as a warning.
"""

from __future__ import annotations

import dataclasses
import logging

from torch import nn

from ._episode import run_episode
from ._protocol import Pass, ProbeMismatch, Section, run_pass
from .attention import AttentionPass
from .decoder import DecoderPass
from .linear_attention import LinearAttentionPass
from .moe import FusedMoEMixin, MoEPass
from .norm import FusedRMSNorm, NormPass
from .projections import ProjectionsPass
from .rotary import RotaryTablePass
from .short_conv import ShortConvPass

__all__ = ["PASSES", "AttentionPass", "DecoderPass", "FusedMoEMixin", "FusedRMSNorm", "LinearAttentionPass",
           "MoEPass", "NormPass", "OptimizeSummary", "Pass", "ProjectionsPass", "RotaryTablePass", "Section",
           "ShortConvPass", "optimize", "run_pass"]

logger = logging.getLogger(__name__)

PASSES: tuple[Pass, ...] = (MoEPass(), LinearAttentionPass(), ShortConvPass(), NormPass(), ProjectionsPass(),
                            AttentionPass(), DecoderPass(), RotaryTablePass())


def _check_order(passes) -> None:
    seen = set()
    for p in passes:
        missing = [a for a in p.after if a not in seen]
        if missing:
            raise RuntimeError(f"optimize's pass {p.name} runs before {missing}, which it needs first")
        seen.add(p.name)


_check_order(PASSES)


def _model_bytes(model: nn.Module) -> int:
    from ..fp8 import _model_bytes as count
    return count(model)


@dataclasses.dataclass
class OptimizeSummary:
    """What optimize did: one Section per pass (`sections[name]`, also
    `summary[name]`), in the order they ran, and the bytes of the model's
    parameters and buffers before and after."""

    sections: dict[str, Section]
    bytes_before: int
    bytes_after: int

    def __getitem__(self, name: str) -> Section:
        return self.sections[name]

    def __str__(self) -> str:
        lines = [f"optimize: parameters and buffers {self.bytes_before:,} -> {self.bytes_after:,} bytes"]
        for s in self.sections.values():
            if not (s.converted or s.already or s.left):
                continue
            lines.append(f"optimize: {len(s.converted)} {s.title}, {len(s.already)} already, {len(s.left)} left")
            lines += [f"    {name}: {what}" for name, what in s.converted.items()]
            lines += [f"    left {name}: {why}" for name, why in s.left.items()]
        return "\n".join(lines)


def optimize(model: nn.Module) -> nn.Module:
    """Put `model` on mps_ext's fastest path, in place; returns the model.
    Each pass of PASSES (module docstring) converts the modules it proves;
    the rest stay as they were. Idempotent. `model.optimize_summary` says
    what each pass converted and left, and why. Works on floating and
    quantize_fp8'd models, on any device (CPU tensors run torch's own
    ops); eager and torch.compile. Raises TypeError for anything but an
    nn.Module and ValueError for modules in a dtype the kernels do not
    take, before any module changes."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"mps_ext.optimize takes a torch.nn.Module (a loaded model), got {type(model).__name__}")
    bytes_before = _model_bytes(model)
    for p in PASSES:
        p.refuse(model)
    sections = {p.name: run_pass(p, model) for p in PASSES}
    _prove_stateful(model, sections)
    summary = OptimizeSummary(sections, bytes_before, _model_bytes(model))
    model.optimize_summary = summary
    logger.info("%s", summary)
    mismatched = [f"{name} ({p})" for p, s in sections.items() for name in s.mismatched]
    if mismatched:
        logger.warning("mps_ext.optimize left %d modules whose probe gave other outputs than the pass's fused path "
                       "(model.optimize_summary says why): %s", len(mismatched), ", ".join(mismatched[:8])
                       + (", ..." if len(mismatched) > 8 else ""))
    return model


def _prove_stateful(model: nn.Module, sections: dict[str, Section]) -> None:
    """The generate episode over every conversion of the stateful passes;
    those it does not prove are converted back, with the reason."""
    modules = {}
    owner = {}
    for p in PASSES:
        if p.stateful:
            for name in sections[p.name].converted:
                module = model.get_submodule(name) if name else model
                modules[name] = (module, getattr(p, "tolerance", lambda m: 0.0)(module))
                owner[name] = p
    if not modules:
        return
    for name, why in run_episode(model, modules).items():
        p = owner[name]
        p.revert(model, name)
        s = sections[p.name]
        del s.converted[name]
        s.left[name] = why
        if "differs" in why:
            s.left[name] = ProbeMismatch(why)
            s.mismatched.append(name)
