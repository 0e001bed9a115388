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
    from tools.embed_shaders import flatten

    lib = cpu_metal.compile_library(flatten(ROOT / "kernels_metal" / f"{library}.metal"), filename=f"{library}.metal")
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
