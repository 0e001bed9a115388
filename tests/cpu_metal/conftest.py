import functools
from pathlib import Path

import pytest
import torch

import mps_ext_executor as cpu_metal

KERNELS = Path(__file__).parent / "kernels"


@functools.lru_cache(maxsize=None)
def load(name: str) -> cpu_metal.Library:
    """Compile tests/cpu_metal/kernels/<name>.metal once per session."""
    path = KERNELS / f"{name}.metal"
    return cpu_metal.compile_library(path.read_text(), filename=path.name)


@pytest.fixture
def kernels():
    return load


def run_through_mps_ext(file: str, name: str, args, threads: int, group: int):
    """Kernel `name` of kernels/<file>.metal on copies of `args` (on their
    device), launched through mps_ext's own backend as the ops launch theirs:
    on MPS tensors the Metal backend compiles it with the options of the
    libraries mps_ext ships (csrc/backend/metal.mm: MSL 3.1, no fast math),
    on CPU tensors the executor runs it. Returns the buffers, on the CPU."""

    if threads % group:
        raise ValueError(f"threads ({threads}) must be a multiple of the threadgroup size ({group})")
    library = f"test_kernels_{file}"
    cpu_metal._C._register_shader_source(library, (KERNELS / f"{file}.metal").read_text())
    buffers = [a.clone() for a in args]
    cpu_metal._C._launch(library, name, buffers, [threads // group, 1, 1], [group, 1, 1])
    if any(b.device.type == "mps" for b in buffers):
        torch.mps.synchronize()
    return [b.cpu() for b in buffers]
