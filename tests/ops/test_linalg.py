"""The linalg family against torch's CPU kernels in float64 / complex128 and
an independent LU written here (LAPACK's getrf rules: partial pivoting on
|x| or |re| + |im|, first row on ties, a zero pivot leaves its column
unscaled and sets info).

Each op runs on 'executor' (torch.ops.mps_ext.*, the CPU Metal executor) and,
on a Mac, on 'mps' (torch's own aten ops, overridden)."""

import functools
import itertools
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import mps_ext
from mps_ext import _policy
import mps_ext_executor as cpu_metal

# Oracles include LAPACK's factors and errors (MKL's code paths);
# scripts/test.sh runs this file again with torch's CPU kernels capped.
pytestmark = pytest.mark.torch_cpu_oracle

ROOT = Path(__file__).resolve().parents[2]
DTYPES = [torch.float32, torch.complex64]
WIDE = {torch.float32: torch.float64, torch.complex64: torch.complex128}
EPS = {torch.float32: 1.2e-7, torch.complex64: 1.2e-7}

gen = torch.Generator().manual_seed(0)


def rand(*shape, dtype=torch.float32):
    x = torch.randn(*shape, generator=gen, dtype=WIDE[dtype])
    if dtype.is_complex:
        x = x + 1j * torch.randn(*shape, generator=gen, dtype=torch.float64)
    return x.to(dtype)


def well_conditioned(*shape, dtype=torch.float32):
    n = shape[-1]
    return (rand(*shape, dtype=dtype) + 2 * n**0.5 * torch.eye(n, dtype=dtype)).to(dtype)


@pytest.fixture
def call(run):
    """Runs an op of the family so that mps_ext's kernels do it, and checks
    that they did (tests/ops/conftest.py), on 'executor' and, on a Mac,
    'mps'."""
    return functools.partial(run, family="linalg")


def aten(name, *args, **kwargs):
    out = getattr(torch.ops.aten, name)(*args, **kwargs)
    return tuple(out) if isinstance(out, tuple) else out


def ours(name, *args, **kwargs):
    """torch.ops.mps_ext.<name> on CPU tensors (bad inputs: torch's MPS
    kernel reports them on a Mac, in its own words)."""
    return getattr(torch.ops.mps_ext, name)(*args, **kwargs)


def raises_as_torch(run, name, *args, **kwargs):
    """run(name, ...) raises what aten raises on the CPU: the same type and
    message (its first line)."""
    with pytest.raises(Exception) as want:
        aten(name, *args, **kwargs)
    with pytest.raises(type(want.value)) as got:
        run(name, *args, **kwargs)
    assert str(got.value).split("\n")[0] == str(want.value).split("\n")[0]


def wide(t):
    return t.to(WIDE.get(t.dtype, t.dtype))


def assert_close(got, want, rtol, what=""):
    """|got - want| <= rtol * max|want| (and the same shape, dtype, strides)."""
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape, got.dtype, want.dtype)
    if got.numel() == 0:
        return
    scale = max(want.abs().max().item(), 1.0)
    err = (wide(got) - wide(want)).abs().max().item()
    assert err <= rtol * scale, f"{what}: max error {err:.3g} > {rtol * scale:.3g}"


def same_layout(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype
    if got.numel() > 1:
        assert got.stride() == want.stride(), (got.stride(), want.stride())


# -------------------------------------------------- an independent getrf --
def reference_getrf(a, pivot=True, dtype=None, by_reciprocal=True):
    """LAPACK's getf2 in numpy: (LU, 1-based pivots, info, gaps), in float64
    (complex128) or `dtype`, one rounding per operation in the order getf2
    specifies: the column below a pivot d times 1 / d (rounded once) when
    |d| >= the smallest normal number, else divided by d (always divided
    without by_reciprocal, getf2's rule before LAPACK 3.1), then the rank-one
    update, a product and a difference. gaps[j]: how much larger the chosen
    pivot's magnitude is than the next candidate's (relative), to tell ties
    from clear choices."""
    dtype = dtype or (np.complex128 if np.iscomplexobj(a) else np.float64)
    a = np.array(a, dtype=dtype)
    sfmin = np.finfo(dtype).tiny
    m, n = a.shape
    k = min(m, n)
    piv, gaps, info = [], [], 0
    mag = (lambda x: np.abs(x.real) + np.abs(x.imag)) if np.iscomplexobj(a) else np.abs
    for j in range(k):
        r = j
        if pivot:
            col = mag(a[j:, j])
            r = j + int(np.argmax(col))  # the first maximum, as isamax / icamax
            rest = np.delete(col, r - j)
            gaps.append(1.0 if rest.size == 0 or col[r - j] == 0 else (col[r - j] - rest.max()) / col[r - j])
        piv.append(r + 1)
        a[[j, r]] = a[[r, j]]
        d = a[j, j]
        if d == 0:
            info = info or j + 1
        elif by_reciprocal and np.abs(d) >= sfmin:
            a[j + 1:, j] *= a.dtype.type(1) / d
        else:
            a[j + 1:, j] /= d
        a[j + 1:, j + 1:] -= np.outer(a[j + 1:, j], a[j, j + 1:])
    return a, np.array(piv, dtype=np.int32), info, np.array(gaps)


def reconstruct(lu, piv):
    """P L U of one LU (float64 / complex128)."""
    m, n = lu.shape
    k = min(m, n)
    lu = wide(lu)
    L = torch.tril(lu, -1)[:, :k] + torch.eye(m, k, dtype=lu.dtype)
    U = torch.triu(lu)[:k, :]
    perm = list(range(m))
    for j, p in enumerate(piv.tolist()):
        perm[j], perm[p - 1] = perm[p - 1], perm[j]
    P = torch.zeros(m, m, dtype=lu.dtype)
    P[perm, list(range(m))] = 1
    return P @ L @ U


def check_lu(A, LU, piv, info, pivot=True):
    """Our factors against the reference getrf of the same matrices, matrix
    by matrix: identical pivots where the choice is clear, P L U = A."""
    n = A.shape[-1]
    flat = A.reshape(-1, *A.shape[-2:])
    for b in range(flat.shape[0]):
        a = flat[b]
        lu, p, i = LU.reshape(-1, *LU.shape[-2:])[b], piv.reshape(-1, piv.shape[-1])[b], info.reshape(-1)[b]
        ref_lu, ref_piv, ref_info, gaps = reference_getrf(wide(a).numpy(), pivot)
        # Pivots agree up to the first step whose choice is not clear in
        # float32 (there a rounding difference may pick another row).
        unclear = np.nonzero(gaps < 1e-3)[0]
        upto = int(unclear[0]) if unclear.size else len(ref_piv)
        assert p[:upto].tolist() == ref_piv[:upto].tolist(), (b, p.tolist(), ref_piv.tolist())
        if upto == len(ref_piv):
            assert int(i) == ref_info
            assert_close(lu, torch.from_numpy(ref_lu).to(lu.dtype), 1e3 * n * EPS[A.dtype], "LU")
        assert_close(reconstruct(lu, p), wide(a), 50 * n * EPS[A.dtype], "P L U")


# ------------------------------------------------------------------- LU --
def test_the_reference_getrf_is_lapacks():
    # Our oracle agrees with LAPACK (torch's CPU kernel) on pivots and info,
    # including complex matrices, where LAPACK compares |re| + |im|.
    for dtype in (torch.float64, torch.complex128):
        for shape in [(6, 6), (9, 4), (4, 9)]:
            a = torch.randn(*shape, dtype=dtype, generator=gen)
            lu, piv, info = torch.linalg.lu_factor_ex(a)
            ref_lu, ref_piv, ref_info, _ = reference_getrf(a.numpy())
            assert piv.tolist() == ref_piv.tolist() and info.item() == ref_info
            assert torch.allclose(lu, torch.from_numpy(ref_lu))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1), (2, 2), (3, 3), (4, 4), (2, 3, 4, 4), (5, 5), (7, 3), (3, 7), (2, 33, 33),
                                   (70, 70), (40, 75), (75, 40)],
                         ids=lambda s: "x".join(map(str, s)))
