import functools
from pathlib import Path

import pytest

from mps_ext import cpu_metal

KERNELS = Path(__file__).parent / "kernels"


@functools.lru_cache(maxsize=None)
def load(name: str) -> cpu_metal.Library:
    """Compile tests/cpu_metal/kernels/<name>.metal once per session."""
    path = KERNELS / f"{name}.metal"
    return cpu_metal.compile_library(path.read_text(), filename=path.name)


@pytest.fixture
def kernels():
    return load
