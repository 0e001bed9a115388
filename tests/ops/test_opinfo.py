"""PyTorch's own test inputs (the OpInfo database of
torch.testing._internal.common_methods_invocations: sample and reference
inputs) for every aten op mps_ext implements, run through torch.ops.mps_ext
on CPU tensors (the CPU Metal executor) and compared with the aten op on the
CPU: same values, same dtype, shape and strides, and the same error when aten
raises one. Each sample also runs on meta tensors (torch.compile's tracing),
where ours must give aten's shapes and strides.

A new op family must add its ops to CASES below (or, for an op torch's
OpInfo database has no entry for, to NO_OPINFO with the reason); the
coverage test fails until it does."""

import sys
import types
import unittest

import pytest
import torch

import mps_ext

# OpInfo's module imports `expecttest` (PyTorch's test-only dependency) for a
# TestCase base class it never uses here; a stand-in keeps that dependency
# out of mps_ext's.
try:
    import expecttest  # noqa: F401
except ImportError:
    sys.modules["expecttest"] = types.SimpleNamespace(TestCase=unittest.TestCase)

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.uint8, torch.bool,
          torch.complex64]


def _positional(s):
    return (s.input, *s.args), {}


def _softmax(s):
    x = s.input.to(s.kwargs["dtype"]) if "dtype" in s.kwargs else s.input
    return (x, s.args[0] if s.args else s.kwargs["dim"], False), {}


def _log_softmax_backward(s):
    (x, dim, _), _ = _softmax(s)
    y = torch._log_softmax(x, dim, False)
    grad = torch.randn(y.shape, generator=torch.Generator().manual_seed(y.numel())).to(y.dtype)
    return (grad, y, dim, x.dtype), {}


def _linear(s):
    bias = s.args[1] if len(s.args) > 1 else s.kwargs.get("bias")
    return (s.input, s.args[0], bias), {}


def _with_kwargs(s):
    return (s.input, *s.args), dict(s.kwargs)


# aten op -> (OpInfo name, its variant, the aten op's (args, kwargs) from a sample)
CASES = {
    "aten::linear": ("nn.functional.linear", "", _linear),
    "aten::mm": ("mm", "", _positional),
    "aten::addmm": ("addmm", "", lambda s: ((s.input, *s.args), dict(s.kwargs))),
    "aten::_softmax": ("softmax", "", _softmax),
    "aten::_log_softmax": ("log_softmax", "", _softmax),
    "aten::_softmax_backward_data": ("_softmax_backward_data", "", _positional),
    "aten::_log_softmax_backward_data": ("log_softmax", "", _log_softmax_backward),
    "aten::constant_pad_nd": ("constant_pad_nd", "", _positional),
    # The linalg family: each aten op from the OpInfo of the torch.linalg
    # function that reaches it (the function's sample has the op's arguments).
    "aten::linalg_lu_factor_ex": ("linalg.lu_factor_ex", "", _with_kwargs),
    "aten::linalg_lu_factor": ("linalg.lu_factor", "", _with_kwargs),
    "aten::linalg_lu": ("linalg.lu", "", _with_kwargs),
    "aten::lu_unpack": ("lu_unpack", "", _with_kwargs),
    "aten::linalg_solve_triangular": ("linalg.solve_triangular", "", _with_kwargs),
    "aten::triangular_solve": ("triangular_solve", "", _with_kwargs),
    "aten::linalg_inv_ex": ("linalg.inv_ex", "", _with_kwargs),
    "aten::_linalg_solve_ex": ("linalg.solve_ex", "", _with_kwargs),
    "aten::linalg_lu_solve": ("linalg.lu_solve", "", _with_kwargs),
    "aten::_linalg_det": ("linalg.det", "", _positional),
    "aten::_linalg_slogdet": ("linalg.slogdet", "", _positional),
}