def test_lu_factor_is_lapacks(call, dtype, shape):
    # 1-4: one thread per matrix; larger: the panel kernel (70 and 75: three
    # panels of 32 columns).
    A = rand(*shape, dtype=dtype)
    LU, piv, info = call("linalg_lu_factor_ex", A)
    want = aten("linalg_lu_factor_ex", A)
    for g, w in zip((LU, piv, info), want):
        same_layout(g, w)
    check_lu(A, LU, piv, info)


def test_lu_factor_of_512_rows(call):
    # The largest matrices the kernels take: 512 x 512 (16 panels of 15
    # columns in float32), and 512 x 40 complex64 (panels of 6 columns).
    A = rand(512, 512)
    LU, piv, info = call("linalg_lu_factor_ex", A)
    check_lu(A, LU, piv, info)
    A = rand(512, 40, dtype=torch.complex64)
    LU, piv, info = call("linalg_lu_factor_ex", A)
    check_lu(A, LU, piv, info)


@pytest.mark.parametrize("n", [2, 3, 5, 9])
def test_complex_pivots_compare_re_plus_im_not_the_modulus(call, n):
    # Column 0 holds 5 (|re|+|im| 5, modulus 5) and 3+3j (6 and 4.24):
    # LAPACK's icamax takes 3+3j; a modulus argmax would take 5.
    A = rand(n, n, dtype=torch.complex64) * 0.1
    A[0, 0], A[n - 1, 0] = 5, 3 + 3j
    LU, piv, info = call("linalg_lu_factor_ex", A)
    assert piv[0].item() == n
    assert torch.equal(piv, torch.linalg.lu_factor_ex(A).pivots)
    check_lu(A, LU, piv, info)


@pytest.mark.parametrize("n", [3, 6])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_ties_take_the_first_row(call, dtype, n):
    # Equal magnitudes (1, -1, and for complex 1j, -1j: |re| + |im| = 1):
    # isamax / icamax return the first.
    col = torch.tensor([1, -1, 1j, -1j, 1, -1][:n] if dtype.is_complex else [1, -1, -1, 1, 1, -1][:n], dtype=dtype)
    A = torch.eye(n, dtype=dtype) * 0.5
    A[:, 0] = col
    LU, piv, info = call("linalg_lu_factor_ex", A)
    assert piv[0].item() == 1
    want = aten("linalg_lu_factor_ex", A)
    assert torch.equal(piv, want[1]) and torch.equal(info, want[2])
    assert_close(LU, want[0], 1e-6, "LU")
    ones = torch.ones(2, n, n, dtype=dtype)  # every candidate ties, and U is singular
    got = call("linalg_lu_factor_ex", ones)
    want = aten("linalg_lu_factor_ex", ones)
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2]) and torch.equal(got[0], want[0])


