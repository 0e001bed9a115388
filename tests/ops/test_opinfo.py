"""PyTorch's own test inputs (the OpInfo database of
torch.testing._internal.common_methods_invocations: sample and reference
inputs) for every aten op mps_ext implements, run through torch.ops.mps_ext
on CPU tensors (the CPU Metal executor) and compared with the aten op on the
CPU (the scaled matrix products: with a float64 reference of torch's
contract, REFERENCES): same values, same dtype, shape and strides, and the
same error when aten raises one. Each sample also runs on meta tensors (torch.compile's tracing),
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
from fp8_oracle import scaled_mm_reference

# The oracles are aten's CPU kernels; scripts/test.sh runs this file again
# with torch's CPU kernels capped.
pytestmark = pytest.mark.torch_cpu_oracle

# OpInfo's module imports `expecttest` (PyTorch's test-only dependency) for a
# TestCase base class it never uses here; a stand-in keeps that dependency
# out of mps_ext's.
try:
    import expecttest  # noqa: F401
except ImportError:
    sys.modules["expecttest"] = types.SimpleNamespace(TestCase=unittest.TestCase)

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.uint8, torch.bool,
          torch.complex64] + FP8


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


def _product_out(mat1, mat2):
    return torch.empty(mat1.shape[0], mat2.shape[-1], dtype=mat1.dtype)


def _scaled_mm_v2(s):
    # The OpInfo passes torch's ScalingType / SwizzleType enums; the aten op takes ints.
    def ints(a):
        return [int(v) for v in a] if isinstance(a, list) and a and not isinstance(a[0], torch.Tensor) else a
    return (s.input, *(ints(a) for a in s.args)), dict(s.kwargs)


def _tensor(v):
    return v if isinstance(v, torch.Tensor) else torch.tensor(v)


def _number(v):
    if not isinstance(v, torch.Tensor):
        return v
    return v.flatten()[0].item() if v.numel() else 0


def _other_tensor(s):
    return (s.input, _tensor(s.args[0])), {}


def _other_number(s):
    return (s.input, _number(s.args[0])), {}


def _where(s):  # the OpInfo's op is where(condition, self, other) as self.where(condition, other)
    return (s.args[0], _tensor(s.input), _tensor(s.args[1])), {}


# aten op -> (OpInfo name, its variant, the aten op's (args, kwargs) from a
# sample). In-place ops get a copy of the sample's tensor (the adapter runs
# once for aten and once for mps_ext).
CASES = {
    "aten::linear": ("nn.functional.linear", "", _linear),
    "aten::mm": ("mm", "", _positional),
    "aten::addmm": ("addmm", "", _with_kwargs),
    # The out= forms, with an out tensor of the product's shape (what inductor passes).
    "aten::mm.out": ("mm", "", lambda s: ((s.input, s.args[0]), {"out": _product_out(s.input, s.args[0])})),
    "aten::addmm.out": ("addmm", "", lambda s: ((s.input, *s.args), {**s.kwargs, "out": _product_out(*s.args)})),
    "aten::_softmax": ("softmax", "", _softmax),
    "aten::_log_softmax": ("log_softmax", "", _softmax),
    "aten::_softmax_backward_data": ("_softmax_backward_data", "", _positional),
    "aten::_log_softmax_backward_data": ("log_softmax", "", _log_softmax_backward),
    "aten::constant_pad_nd": ("constant_pad_nd", "", _positional),
    "aten::fill_.Scalar": ("fill", "", lambda s: ((s.input.clone(), s.kwargs["value"]), {})),
    "aten::fill_.Tensor": ("fill", "", lambda s: ((s.input.clone(), torch.tensor(s.kwargs["value"])), {})),
    "aten::zero_": ("zero_", "", lambda s: ((s.input.clone(),), {})),
    "aten::cat": ("cat", "", lambda s: ((list(s.input), *s.args), dict(s.kwargs))),
    "aten::index_select": ("index_select", "", _positional),
    "aten::_local_scalar_dense": ("item", "", lambda s: ((s.input,), {})),
    "aten::equal": ("equal", "", _positional),
    **{f"aten::{cmp}.Tensor": (cmp, "", _other_tensor) for cmp in ("eq", "ne", "lt", "le", "gt", "ge")},
    **{f"aten::{cmp}.Scalar": (cmp, "", _other_number) for cmp in ("eq", "ne", "lt", "le", "gt", "ge")},
    "aten::where.self": ("where", "", _where),
    "aten::masked_fill_.Scalar": ("masked_fill", "", lambda s: ((s.input.clone(), s.args[0], _number(s.args[1])), {})),
    "aten::masked_fill_.Tensor": ("masked_fill", "", lambda s: ((s.input.clone(), s.args[0], _tensor(s.args[1])), {})),
    "aten::gather": ("gather", "", _with_kwargs),
    "aten::repeat": ("repeat", "", _positional),
    "aten::flip": ("flip", "", _with_kwargs),
    "aten::_scaled_mm": ("torch._scaled_mm", "", _with_kwargs),
    "aten::_scaled_mm_v2": ("torch._scaled_mm_v2", "", _scaled_mm_v2),
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

def _scaled_mm_v2_reference(a, b, scale_a, recipe_a, swizzle_a, scale_b, recipe_b, swizzle_b, bias=None,
                            out_dtype=None, contraction_dim=(), use_fast_accum=False):
    (sa,), (ra,), (sb,), (rb,) = scale_a, recipe_a, scale_b, recipe_b
    return scaled_mm_reference(a, b, sa, sb, bias, out_dtype=out_dtype, recipe_a=ra, recipe_b=rb)


# Ops compared with a float64 reference of torch's contract instead of the
# installed torch's CPU kernel: torch's CPU _scaled_mm is oneDNN's matmul on a
# CPU with AMX, where an overflowing fp8 output becomes NaN (the contract,
# like CUDA, saturates), and cannot run at all with oneDNN capped at AVX2
# there (shared/reference/semantics.md).
REFERENCES = {
    "aten::_scaled_mm": scaled_mm_reference,
    "aten::_scaled_mm_v2": _scaled_mm_v2_reference,
}

# aten op -> why torch's op_db has nothing for it (test_ops_without_opinfo_have_none
# fails once the installed torch gains an entry).
NO_OPINFO: dict[str, str] = {
    "aten::copy_": "torch's op_db has no copy_ entry; tests/ops/test_fp8_convert.py compares every float8 "
                   "conversion with torch's CPU copy_ bit for bit (all fp16/bf16 inputs, all fp8 codes, 10^6 "
                   "float32 samples, strided, broadcast and overlapping layouts)",
    "aten::_grouped_mm": "no OpInfo in torch's op_db; tests/ops/test_grouped_mm.py runs the four layouts, both "
                         "weight layouts, strides and torch's errors against aten's CPU kernel, and on meta",
    "aten::_scaled_grouped_mm": "no OpInfo in torch's op_db, and no CPU kernel in torch; "
                                "tests/ops/test_scaled_grouped_mm.py compares with a float64 reference",
    "aten::_scaled_grouped_mm_v2": "no OpInfo in torch's op_db, and no CPU kernel in torch; "
                                   "tests/ops/test_scaled_grouped_mm.py compares with a float64 reference",
    "aten::index.Tensor": "op_db's __getitem__ samples are Python index expressions, not index.Tensor's arguments; "
                          "tests/ops/test_fp8_ops.py compares float8 masks, index tensors, broadcast and strided "
                          "indexing with torch's CPU index bit for bit",
    "aten::_index_put_impl_": "op_db's index_put samples reach it through index_put_; tests/ops/test_fp8_ops.py "
                              "compares float8 index_put_ with torch's CPU one bit for bit, and its errors",
}

# Ops mps_ext runs for float8 where torch's CPU kernel raises for float8
# ("lt_cpu" not implemented for 'Float8_e4m3fn'; equal only takes
# byte-identical distinct tensors): nothing to compare with here;
# tests/ops/test_fp8_ops.py compares them with the same op on the values
# torch's CPU conversion decodes.
FP8_BEYOND_TORCH_CPU = {f"aten::{cmp}.{overload}" for cmp in ("lt", "le", "gt", "ge")
                        for overload in ("Tensor", "Scalar")} | {
    "aten::masked_fill_.Scalar", "aten::masked_fill_.Tensor", "aten::gather", "aten::flip", "aten::equal"}

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


def assert_same_values(got, want, where):
    if got.dtype in FP8:
        # One rounding to float8 of a float32 sum taken in another order: at
        # most one step of the grid apart (exact for the ops that move bytes).
        step = want.double().abs().clamp(min=2**-6) * (2**-3 if got.dtype == torch.float8_e4m3fn else 2**-2)
        assert ((got.double() - want.double()).abs() <= step).all() or torch.equal(
            got.view(torch.uint8), want.view(torch.uint8)), where
        return
    torch.testing.assert_close(got, want, equal_nan=True, **tolerance(got.dtype), msg=lambda m: f"{where}: {m}")


def _to(a, dtype):
    if isinstance(a, torch.Tensor) and a.dtype == torch.float32:
        return a.to(dtype)
    if isinstance(a, (list, tuple)):
        return type(a)(_to(t, dtype) for t in a)
    return a


# Ops whose OpInfo has no float8 samples, though torch's CPU kernels take
# float8 and mps_ext overrides them for it: their float32 samples are
# converted.
FP8_FROM_FLOAT32 = set(mps_ext._C.family_aten_ops("fp8"))


def outputs(x):
    """An op's outputs as a tuple (one tensor, or several)."""
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def samples(info, dtype):
    # reference_inputs are the sample inputs and more (larger, strided,
    # extremal) where the OpInfo has them.
    if dtype in FP8 and dtype not in info.supported_dtypes("cpu"):
        out = []
        for s in info.reference_inputs("cpu", torch.float32, requires_grad=False):
            s.input, s.args = _to(s.input, dtype), _to(s.args, dtype)
            out.append(s)
        return out
    return list(info.reference_inputs("cpu", dtype, requires_grad=False))


