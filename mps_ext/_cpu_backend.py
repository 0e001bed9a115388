"""The backend of CPU tensors, if one is installed.

mps_ext runs its kernels on MPS tensors; as shipped it has no backend for
CPU tensors, and its modules use torch's own CPU ops there. A test or a
contributor can install one (the CPU Metal executor, executor/ in the
repository: `mps_ext_executor.install()`), which registers with the op layer
through mps_ext._C._backend_slot() and with this module through install().

Even then, mps_ext's modules take their kernels' path on CPU tensors only
where the backend says it was asked for in the calling context (its
`requested()`, inside its `request()` block): a Metal kernel on the CPU is
thousands of times slower than torch's CPU ops, and a user who quantizes on
the CPU and tries a forward before `.to("mps")` must not pay that.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager

_requested: Callable[[], bool] | None = None
_request: Callable[[], ContextManager] | None = None


def install(requested: Callable[[], bool], request: Callable[[], ContextManager]) -> None:
    """Called by a CPU backend as it registers: `requested()` says whether
    its kernels were asked for in the calling context, `request()` is the
    block that asks for them."""
    global _requested, _request
    if not callable(requested) or not callable(request):
        raise TypeError("mps_ext: a CPU backend installs with two callables, requested() and request()")
    _requested, _request = requested, request


def installed() -> bool:
    """Whether a backend of CPU tensors is installed."""
    return _requested is not None


def requested() -> bool:
    """Whether mps_ext's modules run their kernels on CPU tensors here: a
    backend is installed and was asked for in the calling context."""
    return _requested is not None and bool(_requested())


def request() -> ContextManager:
    """The installed backend's request() (nothing without one)."""
    return _request() if _request is not None else contextlib.nullcontext()
