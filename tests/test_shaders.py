"""Every shader of kernels_metal/ passes check mode (Metal's address spaces,
the lint), and is referenced by the build."""

from pathlib import Path

import pytest

from mps_ext_executor._compiler import check_file

ROOT = Path(__file__).resolve().parent.parent
SHADERS = sorted((ROOT / "kernels_metal").glob("*.metal"))


def test_there_are_shaders():
    assert {p.stem for p in SHADERS} >= {"softmax", "pad"}


@pytest.mark.parametrize("path", SHADERS, ids=lambda p: p.name)
def test_check_mode_finds_nothing(path):
    assert check_file(path) == []


# Kernels whose code assumes a threadgroup size declare it (the host's sizes,
# kernels_metal/*_params.h), and the executor refuses a bigger threadgroup, as
# a Metal pipeline would: an op that asked for more would fail its tests.
DECLARED = [("linear", "gemv_rows_f32_r1_q1_vec", 512), ("linear", "gemv_cols_f16_r8_scalar", 256),
            ("linear", "gemv_cols_finish_bf16", 256),
            ("softmax", "softmax_segment_f32_f32_i32_vec", 256), ("softmax", "softmax_block_bf16_bf16_i32", 512),
            ("softmax", "softmax_partial_f16_i64", 256), ("softmax", "softmax_backward_finish_f32_f16_i32_vec", 256),
            ("softmax", "softmax_strided_f16_f32_i32", 512), ("softmax", "softmax_backward_strided_bf16_bf16_i64", 512),
            ("pad", "constant_pad_1_i32", 256), ("pad", "constant_pad_8_i64", 256)]


@pytest.mark.parametrize("library,kernel,declared", DECLARED, ids=[d[1] for d in DECLARED])
def test_declared_threadgroup_size_is_enforced(library, kernel, declared):
    import torch

    import mps_ext_executor as cpu_metal
    from tools.embed_shaders import source

    lib = cpu_metal.compile_library(source(library), filename=f"{library}.metal")
    args = [torch.zeros(16) for _ in range(5)]
    with pytest.raises(cpu_metal.DispatchError, match=rf"max_total_threads_per_threadgroup\({declared}\)"):
        lib.dispatch(kernel, args, threadgroups=(1,), threads_per_threadgroup=(declared + 32,))


def test_every_kernel_declares_its_threadgroup_size():
    from mps_ext_executor import _compiler, _translate
    from tools.embed_shaders import flatten

    for library in ("linear", "softmax", "pad"):
        pre = _compiler.preprocess(flatten(ROOT / "kernels_metal" / f"{library}.metal"), f"{library}.metal", None)
        kernels = _translate.translate(pre).kernels
        assert kernels and all(k.max_threads != "0" for k in kernels), [
            k.host_name for k in kernels if k.max_threads == "0"
        ]


def test_python_builds_of_a_library_are_the_products():
    """tools/embed_shaders.source is the text the product's first call builds
    (executor/csrc/backend.cpp, from the embedded shaders), byte for byte: the
    executor caches a build under its text, so the tests' and benchmarks' own
    builds of whole libraries (embed_shaders.source) then load the product's
    instead of compiling the library again. A fresh process records what the
    product passes to the build."""
    import json
    import subprocess
    import sys

    from tools.embed_shaders import source

    code = """
import json, torch, mps_ext, mps_ext_executor
from mps_ext_executor import _compiler
built = {}
real = _compiler.build
def build(source, defines=None, filename="shader.metal", *args, **kwargs):
    built[filename] = source
    return real(source, defines, filename, *args, **kwargs)
_compiler.build = build  # backend.cpp looks build up on the module at each build
mps_ext_executor.install()
mps_ext_executor._C._set_requested(True)
torch.ops.mps_ext.sigmoid_gate(torch.randn(2, 64), torch.randn(2, 64))  # attention_gate.metal, the quickest to build
print(json.dumps(built))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr
    built = json.loads(r.stdout.strip().splitlines()[-1])
    assert list(built) == ["attention_gate.metal"]
    assert built["attention_gate.metal"] == source("attention_gate")
