"""The fp8 family's value ops (csrc/ops/fp8_ops.cpp): .item(), comparisons,
torch.equal, indexing, index_put_, where, masked_fill_, gather, repeat and
flip of float8 tensors, through torch.ops.mps_ext on CPU tensors (the code
the MPS overrides run). The reference is torch's CPU float8 op where torch
has one, and otherwise the same op on the values decoded by torch's CPU
conversion (float32), which holds every float8 value exactly."""

import contextlib
import os
import subprocess
import sys

import pytest
import torch

import mps_ext
from mps_ext import _policy

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
ops = torch.ops.mps_ext


def codes(fmt, shape=(16, 16)):
    """Every float8 code of `fmt` (NaNs, -0, subnormals, the largest values)."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fmt).reshape(shape)


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def same_values(got, want_float):
    """float8 `got` holds `want_float` (float32) exactly: NaN where it has NaN, and the sign of zeros."""
    g = got.float()
    return g.shape == want_float.shape and torch.equal(g.isnan(), want_float.isnan()) and torch.equal(
        torch.nan_to_num(g), torch.nan_to_num(want_float)) and torch.equal(g.signbit(), want_float.signbit())


@contextlib.contextmanager
def runs(n):
    """The block runs mps_ext's fp8 kernels `n` times, with no fallback."""
    mps_ext.reset_stats()
    yield
    stats = mps_ext.stats()["fp8"]
    assert stats["ran"] == n and stats["fallbacks"] == {}, stats


@pytest.mark.parametrize("fmt", FP8)
def test_item_of_every_code(fmt):
    c = codes(fmt).flatten()
    with runs(256):
        got = [ops._local_scalar_dense(c[i]) for i in range(256)]
    want = [c[i].item() for i in range(256)]  # torch's CPU kernel
    assert all(g == w or (g != g and w != w) for g, w in zip(got, want))
    assert type(got[0]) is float


CMP = ["eq", "ne", "lt", "le", "gt", "ge"]


def reference_compare(name, a, b):
    """torch's CPU comparison where it has float8 (eq, ne), else the same
    comparison of the values torch's CPU conversion decodes."""
    if name in ("eq", "ne"):
        return getattr(torch, name)(a, b)
    value = (lambda t: t.float() if isinstance(t, torch.Tensor) and t.dtype in FP8 else t)
    if not isinstance(b, torch.Tensor):  # torch rounds the number to float8 first (as eq shows)
        b = torch.tensor(b, dtype=torch.float64).to(a.dtype)
    return getattr(torch, name)(value(a), value(b))


@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("name", CMP)
def test_comparisons_of_every_pair_of_codes(fmt, name):
    # All 256 x 256 pairs by broadcasting a column against a row: NaN
    # against everything, -0 against +0, subnormals, the largest values.
    c = codes(fmt).flatten()
    a, b = c[:, None], c[None, :]
    with runs(1):
        got = getattr(ops, name).Tensor(a, b)
    assert torch.equal(got, reference_compare(name, a, b))
    nan = c.float().isnan()
    assert not got[nan].any() if name != "ne" else got[nan].all()
    zero, neg_zero = (c.float() == 0).nonzero().flatten().tolist()
    assert bool(got[zero, neg_zero]) == (name in ("eq", "le", "ge"))


@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("name", CMP)
def test_comparisons_with_numbers_and_strided_operands(fmt, name):
    x = (torch.randn(6, 10, generator=torch.Generator().manual_seed(0)) * 4).to(fmt)
    x.view(torch.uint8)[0, :3] = torch.tensor([0x80, 0x00, 0x7F], dtype=torch.uint8)  # -0, +0, NaN
    strided = x.t()[::2]  # non-contiguous
    # numbers torch rounds to float8: 1.1 (not a float8 value), 1e6 and
    # inf (saturated or infinite), NaN, an int, a bool
    for value in [1.1, -0.0, 1e6, float("inf"), float("nan"), 3, True]:
        with runs(1):
            got = getattr(ops, name).Scalar(strided, value)
        assert torch.equal(got, reference_compare(name, strided, value)), value
    with runs(1):
        got = getattr(ops, name).Tensor(strided, x[1:2].t()[::2])
    assert torch.equal(got, reference_compare(name, strided, x[1:2].t()[::2]))
    # a 0-dim float32 tensor is rounded to float8 as a number is
    with runs(1):
        got = getattr(ops, name).Tensor(strided, torch.tensor(1.1))
    assert torch.equal(got, reference_compare(name, strided, 1.1))