def singular_matrices(n, dtype):
    """Matrices whose elimination is exact in floating point, so that which
    pivot is exactly zero does not depend on rounding; the last is regular."""
    zero = torch.zeros(n, n, dtype=dtype)
    # Rank one of powers of two: multipliers and updates are exact, of A and A^T.
    rank_one = torch.outer(2.0 ** -(torch.arange(n) % 7), 2.0 ** (torch.arange(n) % 5)).to(dtype)
    zero_column = well_conditioned(n, n, dtype=dtype)  # a zero column stays zero
    zero_column[:, n // 2] = 0
    zero_last = torch.eye(n, dtype=dtype) * 3  # only the last pivot is zero
    zero_last[-1, -1] = 0
    return torch.stack([zero, rank_one, zero_column, zero_last, well_conditioned(n, n, dtype=dtype)])


@pytest.mark.parametrize("n", [3, 4, 8, 40])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_singular_matrices_set_info_as_lapack(call, dtype, n):
    A = singular_matrices(n, dtype)
    LU, piv, info = call("linalg_lu_factor_ex", A)
    want = aten("linalg_lu_factor_ex", A)
    assert info.tolist() == want[2].tolist()
    assert info.tolist()[0] == 1 and info.tolist()[-1] == 0
    check_lu(A, LU, piv, info)


@pytest.mark.parametrize("n", [3, 8])
def test_denormal_pivots_are_zero_as_on_an_apple_gpu(call, n):
    # Apple GPUs flush fp32 denormals (inputs and results), and so does the
    # executor: a pivot of 1e-39 is an exact zero there (info, det 0), where
    # LAPACK on the CPU divides by it. The smallest normal numbers are not.
    A = torch.eye(n).expand(2, n, n).clone()
    A[0, 1, 1], A[1, 1, 1] = 1e-39, 1e-37
    LU, piv, info = call("linalg_lu_factor_ex", A)
    assert info.tolist() == [2, 0]
    assert torch.linalg.lu_factor_ex(A).info.tolist() == [0, 0]
    inv, info = call("linalg_inv_ex", A)
    assert info.tolist() == [2, 0] and inv[1, 1, 1].item() == pytest.approx(1e37, rel=1e-6)
    det = call("_linalg_det", A)[0]
    assert det[0].item() == 0 and det[1].item() == pytest.approx(1e-37, rel=1e-6)


def test_nearly_singular_matrices_factor_with_small_residuals(call):
    u, _ = torch.linalg.qr(torch.randn(2, 24, 24, generator=gen, dtype=torch.float64))
    s = torch.logspace(0, -6, 24, dtype=torch.float64)
    A = (u * s) @ u.mT  # condition number 1e6
    for dtype in DTYPES:
        a = A.to(dtype)
        LU, piv, info = call("linalg_lu_factor_ex", a)
        assert info.tolist() == [0, 0]
        for b in range(2):
            assert_close(reconstruct(LU[b], piv[b]), wide(a[b]), 1e-5, "P L U")


# Integer matrices of rank n - 1 on which dividing by the pivot (x / d) and
# multiplying by its reciprocal (x * (1 / d), as LAPACK's getf2 / getrf2 do
# when |d| >= sfmin) round differently, and so leave the last pivot exactly
# zero or not. Found by searching random rank-deficient integer matrices.
ROUNDING_SINGULAR = [
    [[-27, -3, -33], [-135, -96, -3], [90, 53, 24]],
    [[3, 24, 51], [7, -72, -73], [-5, -8, -37]],
    [[58, -14, -58, -16], [-120, 76, -14, -44], [-43, 52, 7, -24], [-30, -32, 28, 28]],
    [[54, 18, -60, -32], [-29, 27, -15, -48], [82, 34, -130, -116], [12, -20, -16, -26]],
    [[33, -15, -109, 8, 68, -3], [-91, 130, 16, 53, 12, -31], [-40, 109, 19, 56, -30, 122],
     [-61, -105, 9, 24, 52, 13], [-73, 20, 88, 27, -56, 156], [43, -116, -22, -50, 10, 14]],
    [[-22, -66, 17, -73, -7, -15], [-73, -37, -64, -49, 165, 15], [-34, -163, -138, -57, 103, 82],
     [0, 20, 7, 66, -24, -45], [-15, -179, -12, -82, -22, -35], [-43, -89, 20, 24, -54, -113]],
    [[-99, 2, -126, -152, 158, -15, 43, 56], [-20, 43, -85, -31, 54, 16, 5, 55],
     [12, 138, -24, -30, 83, -18, -8, 57], [56, -134, -140, 38, -36, -29, 41, 61],
     [-154, 120, -138, -40, 193, 88, 21, 3], [136, 28, 175, 4, -149, -27, -68, 7],
     [89, -52, 21, 142, -121, -19, 3, -4], [-12, -50, 20, -149, 10, -25, 35, 79]],
]


@pytest.mark.parametrize("a", ROUNDING_SINGULAR, ids=lambda a: f"{len(a)}x{len(a)}")
def test_singular_in_rounding_info_is_getf2s(call, a):
    # The oracle is getf2's float32 arithmetic computed here, not the
    # installed LAPACK: MKL's code paths (AVX2, AVX-512), OpenBLAS and
    # Accelerate round these updates differently (an fma, another order), and
    # so disagree on which of these matrices is singular.
    A = torch.tensor(a, dtype=torch.float32)
    want_lu, want_piv, want_info, _ = reference_getrf(A.numpy(), dtype=np.float32)
    # The matrix tells the reciprocal from the division: dividing gives another info.
    assert reference_getrf(A.numpy(), dtype=np.float32, by_reciprocal=False)[2] != want_info
    for batch in (A, A.expand(2, *A.shape)):  # one matrix, and a batch (the small kernel stages blocks)
        LU, piv, info = call("linalg_lu_factor_ex", batch)
        assert (info == want_info).all() and (piv == torch.from_numpy(want_piv)).all()
        # The same roundings: the same factors, bit for bit.
        assert torch.equal(LU.reshape(-1, *A.shape)[0], torch.from_numpy(want_lu))
    if want_info == 0:  # torch raises nothing, and neither does mps_ext
        call("linalg_lu_factor_ex", A, check_errors=True)
    else:
        with pytest.raises(RuntimeError, match=re.escape(f"torch.linalg.lu_factor_ex: U[{want_info},{want_info}] is "
                                                         "zero and using it on lu_solve would result in a division")):
            call("linalg_lu_factor_ex", A, check_errors=True)


def nan_matrices(n, dtype):
    """Matrices with NaNs where a pivot search meets them: on the diagonal,
    below it (before and after the largest element), a whole column, and in
    a later column (row r is small until column n - 1, so its NaN reaches
    that column's search and no other)."""
    nan = float("nan")
    base = well_conditioned(n, n, dtype=dtype) * 0.1
    base[n - 1, 0] = 5  # the largest of column 0
    cases = []
    for rows in ([0], [1], [n - 1], [1, n - 1], list(range(n))):
        a = base.clone()
        a[rows, 0] = nan
        cases.append(a)
    a = base.clone()
    a[n - 2, : n - 1] = 1e-6
    a[n - 2, n - 1] = nan
    cases.append(a)
    return torch.stack(cases)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8, 16, 17, 40])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nan_pivots_are_torchs(call, dtype, n):
    # torch's CPU LU (MKL) searches as reference isamax for matrices up to
    # 16 x 16 (a NaN is taken only when it is the diagonal element, where the
    # search starts) and takes the first NaN of the column for larger ones.
    # 2-4: the one-thread kernel; 5 and up: the panel kernel.
    A = nan_matrices(n, dtype)
    LU, piv, info = call("linalg_lu_factor_ex", A)
    want = aten("linalg_lu_factor_ex", A)
    assert piv.tolist() == want[1].tolist()
    assert info.tolist() == want[2].tolist()
    assert torch.equal(LU.isnan(), want[0].isnan())
    torch.testing.assert_close(LU, want[0], equal_nan=True, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("op", ["linalg_lu_factor_ex", "linalg_lu_factor"])
def test_check_errors_raise_torchs_message(call, op):
    A = singular_matrices(4, torch.float32)
    kwargs = {"check_errors": True} if op == "linalg_lu_factor_ex" else {}
    for a in (A, A[1]):
        raises_as_torch(call, op, a, **kwargs)
    LU, piv = call("linalg_lu_factor", A[-1:])
    assert_close(LU, aten("linalg_lu_factor", A[-1:])[0], 1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [2, 4, 6, 40])
def test_lu_without_pivoting(call, dtype, n):
    # torch's CPU has no LU without pivoting, and MPS refuses it: the oracle
    # is the reference getrf without row exchanges; pivots are 1..k.
    A = well_conditioned(3, n, n, dtype=dtype)
    LU, piv, info = call("linalg_lu_factor_ex", A, pivot=False)
    assert torch.equal(piv, torch.arange(1, n + 1, dtype=torch.int32).expand(3, n))
    check_lu(A, LU, piv, info, pivot=False)
    # A zero leading pivot: info 1; the column stays unscaled, as getf2 leaves it.
    Z = well_conditioned(n, n, dtype=dtype)
    Z[0, 0] = 0
    LU, piv, info = call("linalg_lu_factor_ex", Z, pivot=False)
    ref_lu, _, ref_info, _ = reference_getrf(wide(Z).numpy(), pivot=False)
    assert info.item() == ref_info == 1
    assert torch.equal(LU[1:, 0], Z[1:, 0])
    assert_close(LU, torch.from_numpy(ref_lu).to(dtype), 1e-4, "LU")


@pytest.mark.parametrize("shape", [(0, 3, 3), (2, 0, 0), (3, 0, 4), (2, 4, 0), (0, 0), (1, 0, 2, 2), (0, 6, 6)],
                         ids=lambda s: "x".join(map(str, s)))
def test_empty_batches_and_empty_matrices(call, shape):
    for dtype in DTYPES:
        A = rand(*shape, dtype=dtype)
        calls = [("linalg_lu_factor_ex", (A,)), ("linalg_lu", (A,))]
        calls.append(("lu_unpack", aten("linalg_lu_factor_ex", A)[:2]))
        if shape[-1] == shape[-2]:
            B = rand(*shape[:-1], 2, dtype=dtype)
            LU, piv = aten("linalg_lu_factor_ex", A)[:2]
            calls += [("linalg_inv_ex", (A,)), ("_linalg_det", (A,)), ("_linalg_slogdet", (A,)),
                      ("_linalg_solve_ex", (A, B)), ("linalg_lu_solve", (LU, piv, B)),
                      ("linalg_solve_triangular", (A, B, True)), ("triangular_solve", (B, A))]
        for name, args in calls:
            args, kwargs = (args[:2], {"upper": True}) if name == "linalg_solve_triangular" else (args, {})
            got = call(name, *args, **kwargs)
            want = aten(name, *args, **kwargs)
            for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
                assert g.shape == w.shape and g.dtype == w.dtype and torch.equal(g, w), name


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_contiguous_inputs(call, dtype):
    base = rand(3, 2, 12, 12, dtype=dtype)
    views = {
        "transposed": base.mT,
        "sliced": base[:, :, ::2, 1::2],
        "batch stride 0": base[:1, :1].expand(3, 4, 12, 12),
        "batch dims permuted": base.permute(1, 0, 2, 3),
        "offset": base.reshape(-1)[5:5 + 2 * 49].view(2, 7, 7),
        "small sliced": base[:, 0, 1:4, ::4],
    }
    if dtype.is_complex:
        views["conjugated"] = base.conj()
        views["conjugated transposed"] = base.mH
    for name, A in views.items():
        LU, piv, info = call("linalg_lu_factor_ex", A)
        want = aten("linalg_lu_factor_ex", A)
        assert torch.equal(piv, want[1]), name
        assert_close(LU, want[0], 1e-4, name)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layouts_of_a_matrix_wider_than_a_panel(call, dtype):
    # Right of the first panel, a row-major A is copied to LU by tiles
    # before the factorisation; other layouts are read in place.
    base = rand(2, 75, 75, dtype=dtype)
    views = {"row-major": base[:, :40], "column-major": base.mT[:, :70], "sliced rows": base[:, ::2, 1:]}
    if dtype.is_complex:
        views["conjugated"] = base[:, :40].conj()
    for name, A in views.items():
        LU, piv, info = call("linalg_lu_factor_ex", A)
        check_lu(A.resolve_conj(), LU, piv, info)
        assert torch.equal(piv, aten("linalg_lu_factor_ex", A)[1]), name


def test_larger_than_512_goes_to_torchs_kernel():
    mps_ext.reset_stats()
    A = rand(513, 2)
    got = torch.ops.mps_ext.linalg_lu_factor_ex(A)
    assert torch.equal(got[0], torch.linalg.lu_factor_ex(A).LU)
    s = mps_ext.stats()["linalg"]
    assert (s["ran"], s["fallbacks"]) == (0, {"matrices of more than 512 rows": 1})


def test_float64_and_half_go_to_torchs_kernel():
    mps_ext.reset_stats()
    A = torch.randn(3, 3, dtype=torch.float64, generator=gen)
    assert torch.equal(torch.ops.mps_ext.linalg_inv_ex(A)[0], torch.linalg.inv_ex(A)[0])
    assert mps_ext.stats()["linalg"]["fallbacks"] == {"dtype Double (float32 and complex64 are handled)": 1}


# ------------------------------------------------------------ lu_unpack --
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(3, 3), (2, 6, 6), (5, 3), (3, 5), (1, 40, 40)], ids=lambda s: "x".join(map(str, s)))
def test_linalg_lu_and_lu_unpack(call, dtype, shape):
    A = rand(*shape, dtype=dtype)
    P, L, U = call("linalg_lu", A)
    for g, w in zip((P, L, U), aten("linalg_lu", A)):
        same_layout(g, w)
    assert_close(P @ L @ U, A, 50 * shape[-1] * EPS[dtype], "P L U")
    LU, piv = torch.linalg.lu_factor(A)
    for flags in itertools.product((True, False), repeat=2):
        got = call("lu_unpack", LU, piv, *flags)
        want = aten("lu_unpack", LU, piv, *flags)
        for g, w in zip(got, want):
            assert g.shape == w.shape and torch.equal(g, w), flags


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(2, 70, 70), (40, 75), (75, 40)], ids=lambda s: "x".join(map(str, s)))
def test_lu_unpack_of_any_layout(call, dtype, shape):
    # lu_unpack copies LU by 32 x 32 tiles, read along LU's contiguous
    # dimension: partial tiles, and LU column-major (as lu_factor gives it),
    # row-major, conjugated, or neither.
    LU, piv = torch.linalg.lu_factor(rand(*shape, dtype=dtype))
    views = {"column-major": LU, "row-major": LU.contiguous(), "strided": LU.repeat_interleave(2, -1)[..., ::2]}
    if dtype.is_complex:
        views["conjugated"] = LU.conj()
    for name, lu in views.items():
        for g, w in zip(call("lu_unpack", lu, piv), aten("lu_unpack", lu, piv)):
            assert g.shape == w.shape and torch.equal(g, w), name


