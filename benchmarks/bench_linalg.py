"""Linear algebra: the cases of `python -m benchmarks linalg`.

    python benchmarks/bench_linalg.py [--quick | --tiny]   (the same)

Cases: 10^6 batched inverses of 1x1 to 4x4 matrices (10^5 with --quick), and
LU factorisation (torch.linalg.lu_factor), torch.linalg.solve with one and
with four right-hand sides, inverses (a factorisation, then a solve against
the identity) and torch.lu_unpack at n = 32, 128 and 512, batch 1 and 64,
float32 and complex64. The minimum is reading every input once and writing
every output once (for solve: A and b in; x, LU, pivots and info out; for
lu_unpack: LU and pivots in, P, L and U out).

A 512 x 512 LU takes seconds on the executor (it runs every thread of the
GPU on the CPU); batch 64 at n = 512 is not run but computed as 64 times
batch 1: matrices are independent threadgroups of one dispatch, so
dispatches stay 1 (or 2) and threadgroups and bytes scale with the batch
(bytes up to the row swaps, which depend on each matrix's pivots).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import Case, Prepared, run_as_script  # noqa: E402

DTYPES = [torch.float32, torch.complex64]
EXTRAPOLATE = {(512, 64): 1}  # (n, batch) -> batch actually run
NOTES = ("With torch >= 2.15 mps_ext leaves LU, solves and float32 inverses to torch, so on a Mac both time "
         "columns time torch there; complex64 inverses stay mps_ext's.")


def matrices(batch, n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(batch, n, n, generator=g, dtype=torch.float64)
    if dtype.is_complex:
        a = a + 1j * torch.randn(batch, n, n, generator=g, dtype=torch.float64)
    return (a + 2 * n**0.5 * torch.eye(n)).to(dtype)


def nbytes(*ts):
    return sum(t.nbytes for t in ts)


def on_mps(*ts):
    return [t.to("mps") for t in ts]


def inverse(batch, n, dtype, seed) -> Prepared:
    A = matrices(batch, n, dtype, seed)
    inv, info = torch.linalg.inv_ex(A)

    def mac():
        (Am,) = on_mps(A)
        fn = lambda: torch.linalg.inv_ex(Am)  # noqa: E731
        return fn, fn

    return Prepared(lambda: torch.ops.mps_ext.linalg_inv_ex(A), nbytes(A, inv, info), mac)


def lu_factor(batch, n, dtype, seed) -> Prepared:
    A = matrices(batch, n, dtype, seed)
    lu, piv, info = torch.linalg.lu_factor_ex(A)

    def mac():
        (Am,) = on_mps(A)
        fn = lambda: torch.linalg.lu_factor_ex(Am)  # noqa: E731
        return fn, fn

    return Prepared(lambda: torch.ops.mps_ext.linalg_lu_factor_ex(A), nbytes(A, lu, piv, info), mac)


def solve(batch, n, dtype, seed, rhs) -> Prepared:
    A = matrices(batch, n, dtype, seed)
    b = torch.randn(batch, n, rhs).to(dtype)
    if rhs == 1:
        b = b[..., 0]
    x, lu, piv, info = torch.ops.aten._linalg_solve_ex(A, b)

    def mac():
        Am, bm = on_mps(A, b)
        fn = lambda: torch.linalg.solve_ex(Am, bm)  # noqa: E731
        return fn, fn

    return Prepared(lambda: torch.ops.mps_ext._linalg_solve_ex(A, b), nbytes(A, b, x, lu, piv, info), mac)


def lu_unpack(batch, n, dtype, seed) -> Prepared:
    lu, piv = torch.linalg.lu_factor(matrices(batch, n, dtype, seed))
    P, L, U = torch.lu_unpack(lu, piv)

    def mac():
        lum, pivm = on_mps(lu, piv)
        fn = lambda: torch.lu_unpack(lum, pivm)  # noqa: E731
        return fn, fn

    return Prepared(lambda: torch.ops.mps_ext.lu_unpack(lu, piv), nbytes(lu, piv, P, L, U), mac)


def cases(size: str) -> list[Case]:
    count = {"full": 10**6, "quick": 10**5, "tiny": 1000}[size]
    dtypes = DTYPES if size != "tiny" else [torch.float32]
    sizes = {"full": (32, 128, 512), "quick": (32, 128), "tiny": (32,)}[size]
    batches = (1, 64) if size != "tiny" else (1,)
    out = []

    def add(what, n, batch, dtype, prepare, run_batch=None, **kw):
        run_batch = run_batch or batch
        scale = batch // run_batch
        labels = {"case": f"{what} {batch} x {n}x{n}", "dtype": str(dtype)[6:],
                  "note": f"batch {run_batch} x {scale}" if scale > 1 else ""}
        seed = len(out)

        def scaled():
            p = prepare(run_batch, n, dtype, seed, **kw)
            return dataclasses.replace(p, minimum_bytes=p.minimum_bytes * scale, scale=scale)

        out.append(Case("linalg", f"{labels['case']} {labels['dtype']}", labels, scaled))

    for n in (1, 2, 3, 4) if size != "tiny" else (2,):
        for dtype in dtypes:
            add("inv", n, count, dtype, inverse)
    for n in sizes:
        for batch in batches:
            run_batch = EXTRAPOLATE.get((n, batch), batch)
            for dtype in dtypes:
                add("lu_factor", n, batch, dtype, lu_factor, run_batch)
                add("solve (1 rhs)", n, batch, dtype, solve, run_batch, rhs=1)
                add("lu_unpack", n, batch, dtype, lu_unpack, run_batch)
                if n < 512:
                    add("solve (4 rhs)", n, batch, dtype, solve, rhs=4)
                    add("inv", n, batch, dtype, inverse)
    return out


if __name__ == "__main__":
    run_as_script("linalg")
