"""Linear algebra: dispatches, threadgroups and bytes moved against the
minimum, from the CPU Metal executor everywhere; on a Mac also the median
time of stock torch against mps_ext.

    python benchmarks/bench_linalg.py [--count N]

Cases: N batched inverses of 2x2, 3x3 and 4x4 matrices (N = 10^6 by
default), and LU factorisation (torch.linalg.lu_factor), torch.linalg.solve
with one right-hand side and torch.lu_unpack at n = 32, 128 and 512, batch 1
and 64, float32 and complex64. The minimum is reading every input once and
writing every output once (for solve: A and b in; x, LU, pivots and info
out; for lu_unpack: LU and pivots in, P, L and U out).

A 512 x 512 LU takes seconds on the executor (it runs every thread of the
GPU on the CPU); batch 64 at n = 512 is not run but computed as 64 times
batch 1: matrices are independent threadgroups of one dispatch, so
dispatches stay 1 (or 2) and threadgroups and bytes scale with the batch
(bytes up to the row swaps, which depend on each matrix's pivots).
"""

import argparse
import time

import torch

import mps_ext  # noqa: F401
from common import mac_times, table, traffic

DTYPES = [torch.float32, torch.complex64]
EXTRAPOLATE = {(512, 64): 1}  # (n, batch) -> batch actually run


def matrices(batch, n, dtype, g):
    a = torch.randn(batch, n, n, generator=g, dtype=torch.float64)
    if dtype.is_complex:
        a = a + 1j * torch.randn(batch, n, n, generator=g, dtype=torch.float64)
    return (a + 2 * n**0.5 * torch.eye(n)).to(dtype)


def run(fn):
    """The executor's counters of fn's dispatches, and what fn returned."""
    out = []
    return traffic(lambda: out.append(fn())), out[0]


def nbytes(*ts):
    return sum(t.nbytes for t in ts)


def on_mac(stock_fn, ours_fn):
    """(stock, mps_ext) median microseconds as strings, or dashes."""
    if not torch.backends.mps.is_available():
        return "-", "-", "-"
    try:
        stock_fn()
    except Exception as e:  # torch before 2.15 refuses complex64 LU on MPS
        times = mac_times(ours_fn, ours_fn)
        return f"error ({type(e).__name__})", f"{times[1] * 1e6:.1f}", "-"
    times = mac_times(stock_fn, ours_fn)
    return f"{times[0] * 1e6:.1f}", f"{times[1] * 1e6:.1f}", f"{times[0] / times[1]:.2f}x"


def row(case, dtype, t, minimum, scale=1, note=""):
    return {"case": case, "dtype": str(dtype)[6:], "dispatches": t["dispatches"],
            "threadgroups": t["threadgroups"] * scale, "bytes/min": f"{t['memory_bytes'] / minimum:.3f}",
            "kernels": " ".join(t["kernels"]) + note}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--count", type=int, default=10**6, help="matrices in the small-inverse cases")
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    rows = []
    start = time.perf_counter()
    for n in (2, 3, 4):
        for dtype in DTYPES:
            A = matrices(args.count, n, dtype, g)
            t, (inv, info) = run(lambda: torch.ops.mps_ext.linalg_inv_ex(A))
            r = row(f"inv {args.count} x {n}x{n}", dtype, t, nbytes(A, inv, info))
            Am = A.to("mps") if torch.backends.mps.is_available() else None
            r["stock us"], r["mps_ext us"], r["speedup"] = on_mac(lambda: torch.linalg.inv_ex(Am),
                                                                  lambda: torch.linalg.inv_ex(Am))
            rows.append(r)
    for n in (32, 128, 512):
        for batch in (1, 64):
            for dtype in DTYPES:
                run_batch = EXTRAPOLATE.get((n, batch), batch)
                scale = batch // run_batch
                note = f" (batch {run_batch} x {scale})" if scale > 1 else ""
                A = matrices(run_batch, n, dtype, g)
                b = torch.randn(run_batch, n, generator=g).to(dtype)
                t, (lu, piv, info) = run(lambda: torch.ops.mps_ext.linalg_lu_factor_ex(A))
                r = row(f"lu_factor {batch} x {n}x{n}", dtype, t, nbytes(A, lu, piv, info), scale, note)
                Am = matrices(batch, n, dtype, g).to("mps") if torch.backends.mps.is_available() else None
                r["stock us"], r["mps_ext us"], r["speedup"] = on_mac(lambda: torch.linalg.lu_factor_ex(Am),
                                                                      lambda: torch.linalg.lu_factor_ex(Am))
                rows.append(r)
                t, (x, lu, piv, info) = run(lambda: torch.ops.mps_ext._linalg_solve_ex(A, b))
                r = row(f"solve {batch} x {n}x{n}, 1 rhs", dtype, t, nbytes(A, b, x, lu, piv, info), scale, note)
                bm = torch.randn(batch, n).to(dtype).to("mps") if Am is not None else None
                r["stock us"], r["mps_ext us"], r["speedup"] = on_mac(lambda: torch.linalg.solve_ex(Am, bm),
                                                                      lambda: torch.linalg.solve_ex(Am, bm))
                rows.append(r)
                t, (P, L, U) = run(lambda: torch.ops.mps_ext.lu_unpack(lu, piv))
                r = row(f"lu_unpack {batch} x {n}x{n}", dtype, t, nbytes(lu, piv, P, L, U), scale, note)
                lum, pivm = torch.linalg.lu_factor(Am) if Am is not None else (None, None)
                r["stock us"], r["mps_ext us"], r["speedup"] = on_mac(lambda: torch.lu_unpack(lum, pivm),
                                                                      lambda: torch.lu_unpack(lum, pivm))
                rows.append(r)
    print(table(rows, [("case", "case"), ("dtype", "dtype"), ("dispatches", "dispatches"),
                       ("threadgroups", "threadgroups"), ("bytes/min", "bytes / minimum"),
                       ("stock us", "stock (us)"), ("mps_ext us", "mps_ext (us)"), ("speedup", "speedup"),
                       ("kernels", "kernels")]))
    print("bytes / minimum: bytes read and written over tensor buffers, against reading every input once and "
          "writing every output once. Times only on a Mac (with torch >= 2.15 mps_ext leaves LU, solves and "
          "float32 inverses to torch, so both columns time torch there; complex64 inverses stay mps_ext's).")
    print(f"executor run time: {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