def test_linalg_lu_without_pivoting_has_an_empty_p(call):
    A = well_conditioned(2, 5, 5)
    P, L, U = call("linalg_lu", A, pivot=False)
    assert P.shape == (0,)
    assert_close(L @ U, A, 1e-5)


def test_lu_unpack_rejects_pivots_out_of_range_as_torch(call, device):
    # As torch does: on the CPU, and on MPS from torch 2.10 on (it reads the
    # check back, waiting for the GPU, as ours does). torch 2.9's MPS kernel
    # neither checks nor waits; ours then ignores the bad pivots.
    LU, piv = torch.linalg.lu_factor(rand(3, 3))
    for bad in ([5, 1, 1], [0, 2, 3]):
        bad = torch.tensor(bad, dtype=torch.int32)
        if device == "mps" and _policy.torch_version(torch.__version__) < (2, 10):
            P, _, _ = call("lu_unpack", LU, bad)
            assert torch.equal(P.sum(-1), torch.ones(3)) and torch.equal(P.sum(-2), torch.ones(3))
        else:
            raises_as_torch(call, "lu_unpack", LU, bad)


# ------------------------------------------------------ triangular solve --
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,k", [(1, 1), (5, 1), (5, 3), (33, 20), (4, 7)])
def test_solve_triangular(call, dtype, n, k):
    # k = 1, 3, 20 (and 7): one, four and sixteen right-hand sides per
    # threadgroup, and a batch broadcast between A and B.
    A = well_conditioned(2, 1, n, n, dtype=dtype)
    for upper, left, unit in itertools.product((True, False), repeat=3):
        T = A.triu() if upper else A.tril()
        B = rand(3, n, k, dtype=dtype) if left else rand(3, k, n, dtype=dtype)
        X = call("linalg_solve_triangular", T, B, upper=upper, left=left, unitriangular=unit)
        want = aten("linalg_solve_triangular", wide(T), wide(B), upper=upper, left=left, unitriangular=unit)
        same_layout(X, aten("linalg_solve_triangular", T, B, upper=upper, left=left, unitriangular=unit))
        assert_close(X, want.to(dtype), 1e-4, f"upper={upper} left={left} unit={unit}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triangular_solve_with_transpose(call, dtype):
    A = well_conditioned(2, 6, 6, dtype=dtype)
    B = rand(3, 1, 6, 4, dtype=dtype)
    for upper, transpose, unit in itertools.product((True, False), repeat=3):
        T = A.triu() if upper else A.tril()
        X, clone = call("triangular_solve", B, T, upper, transpose, unit)
        want_x, want_clone = aten("triangular_solve", wide(B), wide(T), upper, transpose, unit)
        assert_close(X, want_x.to(dtype), 1e-4, f"upper={upper} transpose={transpose} unit={unit}")
        assert torch.equal(clone, want_clone.to(dtype))
        for g, w in zip((X, clone), aten("triangular_solve", B, T, upper, transpose, unit)):
            same_layout(g, w)


def test_solve_triangular_of_512(call):
    A = well_conditioned(512, 512).tril()
    B = rand(512, 2)
    X = call("linalg_solve_triangular", A, B, upper=False)
    assert_close(X, aten("linalg_solve_triangular", A.double(), B.double(), upper=False).float(), 1e-4)


def test_conjugated_and_transposed_operands(call):
    A = well_conditioned(4, 9, 9, dtype=torch.complex64)
    B = rand(4, 3, 9, dtype=torch.complex64)
    X = call("linalg_solve_triangular", A.triu().mH, B.conj().mT, upper=False)
    want = aten("linalg_solve_triangular", wide(A.triu().mH), wide(B.conj().mT), upper=False)
    assert_close(X, want.to(torch.complex64), 1e-4)


def layouts(t):
    """A batch of matrices t in the layouts an op may be given: contiguous,
    column-major, a conjugated view, the conjugate transpose of a contiguous
    tensor (a conjugated column-major view: torch solves with it without a
    copy), a strided slice, and a batch broadcast from one matrix."""
    out = {"contiguous": t, "column-major": t.mT.contiguous().mT, "sliced": torch.stack([t, t], -1)[..., 0],
           "broadcast": t[:1].expand(t.shape)}
    if t.is_complex():
        out["conj"] = t.conj().resolve_conj().conj()
        out["mH of contiguous"] = t.mH.contiguous().mH
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("left", [True, False])
def test_solve_triangular_output_strides_are_torchs(call, dtype, left):
    # torch's result is column-major, except where A is a conjugated
    # column-major view (A.mH of a contiguous A): row-major there
    # (linalg_solve_triangular_meta); .view(-1) of the result depends on it.
    n, k = 5, 3
    A = well_conditioned(2, n, n, dtype=dtype).triu()
    B = rand(2, n, k, dtype=dtype) if left else rand(2, k, n, dtype=dtype)
    for (an, a), (bn, b) in itertools.product(layouts(A).items(), layouts(B).items()):
        X = call("linalg_solve_triangular", a, b, upper=True, left=left)
        want = aten("linalg_solve_triangular", a, b, upper=True, left=left)
        same_layout(X, want)
        assert_close(X, want, 1e-4, f"A {an}, B {bn}")


# ------------------------------------------------------ solves with LU --
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 3, 6, 40])
def test_lu_solve(call, dtype, n):
    A = well_conditioned(2, n, n, dtype=dtype)
    LU, piv = torch.linalg.lu_factor(A)
    for left, adjoint in itertools.product((True, False), repeat=2):
        for k in (1, 5):
            B = rand(3, 1, n, k, dtype=dtype) if left else rand(3, 1, k, n, dtype=dtype)
            X = call("linalg_lu_solve", LU, piv, B, left=left, adjoint=adjoint)
            same_layout(X, aten("linalg_lu_solve", LU, piv, B, left=left, adjoint=adjoint))
            Aop = wide(A.mH if adjoint else A)
            residual = Aop @ wide(X) - wide(B) if left else wide(X) @ Aop - wide(B)
            assert residual.abs().max() < 1e-4 * wide(B).abs().max(), (left, adjoint, k)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 2, 4, 5, 40])
