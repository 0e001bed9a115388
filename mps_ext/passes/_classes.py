"""The classes optimize swaps modules into: a module whose forward a pass
puts on a fused path takes, as its `__class__`, a subclass of its own class
with the pass's mixin first in the MRO (the mixin's forward, the module's
own through super()), so the parameters, the state dict and the module tree
stay as they were.

Made classes pickle by name (torch.save(model), copy.deepcopy, multiprocessing):
each is registered in this module under a name that encodes its mixin and
the class it extends, and this module's __getattr__ makes it again from
that name in a process that has not made it yet (the original class
imported by its module and qualified name, as pickle imports any class).
"""

from __future__ import annotations

import base64
import importlib

_MADE: dict[tuple[type, type], type] = {}
_MIXINS: dict[str, type] = {}  # mixin name -> mixin, for classes made again by name


def register_mixin(mixin: type) -> type:
    """Class decorator: a mixin whose made classes pickle by name."""
    _MIXINS[mixin.__name__] = mixin
    return mixin


def original_class(cls: type) -> type:
    """The class a made class extends (itself for any other class)."""
    return cls.__dict__.get("_mps_ext_original", cls)


def _encode(cls: type) -> str:
    text = f"{cls.__module__}:{cls.__qualname__}".encode()
    return base64.b32encode(text).decode().rstrip("=")


def _decode(code: str) -> type:
    text = base64.b32decode(code + "=" * (-len(code) % 8)).decode()
    module, _, qualname = text.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def fused_subclass(mixin: type, cls: type, doc: str, **attrs) -> type:
    """`mixin` over `cls`, named Fused<cls> for people and registered here
    for pickle (module docstring), made once per pair (every layer of a
    model shares it); `cls` itself if it already is one. `attrs`: class
    attributes the mixin reads."""
    if issubclass(cls, mixin):
        return cls
    if (mixin, cls) not in _MADE:
        if _MIXINS.get(mixin.__name__) is not mixin:
            raise TypeError(f"{mixin.__name__} is not a registered mixin (register_mixin)")
        name = f"Fused{cls.__name__}_{mixin.__name__}_{_encode(cls)}"
        made = type(f"Fused{cls.__name__}", (mixin, cls),
                    {"__module__": __name__, "__qualname__": name, "__doc__": doc, "_mps_ext_original": cls,
                     **attrs})
        _MADE[mixin, cls] = made
        globals()[name] = made
    return _MADE[mixin, cls]


# Made again by name, for pickle: the mixin's module (which calls
# fused_subclass with the class attributes it needs) says how.
_MAKERS: dict[str, object] = {}


def register_maker(mixin: type, make) -> None:
    """`make(cls)` gives mixin's class over cls, as the pass makes it."""
    _MAKERS[mixin.__name__] = make


def __getattr__(name: str):
    if name.startswith("Fused") and name.count("_") >= 2:
        # The class's own name may hold underscores; the mixin's and the code's do not.
        head, code = name.rsplit("_", 1)
        mixin_name = head.rsplit("_", 1)[1]
        if mixin_name in _MAKERS:
            made = _MAKERS[mixin_name](_decode(code))
            if globals().get(name) is made:
                return made
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