# aten op -> why torch's op_db has nothing for it (test_ops_without_opinfo_have_none
# fails once the installed torch gains an entry).
NO_OPINFO: dict[str, str] = {
    "aten::_grouped_mm": "no OpInfo in torch's op_db; tests/ops/test_grouped_mm.py runs the four layouts, both "
                         "weight layouts, strides and torch's errors against aten's CPU kernel, and on meta",
    "aten::_scaled_grouped_mm": "no OpInfo in torch's op_db, and no CPU kernel in torch; "
                                "tests/ops/test_scaled_grouped_mm.py compares with a float64 reference",
}

ALL_OPS = sorted(op for fam in mps_ext.families() for op in mps_ext._C.family_aten_ops(fam))
OPS = [op for op in ALL_OPS if op in CASES]


def test_every_op_mps_ext_implements_has_cases():
    missing = set(ALL_OPS) - set(CASES) - set(NO_OPINFO)
    assert not missing, f"add OpInfo cases (or a reason to NO_OPINFO) for {sorted(missing)}"


@pytest.fixture(scope="module")
def op_db():
    from torch.testing._internal.common_methods_invocations import op_db
    return {(op.name, op.variant_test_name): op for op in op_db}


def test_ops_without_opinfo_have_none(op_db):
    for aten_name in NO_OPINFO:
        short = aten_name.split("::")[1]
        entries = [key for key, info in op_db.items() if short in (info.name, info.aten_name)
                   or info.name.endswith("." + short.lstrip("_"))]
        assert not entries, f"torch's op_db has {entries} for {aten_name}: add it to CASES"


def to_meta(a):
    if isinstance(a, torch.Tensor):
        return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")
    return a


def call(op, args, kwargs):
    try:
        return op(*args, **kwargs), None
    except Exception as e:  # noqa: BLE001 - compared with aten's
        return None, e


def tolerance(dtype):
    # Our kernels accumulate in float32 and round once, like aten's CPU
    # kernels but not in the same order.
    return {torch.float16: dict(rtol=2e-3, atol=1e-3), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}.get(dtype, {})


def outputs(x):
    """An op's outputs as a tuple (one tensor, or several)."""
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def samples(info, dtype):
    # reference_inputs are the sample inputs and more (larger, strided,
    # extremal) where the OpInfo has them.
    return list(info.reference_inputs("cpu", dtype, requires_grad=False))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("aten_name", OPS)
def test_opinfo_samples(op_db, aten_name, dtype):
    name, variant, adapt = CASES[aten_name]
    info = op_db[(name, variant)]
    if dtype not in info.supported_dtypes("cpu"):
        pytest.skip(f"the OpInfo has no {dtype} samples")
    short = aten_name.split("::")[1]
    aten, ours = getattr(torch.ops.aten, short), getattr(torch.ops.mps_ext, short)
    checked = 0
    for sample in samples(info, dtype):
        args, kwargs = adapt(sample)
        want, want_error = call(aten, args, kwargs)
        got, got_error = call(ours, args, kwargs)
        where = f"{aten_name} {dtype} sample {sample.summary() if hasattr(sample, 'summary') else sample}"
        if want_error is not None:
            assert got_error is not None, f"{where}: aten raised {want_error!r}, mps_ext did not"
            assert type(got_error) is type(want_error), where
            assert str(got_error).splitlines()[0] == str(want_error).splitlines()[0], where
            continue
        assert got_error is None, f"{where}: {got_error!r}"
        meta, meta_error = call(ours, [to_meta(a) for a in args], {k: to_meta(v) for k, v in kwargs.items()})
        assert meta_error is None, f"{where} on meta: {meta_error!r}"
        assert len(outputs(got)) == len(outputs(want)) == len(outputs(meta)), where
        for i, (g, w, m) in enumerate(zip(outputs(got), outputs(want), outputs(meta))):
            at = f"{where} output {i}"
            assert (g.shape, g.dtype, g.stride()) == (w.shape, w.dtype, w.stride()), at
            torch.testing.assert_close(g, w, equal_nan=True, **tolerance(g.dtype), msg=lambda m: f"{at}: {m}")
            assert (m.shape, m.dtype, m.stride()) == (w.shape, w.dtype, w.stride()), f"{at} on meta"
        checked += 1
    assert checked > 0, f"{aten_name}: no {dtype} sample ran"