def test_comparisons_give_torchs_promotion_errors():
    e4, e5 = torch.zeros(3).to(torch.float8_e4m3fn), torch.zeros(3).to(torch.float8_e5m2)
    with pytest.raises(RuntimeError) as theirs:
        torch.eq(e4, torch.zeros(3))
    for other in [torch.zeros(3), e5]:
        for op in [ops.eq.Tensor, ops.lt.Tensor]:
            with pytest.raises(RuntimeError, match="Promotion for Float8 Types is not supported"):
                op(e4, other)
    assert "Promotion for Float8 Types is not supported" in str(theirs.value)


@pytest.mark.parametrize("fmt", FP8)
def test_equal(fmt):
    x = codes(fmt)
    cases = [
        (x, x.clone()),                                  # every code, NaN included: not equal
        (x[:4], x[:4].clone()),                          # codes 0-63: no NaN, equal
        (x[:4], x[4:8]),
        (torch.tensor([0.0, 1.5]).to(fmt), torch.tensor([-0.0, 1.5]).to(fmt)),  # -0 == +0
        (x.t(), x.t().contiguous()),                     # strided
        (x[:2], x[:3]),                                  # shapes differ
        (x[:0], x[:0].clone()),
    ]
    for a, b in cases:
        want = a.shape == b.shape and torch.equal(a.float(), b.float())  # float32 equal: NaN != NaN
        with runs(1):
            assert ops.equal(a, b) is want, (a, b)
    assert ops.equal(x[:2, :3], x[:2, :3].clone()) is torch.equal(x[:2, :3], x[:2, :3].clone())  # torch's CPU one
    with pytest.raises(RuntimeError, match="Promotion for Float8 Types is not supported"):
        ops.equal(x, x.float())


@pytest.mark.parametrize("fmt", FP8)
def test_indexing(fmt):
    x = codes(fmt)
    mask = x.float() > 1  # NaNs are not selected; -0 and 0 are not
    idx = torch.tensor([15, 0, 3, 3])
    cases = [
        [mask],                                  # x[mask]
        [idx],                                   # x[idx]
        [None, idx],                             # x[:, idx]
        [idx, torch.tensor([[1], [2]])],         # broadcast index tensors
        [mask[:, 0]],                            # a row mask
    ]
    for indices in cases:
        with runs(1):
            got = ops.index.Tensor(x, indices)
        assert same_bits(got, torch.ops.aten.index.Tensor(x, indices))  # torch's CPU float8 index
    with runs(1):
        got = ops.index.Tensor(x.t()[::3], [idx[1:]])  # strided source
    assert same_bits(got, x.t()[::3][idx[1:]])


@pytest.mark.parametrize("fmt", FP8)
def test_index_put(fmt):
    x = codes(fmt)
    v = torch.randn(4).to(fmt)
    neg = x.float() < 0
    for indices, values in [
        ([torch.tensor([1, 5, 0])], v[:3, None].expand(3, 16)),          # rows, broadcast values
        ([torch.tensor([2, 3]), torch.tensor([7, 1])], v[:2]),           # elements
        ([neg], x.t()[neg.t()]),                                          # a mask, a value each
        ([neg], v[:1]),                                                    # a mask, one value
        ([None, torch.tensor([0, 2])], codes(fmt)[:, 3:5]),               # columns, strided values
    ]:
        got, want = x.clone(), x.clone()
        with runs(1):
            ops._index_put_impl_(got, indices, values, False, False)
        if values.numel() == 1 and indices[0].dtype == torch.bool:
            # torch's CPU index_put_ of one value at a mask is its masked_fill, which has no float8
            want = torch.where(indices[0], values, want)
        else:
            torch.ops.aten.index_put_(want, indices, values)  # torch's CPU float8 index_put_
        assert same_bits(got, want)
    with pytest.raises(RuntimeError, match="Index put requires the source and destination dtypes match"):
        ops._index_put_impl_(x.clone(), [torch.tensor([0])], torch.ones(16), False, False)
    with pytest.raises(RuntimeError, match=r"accumulate=True .*cast first, e.g. x.to\(torch.bfloat16\)"):
        ops._index_put_impl_(x.clone(), [torch.tensor([0])], v[:1], True, False)


@pytest.mark.parametrize("fmt", FP8)
def test_where(fmt):
    x = codes(fmt)
    y = codes(fmt).t()  # strided
    cond = torch.randn(16, 16, generator=torch.Generator().manual_seed(1)) > 0
    for c, a, b in [
        (cond, x, y),
        (cond[:1], x, y[:, :1]),                           # broadcasting
        (cond, x, torch.tensor(1.1, dtype=torch.float64)),  # a number (where.ScalarOther wraps it)
        (cond, torch.tensor(-0.0), x),
        (cond, torch.tensor(1e6), x),                      # rounded (saturated) as torch does
    ]:
        with runs(1):
            got = ops.where.self(c, a, b)
        assert same_bits(got, torch.where(c, a, b))  # torch's CPU float8 where
    with pytest.raises(RuntimeError, match="Promotion for Float8 Types is not supported"):
        ops.where.self(cond, x, x.float())