def test_solve(call, dtype, n):
    # n <= 4 factors and solves in one dispatch (one thread per matrix) when
    # B does not broadcast A; otherwise LU then a solve.
    A = well_conditioned(3, n, n, dtype=dtype)
    cases = [(A, rand(3, n, 2, dtype=dtype), True), (A, rand(3, 2, n, dtype=dtype), False),
             (A, rand(3, n, dtype=dtype), True), (A[0], rand(3, n, 2, dtype=dtype), True),
             (A, rand(n, 1, dtype=dtype), True), (A.mT, rand(3, n, 3, dtype=dtype), True),
             (A.mT.contiguous(), rand(3, 2, n, dtype=dtype), False)]
    for a, b, left in cases:
        got = call("_linalg_solve_ex", a, b, left=left)
        want = aten("_linalg_solve_ex", a, b, left=left)
        for g, w in zip(got, want):
            same_layout(g, w)
        assert torch.equal(got[2], want[2]) and torch.equal(
            got[3], want[3]
        )  # the same pivots: the same matrix factored
        assert_close(got[1], want[1], 1e-5, "LU")
        assert_close(got[0], aten("_linalg_solve_ex", wide(a), wide(b), left=left)[0].to(dtype), 1e-4, "X")


def test_solve_check_errors(call):
    A = singular_matrices(3, torch.float32)
    B = rand(5, 3, 1)
    raises_as_torch(call, "_linalg_solve_ex", A, B, check_errors=True)


