"""The classes mps_ext.optimize swaps modules into: a module whose forward
it puts on a fused path takes, as its `__class__`, a subclass of its own
class with a mixin first in the MRO (the mixin's forward, the module's own
through super()), so the parameters, the state dict and the module tree stay
as they were."""

from __future__ import annotations

_MADE: dict[tuple[type, type], type] = {}


def fused_subclass(mixin: type, cls: type, doc: str, **attrs) -> type:
    """`mixin` over `cls`, named Fused<cls>, made once per pair (every layer
    of a model shares it); `cls` itself if it already is one. `attrs`:
    class attributes the mixin reads."""
    if issubclass(cls, mixin):
        return cls
    if (mixin, cls) not in _MADE:
        _MADE[mixin, cls] = type(f"Fused{cls.__name__}", (mixin, cls),
                                 {"__module__": mixin.__module__, "__doc__": doc, **attrs})
    return _MADE[mixin, cls]


def candidates(model, mixin: type, is_candidate, why_not) -> tuple[list[str], dict[str, str], list]:
    """The modules of `model` a swap to `mixin` considers, sorted before any
    is changed: (already [names already swapped], left {name: why_not's
    reason}, plans [(name, module)] to swap). `is_candidate(module)`: holds
    the parts the swap looks for; `why_not(module)`: None or why it cannot
    take the swap (it may raise, for what the whole call refuses: before
    any layer is changed)."""
    already, left, plans = [], {}, []
    for name, mod in model.named_modules():
        if isinstance(mod, mixin):
            already.append(name)
        elif is_candidate(mod):
            why = why_not(mod)
            if why:
                left[name] = why
            else:
                plans.append((name, mod))
    return already, left, plans
