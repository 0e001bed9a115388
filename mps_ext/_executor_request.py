"""Whether the CPU Metal executor was asked for.

On CPU tensors mps_ext's modules use torch's own CPU ops: the executor runs
Metal kernels thousands of times slower than a CPU library, and a user who
quantizes on the CPU and tries a forward before `.to("mps")` must not pay
that. Tests and the whole-model runner ask for the executor explicitly:

    with mps_ext._executor_request.request():
        model(x)   # CPU tensors go through the Metal kernels on the executor
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
    try:
        yield
    finally:
        _REQUESTED.reset(token)