# --------------------------------------------------------------- inverse --
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 24])
def test_inverse(call, dtype, n):
    A = well_conditioned(2, 3, n, n, dtype=dtype)
    for a in (A, A.mT, A[:, 1]):
        inv, info = call("linalg_inv_ex", a)
        want_inv, want_info = aten("linalg_inv_ex", a)
        same_layout(inv, want_inv)
        assert torch.equal(info, want_info)
        assert_close(inv, aten("linalg_inv_ex", wide(a))[0].to(dtype), 1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_inverse_of_singular_matrices_sets_info(call, dtype, n):
    A = singular_matrices(n, dtype)
    for a in (A, A.mT):
        inv, info = call("linalg_inv_ex", a)
        assert torch.equal(info, aten("linalg_inv_ex", a)[1])
        assert_close(inv[-1], aten("linalg_inv_ex", wide(a[-1]))[0].to(dtype), 1e-5)
    for a in (A, A[0]):
        raises_as_torch(call, "linalg_inv_ex", a, check_errors=True)


# ---------------------------------------------------------- determinants --
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [0, 1, 3, 4, 7, 30])
def test_det_and_slogdet(call, dtype, n):
    A = torch.cat([rand(3, n, n, dtype=dtype), singular_matrices(n, dtype)[:2] if n else rand(2, 0, 0, dtype=dtype)])
    for a in (A, A.mT):
        det, LU, piv = call("_linalg_det", a)
        want = aten("_linalg_det", a)
        for g, w in zip((det, LU, piv), want):
            same_layout(g, w)
        assert torch.equal(piv, want[2])  # torch's convention: the LU of A^T for contiguous real A
        assert_close(det, aten("_linalg_det", wide(a))[0].to(dtype), 1e-4, "det")
        sign, logabs, LU, piv = call("_linalg_slogdet", a)
        want = aten("_linalg_slogdet", wide(a))
        assert torch.equal(piv, want[3])
        assert sign.dtype == dtype and logabs.dtype == torch.float32
        assert_close(sign, want[0].to(dtype), 1e-5, "sign")
        finite = torch.isfinite(want[1])
        assert torch.equal(torch.isfinite(logabs), finite)
        assert_close(logabs[finite], want[1][finite].float(), 1e-5, "logabsdet")