def aten_op(namespace, aten_name):
    name, _, overload = aten_name.split("::")[1].partition(".")
    return getattr(getattr(namespace, name), overload or "default")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("aten_name", OPS)
def test_opinfo_samples(op_db, aten_name, dtype):
    name, variant, adapt = CASES[aten_name]
    info = op_db[(name, variant)]
    if dtype not in info.supported_dtypes("cpu") and not (dtype in FP8 and aten_name in FP8_FROM_FLOAT32):
        pytest.skip(f"the OpInfo has no {dtype} samples")
    if dtype in FP8 and aten_name in FP8_BEYOND_TORCH_CPU:
        pytest.skip(f"torch's CPU {aten_name} has no {dtype} to compare with (tests/ops/test_fp8_ops.py)")
    if aten_name not in REFERENCES and not torch._C._dispatch_has_computed_kernel_for_dispatch_key(aten_name, "CPU"):
        pytest.skip(f"torch {torch.__version__} has no CPU kernel for {aten_name} to compare with")
    aten, ours = REFERENCES.get(aten_name, aten_op(torch.ops.aten, aten_name)), aten_op(torch.ops.mps_ext, aten_name)
    checked = 0
    for sample in samples(info, dtype):
        args, kwargs = adapt(sample)
        want, want_error = call(aten, args, kwargs)
        args, kwargs = adapt(sample)
        got, got_error = call(ours, args, kwargs)
        where = f"{aten_name} {dtype} sample {sample.summary() if hasattr(sample, 'summary') else sample}"
        if want_error is not None:
            assert got_error is not None, f"{where}: aten raised {want_error!r}, mps_ext did not"
            assert type(got_error) is type(want_error), where
            assert str(got_error).splitlines()[0] == str(want_error).splitlines()[0], where
            continue
        assert got_error is None, f"{where}: {got_error!r}"
        if not isinstance(want, (torch.Tensor, tuple, list)):  # .item()'s number, equal's bool: no meta value
            assert type(got) is type(want) and (got == want or (got != got and want != want)), where
            checked += 1
            continue
        meta, meta_error = call(ours, [to_meta(a) for a in args], {k: to_meta(v) for k, v in kwargs.items()})
        assert meta_error is None, f"{where} on meta: {meta_error!r}"
        assert len(outputs(got)) == len(outputs(want)) == len(outputs(meta)), where
        for i, (g, w, m) in enumerate(zip(outputs(got), outputs(want), outputs(meta))):
            at = f"{where} output {i}"
            assert (g.shape, g.dtype, g.stride()) == (w.shape, w.dtype, w.stride()), at
            assert_same_values(g, w, at)
            # (aten's own Meta and CPU kernels give an empty output different
            # strides: they address nothing)
            assert (m.shape, m.dtype, m.stride() if w.numel() else 0) == (
                w.shape, w.dtype, w.stride() if w.numel() else 0), f"{at} on meta"
        checked += 1
    assert checked > 0, f"{aten_name}: no {dtype} sample ran"
