"""Whether the CPU Metal executor was asked for.

On CPU tensors mps_ext's modules use torch's own CPU ops: the executor runs
Metal kernels thousands of times slower than a CPU library, and a user who
quantizes on the CPU and tries a forward before `.to("mps")` must not pay
that. Tests and the whole-model runner ask for the executor explicitly:

    with mps_ext._executor_request.request():
        model(x)   # CPU tensors go through the Metal kernels on the executor

The same holds for every torch.ops.mps_ext op on CPU tensors where a Metal
GPU backend exists (a Mac): outside request() they run torch's CPU kernel
(counted as a fallback, "the CPU Metal executor was not asked for"), or, for
mps_ext's own ops, which torch has no kernel for, raise saying so. The op
layer (csrc/dispatch/registry.h, route) reads this thread's request from the
native extension, which request() tells. Where no Metal backend exists
(Linux) the executor is the only backend and always runs.
"""

from __future__ import annotations

import contextlib
import contextvars

_REQUESTED = contextvars.ContextVar("mps_ext_executor_requested", default=False)


def requested() -> bool:
    """True inside `request()`."""
    return _REQUESTED.get()


@contextlib.contextmanager
def request():
    """Run CPU tensors of mps_ext's modules through the executor in this block."""
    token = _REQUESTED.set(True)
    native = _native()
    if native is not None:
        native._set_executor_requested(True)
    try:
        yield
    finally:
        if native is not None:
            native._set_executor_requested(False)
        _REQUESTED.reset(token)


def _native():
    """mps_ext._C, or None where it did not load (then no op runs anyway)."""
    try:
        from . import _C
    except Exception:  # mps_ext reports why (unavailable_reason)
        return None
    return _C