# ------------------------------------------------------------ bad inputs --
BAD = [
    ("linalg_inv_ex", (torch.zeros(3, 4),), {}),
    ("linalg_inv_ex", (torch.zeros(3, 3, dtype=torch.int32),), {}),
    ("linalg_inv_ex", (torch.zeros(3),), {}),
    ("linalg_lu_factor_ex", (torch.zeros(3),), {}),
    ("linalg_lu_factor_ex", (torch.zeros(3, 3, dtype=torch.int64),), {}),
    ("linalg_lu", (torch.zeros(3),), {}),
    ("_linalg_solve_ex", (torch.zeros(2, 3, 3), torch.zeros(4, 3, 1)), {}),
    ("_linalg_solve_ex", (torch.zeros(3, 4), torch.zeros(3, 1)), {}),
    ("_linalg_solve_ex", (torch.zeros(3, 3), torch.zeros(3, 1, dtype=torch.float64)), {}),
    ("_linalg_solve_ex", (torch.zeros(3, 3), torch.zeros(3)), {"left": False}),
    ("linalg_solve_triangular", (torch.zeros(3, 3), torch.zeros(4, 2)), {"upper": True}),
    ("linalg_solve_triangular", (torch.zeros(2, 3, 3), torch.zeros(3, 3, 2)), {"upper": True}),
    ("linalg_solve_triangular", (torch.zeros(3, 3, dtype=torch.int32), torch.zeros(3, 2, dtype=torch.int32)),
     {"upper": True}),
    ("triangular_solve", (torch.zeros(4, 2), torch.zeros(3, 3)), {}),
    ("triangular_solve", (torch.zeros(3, 2), torch.zeros(3, 4)), {}),
    ("_linalg_det", (torch.zeros(2, 3),), {}),
    ("_linalg_slogdet", (torch.zeros(3, 3, dtype=torch.int32),), {}),
    ("lu_unpack", (torch.zeros(3, 3), torch.ones(3, dtype=torch.int64)), {}),
    ("lu_unpack", (torch.zeros(3),), {"LU_pivots": torch.ones(1, dtype=torch.int32)}),
]


def lu_solve_bad():
    LU, piv = torch.linalg.lu_factor(torch.randn(3, 3, generator=gen))
    return [
        (LU.double(), piv, torch.zeros(3, 2), {}),
        (LU, piv.long(), torch.zeros(3, 2), {}),
        (LU.int(), piv, torch.zeros(3, 2, dtype=torch.int32), {}),
        (torch.zeros(3, 4), piv, torch.zeros(3, 2), {}),
        (LU, piv, torch.zeros(4, 2), {}),
        (LU, piv, torch.zeros(2, 4), {"left": False}),
        (LU, piv[:2], torch.zeros(3, 2), {}),
        (LU, piv.expand(2, 3), torch.zeros(3, 2), {}),
        (LU.expand(2, 3, 3), piv.expand(2, 3), torch.zeros(3, 3, 2), {}),
        (LU, piv, torch.zeros(3), {}),
        (torch.zeros(3), piv, torch.zeros(3, 2), {}),
    ]


@pytest.mark.parametrize("name,args,kwargs", BAD, ids=lambda v: v if isinstance(v, str) else "")
def test_bad_inputs_raise_torchs_errors(name, args, kwargs):
    raises_as_torch(ours, name, *args, **kwargs)


def test_bad_lu_solve_inputs_raise_torchs_errors():
    # linalg_lu_solve checks its inputs itself (torch has no MPS kernel for
    # it before 2.14 to report them).
    for LU, piv, B, kwargs in lu_solve_bad():
        raises_as_torch(ours, "linalg_lu_solve", LU, piv, B, **kwargs)


# ------------------------------------------------------------- counters --
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_small_inverse_is_one_dispatch_at_minimum_traffic(dtype, n):
    A = well_conditioned(1000, n, n, dtype=dtype)
    with cpu_metal.record() as rec:
        inv, info = torch.ops.mps_ext.linalg_inv_ex(A)
    (d,) = rec.dispatches
    assert d.kernel == f"lu_small_{'c64' if dtype.is_complex else 'f32'}_{n}"
    assert d.total_threadgroups == (1000 + 63) // 64
    assert d.memory_bytes_moved / (A.nbytes + inv.nbytes + info.nbytes) <= 1.05


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_small_kernel_over_threadgroups_and_layouts(call, dtype, n):
    # 150 matrices: two full threadgroups of lu_small and a partial one, with
    # operands it copies through threadgroup memory as one run (contiguous,
    # row- or column-major) and operands it reads matrix by matrix.
    A = well_conditioned(300, n, n, dtype=dtype) + 2 * n * torch.eye(n, dtype=dtype)  # no near-singular one of 300
    for name, a in {"contiguous": A[:150], "transposed": A[:150].mT, "every other": A[::2]}.items():
        LU, piv, info = call("linalg_lu_factor_ex", a)
        want = aten("linalg_lu_factor_ex", a)
        assert torch.equal(piv, want[1]) and torch.equal(info, want[2]), name
        assert_close(LU, want[0], 1e-5, name)
        inv, info = call("linalg_inv_ex", a)
        assert_close(inv, aten("linalg_inv_ex", wide(a))[0].to(dtype), 1e-5, name)
    a = A[:150]
    for b, left in [(rand(150, n, dtype=dtype), True), (rand(150, n, 1, dtype=dtype), True),
                    (rand(150, n, n, dtype=dtype), True), (rand(150, n, n, dtype=dtype).mT, True),
                    (rand(150, n + 1, n, dtype=dtype), False), (rand(150, n, n + 2, dtype=dtype), True),
                    (rand(300, n, 1, dtype=dtype)[::2], True)]:
        got = call("_linalg_solve_ex", a, b, left=left)
        want = aten("_linalg_solve_ex", a, b, left=left)
        for g, w in zip(got, want):
            same_layout(g, w)
        assert torch.equal(got[2], want[2]) and torch.equal(got[3], want[3])
        assert_close(got[0], aten("_linalg_solve_ex", wide(a), wide(b), left=left)[0].to(dtype), 1e-4, "X")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_small_kernel_accesses_are_coalesced(dtype, n):
    # Each thread's matrix is n^2 elements from its neighbour's: read and
    # written through threadgroup memory, every device access of a
    # simdgroup covers consecutive elements (the fewest cache lines), and
    # the copies and the threads' own accesses have no bank conflicts.
    A, b = well_conditioned(256, n, n, dtype=dtype), rand(256, n, dtype=dtype)
    with cpu_metal.record(counters=True) as rec:
        torch.ops.mps_ext.linalg_lu_factor_ex(A)
        torch.ops.mps_ext._linalg_solve_ex(A, b)
        torch.ops.mps_ext._linalg_solve_ex(A, rand(256, n, n, dtype=dtype))
        torch.ops.mps_ext.linalg_inv_ex(A)
    assert len(rec.dispatches) == 4
    for d in rec.dispatches:
        worst = {d.buffer_names[i]: r for i, r in d.coalescing.items() if i not in d.constant_buffers and r > 1.0}
        assert not worst and d.bank_conflict_cycles == 0, (d.kernel, worst, d.bank_conflict_cycles)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_panel_unpack_and_solve_accesses_are_coalesced(dtype):
    # Row-major A wider than a panel (its first panel loaded along rows, the
    # rest copied to LU by tiles), lu_unpack's tiles, a row-major B of 4
    # columns staged by lu_solve: every device access of a simdgroup on the
    # fewest cache lines (diagonally dominant matrices: no row swaps, which
    # gather rows wherever the pivots are).
    A = well_conditioned(2, 64, 64, dtype=dtype)
    LU, piv = torch.linalg.lu_factor(A)
    with cpu_metal.record(counters=True) as rec:
        torch.ops.mps_ext.linalg_lu_factor_ex(A)
        torch.ops.mps_ext.lu_unpack(LU, piv)
        torch.ops.mps_ext.linalg_lu_solve(LU, piv, rand(2, 64, 4, dtype=dtype))
    assert [d.kernel.rsplit("_", 1)[0] for d in rec.dispatches] == ["lu_panel", "lu_unpack", "lu_solve_" + (
        "c64" if dtype.is_complex else "f32")]
    for d in rec.dispatches:
        worst = {d.buffer_names[i]: r for i, r in d.coalescing.items() if i not in d.constant_buffers and r > 1.0}
        assert not worst and d.bank_conflict_cycles == 0, (d.kernel, worst, d.bank_conflict_cycles)


