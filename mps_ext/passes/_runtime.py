"""Where mps_ext's kernels run for a tensor: what each converted module
asks before it takes its fused path."""

from __future__ import annotations

import torch

from ..fp8 import _use_torch_cpu_ops


def _kernels_on_mps(family: str) -> bool:
    import mps_ext
    return mps_ext.is_available() and mps_ext._C.is_enabled(family)


# Decided when dynamo traces a graph, as fp8._cpu_kernels_requested is: a
# pybind call it cannot trace.
_kernels_on_mps._dynamo_marked_constant = True


def kernels_for(x: torch.Tensor, family: str) -> bool:
    """Whether an op of `family` runs mps_ext's kernel for x: on MPS with
    the kernels active and the family on, or on CPU tensors when the
    CPU backend's kernels were asked for (mps_ext/_cpu_backend.py)."""
    if x.device.type == "mps":
        return _kernels_on_mps(family)
    return x.device.type == "cpu" and not _use_torch_cpu_ops(x)
