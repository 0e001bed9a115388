"""Every shader of kernels_metal/ passes check mode (Metal's address spaces,
the lint), and is referenced by the build."""

from pathlib import Path

import pytest

from mps_ext.cpu_metal._compiler import check_file

ROOT = Path(__file__).resolve().parent.parent
SHADERS = sorted((ROOT / "kernels_metal").glob("*.metal"))


def test_there_are_shaders():
    assert {p.stem for p in SHADERS} >= {"softmax", "pad"}


@pytest.mark.parametrize("path", SHADERS, ids=lambda p: p.name)
def test_check_mode_finds_nothing(path):
    assert check_file(path) == []
