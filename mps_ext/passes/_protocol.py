"""The protocol every pass of `mps_ext.optimize` implements, and the loop
that runs a pass over a model.

A pass recognises the modules it may convert by their parts
(`candidates`), plans each (`plan`: what the conversion needs, or why the
module is left), proves on the module alone that the conversion gives the
original's outputs (`probe`), and converts it (`apply`). One module is
planned, probed and converted before the next is looked at, and the loop
holds modules by name only, so a replaced module is freed as soon as it is
out of the model: converting costs at most one module's new weights beside
the model.

Passes whose modules keep state in a generate cache (`stateful`: attention
with its KV cache, the Gated DeltaNet and short-convolution layers, the
decoder layers that pass the cache on) are proved a second time, together,
in an episode of generation (_episode.py): a padded batch, prefill, decode
steps, a crop of the cache and a decode after it, with the cache and masks
the model itself makes. A module that gives other outputs or leaves the
cache otherwise there is converted back (`revert`), with the reason.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch
from torch import nn


@dataclasses.dataclass
class Section:
    """One pass's part of OptimizeSummary: `converted` {name: what it runs
    now}, `already` [names converted by an earlier call], `left` {name: why
    it was kept as it was}."""

    title: str
    converted: dict[str, str] = dataclasses.field(default_factory=dict)
    already: list[str] = dataclasses.field(default_factory=list)
    left: dict[str, str] = dataclasses.field(default_factory=dict)
    # Left because a probe found other outputs (a module that looked like one the pass knows): the
    # reasons a user should see, where the others say only that a module is not of the pass's kind.
    mismatched: list[str] = dataclasses.field(default_factory=list)


class Pass:
    """What every pass provides (the module docstring tells the order of
    calls). A pass holds no state between calls: its instance is the one in
    the registry (mps_ext.passes.PASSES)."""

    name: ClassVar[str] = ""    # its section of the summary, and its name in docs/optimize.md
    title: ClassVar[str] = ""   # what its converted entries are, for the summary
    after: ClassVar[tuple[str, ...]] = ()  # passes that must have run before it (the registry checks)
    stateful: ClassVar[bool] = False       # its modules are proved in a generate episode too

    def refuse(self, model: nn.Module) -> None:
        """Raise (ValueError, TypeError) for what optimize refuses as a
        whole, before any module of the model changes."""

    def candidates(self, model: nn.Module) -> list[str]:
        """The qualified names of the modules the pass looks at, taken
        before any is changed."""
        raise NotImplementedError

    def already(self, module: nn.Module) -> bool:
        """Whether `module` is this pass's conversion already."""
        raise NotImplementedError

    def plan(self, model: nn.Module, name: str, module: nn.Module) -> Any:
        """What apply needs, or a str: why the module is left."""
        raise NotImplementedError

    def probe(self, model: nn.Module, name: str, module: nn.Module, plan: Any) -> str | None:
        """None if the conversion gives the module's own outputs on a probe,
        else why not. Leaves the module as it found it."""
        raise NotImplementedError

    def apply(self, model: nn.Module, name: str, module: nn.Module, plan: Any) -> str:
        """Convert the module in place; what it runs now."""
        raise NotImplementedError

    def revert(self, model: nn.Module, name: str) -> None:
        """Undo apply (stateful passes: after a failed episode)."""
        raise NotImplementedError(f"the {self.name} pass converts for good")

    def witness(self, model: nn.Module, name: str):
        """A tensor the converted module's kernel reads (the summary's
        entry `name`): what shows, in a trace of mps_ext's ops, that the
        conversion runs."""
        raise NotImplementedError


def _exact(t: torch.Tensor) -> torch.Tensor:
    """t in float64 on the CPU, for a probe's comparison or reference: MPS
    has no float64."""
    return t.detach().to("cpu", torch.float64)


class ProbeMismatch(str):
    """A reason a module was left that a probe gave: it looked like a module
    the pass knows and computed something else."""


def mismatch(text: str) -> ProbeMismatch:
    return ProbeMismatch(text)


def run_pass(p: Pass, model: nn.Module) -> Section:
    """Plan, probe and apply `p` to each of its candidates in `model`, one
    at a time."""
    section = Section(p.title)
    for name in p.candidates(model):
        module = model.get_submodule(name) if name else model
        if p.already(module):
            section.already.append(name)
            continue
        plan = p.plan(model, name, module)
        why = plan if isinstance(plan, str) else p.probe(model, name, module, plan)
        left = getattr(plan, "left", None)  # parts of a candidate a plan leaves (projections' members)
        if left:
            section.left.update(left)
        if why is not None:
            section.left[name] = str(why)
            if isinstance(why, ProbeMismatch):
                section.mismatched.append(name)
            continue
        del module  # the loop holds no module a conversion replaces
        converted = p.apply(model, name, model.get_submodule(name) if name else model, plan)
        if isinstance(converted, dict):  # a candidate may convert under other names (a fused projection)
            section.converted.update(converted)
        else:
            section.converted[name] = converted
        del plan
    return section