@pytest.mark.parametrize("fmt", FP8)
def test_masked_fill(fmt):
    x = codes(fmt)
    mask = x.float() > 0
    for target, m in [(x.clone(), mask), (x.clone().t(), mask[0]), (x.clone(), torch.tensor(True))]:
        for value in [1.1, -0.0, float("nan"), 2, 2**-12]:
            # reference: torch's CPU where and fill_ (it has no float8 masked_fill)
            want = torch.where(m, torch.full_like(target, value), target)
            got = target.clone()
            with runs(1):
                ops.masked_fill_.Scalar(got, m, value)
            assert same_bits(got, want), value
            got = target.clone()
            with runs(1):
                ops.masked_fill_.Tensor(got, m, torch.tensor(value).to(fmt))
            assert same_bits(got, want), value
    with pytest.raises(RuntimeError, match="without overflow"):  # as fill_ and float16's masked_fill_
        ops.masked_fill_.Scalar(x.clone(), mask, 1e9)
    with pytest.raises(RuntimeError, match="0-dimensional value tensor"):
        ops.masked_fill_.Tensor(x.clone(), mask, torch.ones(2).to(fmt))


@pytest.mark.parametrize("fmt", FP8)
def test_gather_repeat_flip(fmt):
    x = codes(fmt)
    index = torch.randint(0, 16, (16, 5), generator=torch.Generator().manual_seed(2))
    for src, dim, idx in [(x, 1, index), (x.t(), 0, index.t()), (x[::2], 1, index[:8])]:
        with runs(1):
            got = ops.gather(src, dim, idx)
        assert same_values(got, src.float().gather(dim, idx))  # torch has no float8 gather on CPU
    for src, reps in [(x, [2, 1]), (x.t()[:3], [1, 2, 3]), (x[0], [4])]:
        with runs(1):
            got = ops.repeat(src, reps)
        assert same_bits(got, src.repeat(reps))  # torch's CPU float8 repeat
    for src, dims in [(x, [0]), (x.t(), [0, 1]), (x[::3], [1])]:
        with runs(1):
            got = ops.flip(src, dims)
        assert same_values(got, src.float().flip(dims))  # torch has no float8 flip on CPU


def test_other_dtypes_pass_through_uncounted():
    x = torch.randn(4, 5)
    mask, idx = x > 0, torch.tensor([2, 0])
    mps_ext.reset_stats()
    assert ops._local_scalar_dense(x[0, 0]) == x[0, 0].item()
    assert torch.equal(ops.eq.Tensor(x, x.half()), x == x.half())
    assert torch.equal(ops.lt.Scalar(x, 0.5), x < 0.5)
    assert ops.equal(x, x.clone())
    assert torch.equal(ops.index.Tensor(x, [mask]), x[mask])
    assert torch.equal(ops.where.self(mask, x, 0.0 * x), torch.where(mask, x, 0.0 * x))
    assert torch.equal(ops.masked_fill_.Scalar(x.clone(), mask, 1.0), x.masked_fill(mask, 1.0))
    assert torch.equal(ops.gather(x, 1, idx[None].expand(4, 2)), x.gather(1, idx[None].expand(4, 2)))
    assert torch.equal(ops.repeat(x, [2, 1]), x.repeat(2, 1))
    assert torch.equal(ops.flip(x, [1]), x.flip(1))
    assert mps_ext.stats()["fp8"] == {"ran": 0, "fallbacks": {}, "unavailable": {}}


def test_torch_2_15_takes_e4m3fn_item_eq_ne_equal_gather(cpu_policy):
    # The policy of torch 2.15 applied to the CPU key (on a Mac it applies to
    # MPS): its float8_e4m3fn kernels take .item(), eq/ne, equal and gather;
    # mps_ext keeps float8_e5m2 and everything 2.15 lacks for either format.
    mps_ext._leave_to_torch("fp8", _policy.left_to_torch("fp8", "2.15.0"), "CPU")
    e4, e5 = codes(torch.float8_e4m3fn)[:2], codes(torch.float8_e5m2)[:2]
    for x in (e4, e5):
        ops._local_scalar_dense(x[0, 3])
        ops.eq.Tensor(x, x)
        ops.ne.Scalar(x, 1.0)
        ops.equal(x, x.clone())  # no NaN: torch's CPU equal takes it
        ops.lt.Tensor(x, x)
        ops.flip(x, [0])
    assert mps_ext.stats()["fp8"] == {
        "ran": 6 + 2, "fallbacks": {"policy: torch 2.15 has float8_e4m3fn tensors on MPS": 4}, "unavailable": {}}