@pytest.mark.parametrize("shape", [(16, 32, 32), (4, 40, 75), (4, 75, 40)], ids=lambda s: "x".join(map(str, s)))
def test_lu_unpack_is_one_dispatch_at_minimum_traffic(shape):
    # What keeps lu_unpack on torch 2.15 (mps_ext/_policy.py): torch's runs a
    # dozen aten ops over whole matrices, ours reads LU and the pivots once
    # and writes P, L and U once.
    LU, piv = torch.linalg.lu_factor(rand(*shape))
    with cpu_metal.record() as rec:
        P, L, U = torch.ops.mps_ext.lu_unpack(LU, piv)
    (d,) = rec.dispatches
    assert d.kernel == "lu_unpack_f32" and d.total_threadgroups == shape[0]
    assert d.memory_bytes_moved == LU.nbytes + piv.nbytes + P.nbytes + L.nbytes + U.nbytes


def test_lu_of_a_batch_is_one_dispatch():
    A = rand(4, 128, 128)
    with cpu_metal.record() as rec:
        torch.ops.mps_ext.linalg_lu_factor_ex(A)
    (d,) = rec.dispatches
    assert d.kernel == "lu_panel_f32" and d.total_threadgroups == 4


def test_dispatches_per_op():
    A, B = well_conditioned(8, 8, 8), rand(8, 8, 2)
    a, b = well_conditioned(8, 3, 3), rand(8, 3, 2)
    expect = [
        (lambda: torch.ops.mps_ext._linalg_solve_ex(a, b), ["lu_small_f32_3"]),
        (lambda: torch.ops.mps_ext._linalg_solve_ex(A, B), ["lu_panel_f32", "lu_solve_f32_4"]),
        (lambda: torch.ops.mps_ext.linalg_inv_ex(A), ["lu_panel_f32", "lu_solve_f32_16"]),
        (lambda: torch.ops.mps_ext._linalg_det(A), ["lu_panel_f32"]),
        (lambda: torch.ops.mps_ext.linalg_lu(A), ["lu_panel_f32", "lu_unpack_f32"]),
    ]
    for fn, kernels in expect:
        with cpu_metal.record() as rec:
            fn()
        assert [d.kernel for d in rec.dispatches] == kernels


def host_names(path):
    """The kernel names a .metal file instantiates, as the executor compiles it."""
    import sys
    sys.path.insert(0, str(ROOT / "tools"))
    import embed_shaders
    return set(cpu_metal.compile_library(embed_shaders.source(path.stem), filename=path.name).function_names)


def test_every_kernel_instantiation_runs():
    seen = set()
    with cpu_metal.record() as rec:
        for dtype in DTYPES:
            for n in (1, 2, 3, 4, 6):
                A = well_conditioned(2, n, n, dtype=dtype)
                torch.ops.mps_ext.linalg_lu(A)
                for k in (1, 3, 9):
                    torch.ops.mps_ext.linalg_solve_triangular(A, rand(2, n, k, dtype=dtype), upper=True)
    seen = {d.kernel for d in rec.dispatches}
    names = host_names(ROOT / "kernels_metal/linalg_lu.metal") | host_names(ROOT / "kernels_metal/linalg_solve.metal")
    assert seen == names


@pytest.mark.parametrize("n", [3, 9])
def test_nan_and_inf_inputs_give_nan_not_a_crash(call, n):
    # Which row LAPACK pivots on next to a NaN depends on the BLAS; the
    # kernels must stay inside the matrix and let the NaN through.
    for dtype in DTYPES:
        A = well_conditioned(3, n, n, dtype=dtype)
        A[0, 1, 1] = float("nan")
        A[1, :, 0] = float("nan")  # a whole column of NaN: no row compares larger
        A[2, 0, 0] = float("inf")
        LU, piv, info = call("linalg_lu_factor_ex", A)
        assert ((piv >= 1) & (piv <= n)).all()
        assert LU[0].isnan().any() and LU[1].isnan().any() and not LU[2].isfinite().all()
        inv, info = call("linalg_inv_ex", A)
        assert inv[0].isnan().any() and inv[1].isnan().any()
