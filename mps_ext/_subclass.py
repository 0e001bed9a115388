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