def test_what_users_write_reaches_the_overrides():
    """.item(), operators, Python indexing and assignment, torch.where with a
    number: the aten ops they reach are the family's (installed here on the
    CPU key, in a process of their own, as on MPS on a Mac)."""
    code = """
import torch, mps_ext
mps_ext._C.install_overrides(["fp8"], "CPU")
import mps_ext_executor
mps_ext_executor.install()  # mps_ext runs kernels on CPU tensors through it
mps_ext_executor._C._set_requested(True)  # on a Mac CPU tensors reach the executor only when asked
for fmt in (torch.float8_e4m3fn, torch.float8_e5m2):
    c = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fmt).reshape(16, 16)
    ref = c.float()  # torch's CPU conversion: the values, exactly
    same = lambda a, b: torch.equal(a.float().nan_to_num(), b.nan_to_num()) and torch.equal(a.float().signbit(), b.signbit())
    mps_ext.reset_stats()
    assert c[3, 4].item() == ref[3, 4].item()
    assert torch.equal(c < c.t(), ref < ref.t()) and torch.equal(c >= 1.5, ref >= 1.5) and torch.equal(c != c, ref != ref)
    mask = ref > 1
    assert same(c[mask], ref[mask]) and same(c[:, torch.tensor([3, 0])], ref[:, torch.tensor([3, 0])])
    got, want = c.clone(), ref.clone()
    got[mask] = 0.5
    want[mask] = 0.5
    assert same(got, want)
    got, want = c.clone(), ref.clone()
    got[torch.tensor([1, 2])] = c[:2]
    want[torch.tensor([1, 2])] = ref[:2]
    assert same(got, want)
    assert same(torch.where(mask, c, 0.0), torch.where(mask, ref, 0.0))
    assert same(c.flip(0), ref.flip(0)) and same(c.masked_fill(mask, 2.0), ref.masked_fill(mask, 2.0))
    assert torch.equal(c[:4], c[:4].clone()) and not torch.equal(c, c.clone())
    print(mps_ext.stats()["fp8"]["ran"], mps_ext.stats()["fp8"]["fallbacks"])
x = torch.randn(3)
assert (x == x).all() and isinstance(x[0].item(), float)  # other dtypes: torch's
"""  # noqa: E501
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root)
    assert r.returncode == 0, r.stderr
    for line in r.stdout.splitlines():
        ran, fallbacks = line.split(" ", 1)
        assert int(ran) >= 16 and fallbacks == "{}", r.stdout


@pytest.mark.mac
@pytest.mark.parametrize("fmt", FP8)
def test_mps_value_ops(fmt):
    if not mps_ext.is_available():
        pytest.skip("needs an Apple GPU")
    c = codes(fmt)
    m = c.to("mps")
    assert m[3, 4].item() == c[3, 4].item()
    assert torch.equal((m == m.t()).cpu(), c == c.t())
    assert torch.equal((m != 1.5).cpu(), c != 1.5)
    assert torch.equal((m < m.t()).cpu(), c.float() < c.t().float())
    assert torch.equal(m[:4], m[:4].clone()) is torch.equal(c[:4], c[:4].clone())
    mask = c.float() > 1
    assert same_bits(m[mask.to("mps")].cpu(), c[mask])
    idx = torch.tensor([3, 0, 3])
    assert same_bits(m[idx.to("mps")].cpu(), c[idx])
    got, want = m.clone(), c.clone()
    got[idx.to("mps")] = m[:3]
    want[idx] = c[:3]
    assert same_bits(got.cpu(), want)
    got, want = m.clone(), c.clone()
    got[mask.to("mps")] = 0.5
    want[mask] = torch.tensor(0.5).to(fmt)
    assert same_bits(got.cpu(), want)
    assert same_bits(torch.where(mask.to("mps"), m, 0.0).cpu(), torch.where(mask, c, 0.0))
    assert same_bits(m.masked_fill(mask.to("mps"), 2.0).cpu(), torch.where(mask, torch.full_like(c, 2.0), c))
    assert same_bits(m.repeat(2, 1).cpu(), c.repeat(2, 1))
    assert same_bits(m.flip(0).cpu(), c.view(torch.uint8).flip(0).view(fmt))
    assert same_bits(m.gather(1, idx[None].expand(16, 3).to("mps")).cpu(),
                     c.view(torch.uint8).gather(1, idx[None].expand(16, 3)).view(fmt))
