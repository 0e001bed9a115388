"""Self-check: every op family of mps_ext against torch's own CPU kernels or
float64 references.

Where mps_ext is available (a Mac) the kernels run on the GPU, through the
overridden aten ops, and are compared with torch's CPU results. Where a
backend of CPU tensors is installed (a test's or a contributor's:
mps_ext/_cpu_backend.py) they also run on CPU tensors through it, as
torch.ops.mps_ext.*, inside its request(). With neither there is nothing
to check.

A call that goes to torch's own kernel by decision (the policy leaves the op
to the installed torch, or the family is turned off) is checked the same way
and passes if torch's result is right; a call that goes there for any other
reason (a Metal kernel that failed to build, an input mps_ext should handle)
is a failure.
"""

from __future__ import annotations

import dataclasses

import torch

import mps_ext
from mps_ext import _cpu_backend

TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


@dataclasses.dataclass
class Case:
    family: str
    name: str
    op: object  # the aten function, e.g. torch._softmax
    args: tuple
    want: torch.Tensor  # torch's CPU result, or a float64 reference


@dataclasses.dataclass
class Result:
    case: Case
    device: str
    ok: bool
    detail: str = ""
    ours: bool = True  # mps_ext's kernel ran (False: torch's, by decision)
    ran: bool = True  # False: not run, the family is off and torch has no kernel for the op here


def judge(family: str, device: str, before: dict, after: dict) -> tuple[bool, str]:
    """For one call of an op of `family` on `device` ("cpu" or "mps"),
    given the family's stats() before and after it: whether mps_ext's kernel
    ran, and what is wrong ("" if nothing) if it did not for a reason that is
    not a decision."""
    if after["ran"] == before["ran"] + 1:
        return True, ""
    if device == "mps" and family not in mps_ext.installed_overrides():
        return False, ""  # torch's own kernel: the policy or MPS_EXT_DISABLE left the family out
    new = {why: n - before["fallbacks"].get(why, 0) for why, n in after["fallbacks"].items()
           if n != before["fallbacks"].get(why, 0)}
    if new and all(why == mps_ext.TURNED_OFF or why.startswith(mps_ext.POLICY_PREFIX) for why in new):
        return False, ""
    return False, f"mps_ext's kernel did not run: {new or 'the call was not counted'}"


def close(got, want) -> tuple[bool, str]:
    if isinstance(want, tuple):  # ops with several outputs
        for i, (g, w) in enumerate(zip(got, want)):
            ok, detail = close(g, w)
            if not ok:
                return False, f"output {i}: {detail}"
        return True, ""
    got, want = got.cpu(), want.cpu()
    if got.shape != want.shape or got.dtype != want.dtype:
        return False, f"got {tuple(got.shape)} {got.dtype}, want {tuple(want.shape)} {want.dtype}"
    if not (got.is_floating_point() or got.is_complex()):
        return bool(torch.equal(got, want)), "values differ"
    tol = TOLERANCE.get(got.dtype, 1e-5)
    wide = torch.complex128 if got.is_complex() else torch.float64
    if torch.allclose(got.to(wide), want.to(wide), rtol=tol, atol=tol, equal_nan=True):
        return True, ""
    return False, f"max difference {(got.to(wide) - want.to(wide)).abs().nan_to_num(0).max().item():.3g}"


def cases() -> list[Case]:
    g = torch.Generator().manual_seed(0)
    out = []
    for shape, dim in [((3, 7), 1), ((4, 300), -1), ((2, 20000), 1), ((5, 6, 7), 1)]:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            x = (torch.randn(shape, generator=g) * 3).to(dtype)
            grad = torch.randn(shape, generator=g).to(dtype)
            for log in (False, True):
                fwd = torch._log_softmax if log else torch._softmax
                bwd = torch._log_softmax_backward_data if log else torch._softmax_backward_data
                name = f"{fwd.__name__[1:]} {tuple(shape)} dim={dim} {str(dtype)[6:]}"
                # torch's CPU kernels in float64, rounded once: the reference
                y = fwd(x.double(), dim, False).to(dtype)
                out.append(Case("softmax", name, fwd, (x, dim, False), y))
                out.append(Case("softmax", name + " backward", bwd, (grad, y, dim, dtype),
                                bwd(grad.double(), y.double(), dim, torch.float64).to(dtype)))
    for shape, pad, dtype in [((2, 3, 4), [1, 2], torch.float32), ((1, 2, 3, 8, 8), [1, 1, 1, 1, 1, 1], torch.float16),
                              ((4, 5), [-1, 2, 0, -2], torch.int64), ((3, 3), [2, 2], torch.bool)]:
        x = (torch.randn(shape, generator=g) * 10).to(dtype)
        out.append(Case("pad", f"constant_pad_nd {tuple(shape)} pad={pad} {str(dtype)[6:]}", torch.constant_pad_nd,
                        (x, pad, 1), torch.constant_pad_nd(x, pad, 1)))
    for rows, n, k, dtype in [(1, 64, 100, torch.float32), (3, 300, 257, torch.float16), (8, 96, 64, torch.bfloat16)]:
        x = torch.randn(rows, k, generator=g).to(dtype)
        w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
        b = torch.randn(n, generator=g).to(dtype)
        tag = f"{rows}x{k} @ {n}x{k}^T {str(dtype)[6:]}"
        out.append(Case("linear", f"linear {tag}", torch.nn.functional.linear, (x, w, b),
                        torch.nn.functional.linear(x.double(), w.double(), b.double()).to(dtype)))
        out.append(Case("linear", f"mm {tag}", torch.mm, (x, w.t()), (x.double() @ w.double().t()).to(dtype)))
        out.append(Case("linear", f"addmm {tag}", torch.addmm, (b, x, w.t()),
                        (b.double() + x.double() @ w.double().t()).to(dtype)))
    for fmt in (torch.float8_e4m3fn, torch.float8_e5m2):
        x = (torch.randn(6, 40, generator=g) * 30).to(fmt)
        idx = torch.tensor([5, 0, 2])
        out.append(Case("fp8", f"index_select {str(fmt)[6:]}", torch.index_select, (x, 0, idx),
                        torch.index_select(x, 0, idx)))
        src = torch.randn(5, 33, generator=g).bfloat16() * 100
        out.append(Case("fp8", f"copy_ bfloat16 -> {str(fmt)[6:]}", torch.Tensor.copy_,
                        (torch.empty(5, 33, dtype=fmt), src), src.to(fmt)))
        out.append(Case("fp8", f"eq {str(fmt)[6:]}", torch.eq, (x, x[:1]), torch.eq(x, x[:1])))
        out.append(Case("fp8", f"repeat {str(fmt)[6:]}", torch.Tensor.repeat, (x, (2, 1)), x.repeat(2, 1)))
    for rows in (2, 40):
        a = (torch.randn(rows, 96, generator=g) * 20).to(torch.float8_e4m3fn)
        w = (torch.randn(80, 96, generator=g) * 20).to(torch.float8_e4m3fn)
        sa, sb = torch.rand(rows, 1, generator=g) / 100, torch.rand(1, 80, generator=g) / 100
        # float64, not torch's CPU _scaled_mm: on a CPU with AMX that is
        # oneDNN's matmul, which cannot run capped at AVX2.
        out.append(Case("scaled_mm", f"_scaled_mm row-wise {rows}x96 @ 96x80 e4m3fn", torch._scaled_mm,
                        (a, w.t(), sa, sb, None, None, torch.float32),
                        ((a.double() * sa.double()) @ (w.t().double() * sb.double())).float()))
    layer = torch.nn.Linear(200, 48, dtype=torch.bfloat16)
    w8, ws = mps_ext.fp8.quantize_weight(layer.weight, "block")
    x = torch.randn(3, 200, generator=g).bfloat16()
    want = (x.double() @ (w8.double() * ws.repeat_interleave(128, 0).repeat_interleave(128, 1)[:48, :200]).t()
            + layer.bias.double()).bfloat16()
    out.append(Case("scaled_mm", "fp8_linear block 3x200 @ 48x200^T bfloat16", torch.ops.mps_ext.fp8_linear,
                    (x, w8, ws, "block", layer.bias.detach()), want))
    for dtype in (torch.float32, torch.complex64):
        tag = str(dtype)[6:]
        for shape in [(4, 3, 3), (2, 24, 24)]:  # one thread per matrix; a threadgroup per matrix
            a = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype) + 5 * torch.eye(shape[-1], dtype=dtype)
            b = torch.randn(shape[:-1] + (2,), generator=g, dtype=torch.float64).to(dtype)
            a64, b64 = a.to(_wide(dtype)), b.to(_wide(dtype))
            name = f"{tuple(shape)} {tag}"
            # The same factors as torch (same pivots): outputs compared whole.
            out.append(Case("linalg", f"linalg_lu_factor_ex {name}", torch.ops.aten.linalg_lu_factor_ex, (a,),
                            _narrow(torch.ops.aten.linalg_lu_factor_ex(a64), dtype)))
            out.append(Case("linalg", f"linalg_inv_ex {name}", torch.ops.aten.linalg_inv_ex, (a,),
                            _narrow(torch.ops.aten.linalg_inv_ex(a64), dtype)))
            out.append(Case("linalg", f"_linalg_solve_ex {name}", torch.ops.aten._linalg_solve_ex, (a, b),
                            _narrow(torch.ops.aten._linalg_solve_ex(a64, b64), dtype)))
            lu, piv = torch.linalg.lu_factor(a)
            out.append(Case("linalg", f"linalg_lu_solve {name}", torch.ops.aten.linalg_lu_solve, (lu, piv, b),
                            torch.linalg.lu_solve(lu.to(_wide(dtype)), piv, b64).to(dtype)))
            out.append(Case("linalg", f"_linalg_slogdet {name}", torch.ops.aten._linalg_slogdet, (a,),
                            _narrow(torch.ops.aten._linalg_slogdet(a64), dtype)))
    for rows, counts, dtype in [(8, [0, 3, 0, 4, 1], torch.bfloat16), (90, [40, 0, 50], torch.float16)]:
        k, n = 64, 48
        x = torch.randn(rows, k, generator=g).to(dtype)
        w = (torch.randn(len(counts), n, k, generator=g) / k**0.5).to(dtype)  # W[E, N, K]
        offs = torch.tensor(counts, dtype=torch.int32).cumsum(0).int()
        want, start = torch.empty(rows, n, dtype=torch.float64), 0
        for e, end in enumerate(offs.tolist()):
            want[start:end] = x[start:end].double() @ w[e].double().t()
            start = end
        out.append(Case("grouped_mm", f"_grouped_mm {rows}x{k} @ experts {tuple(w.shape)} {str(dtype)[6:]}",
                        torch._grouped_mm, (x, w.transpose(-2, -1), offs), want.to(dtype)))
    x8 = torch.randn(8, 64, generator=g).to(torch.float8_e4m3fn)
    w8 = torch.randn(4, 32, 64, generator=g).to(torch.float8_e4m3fn)
    sx, sw = torch.rand(8, generator=g) + 0.5, torch.rand(4, 32, generator=g) + 0.5
    offs = torch.tensor([2, 2, 5, 8], dtype=torch.int32)
    want, start = torch.empty(8, 32, dtype=torch.float64), 0
    for e, end in enumerate(offs.tolist()):
        want[start:end] = (x8[start:end].double() @ w8[e].double().t()) * sx[start:end, None] * sw[e][None]
        start = end
    out.append(Case("grouped_mm", "_scaled_grouped_mm fp8 8x64 @ experts (4, 32, 64)", torch._scaled_grouped_mm,
                    (x8, w8.transpose(-2, -1), sx, sw, offs), want.to(torch.bfloat16)))
    if hasattr(torch.ops.aten, "_scaled_grouped_mm_v2"):  # torch 2.10 on (F.scaled_grouped_mm)
        out.append(Case("grouped_mm", "_scaled_grouped_mm_v2 row-wise fp8 8x64 @ experts (4, 32, 64)",
                        torch.ops.aten._scaled_grouped_mm_v2,
                        (x8, w8.transpose(-2, -1), [sx], [1], [], [sw], [1], [], offs), want.to(torch.bfloat16)))
    return out


def _wide(dtype):
    return torch.complex128 if dtype.is_complex else torch.float64


def _narrow(outputs, dtype):
    """torch's float64 / complex128 results in the dtypes of a `dtype` call."""
    real = torch.float32
    return tuple(o if not o.is_floating_point() and not o.is_complex()
                 else o.to(dtype if o.is_complex() or not dtype.is_complex else real) for o in outputs)


def cpu_op(op):
    """The torch.ops.mps_ext op that runs mps_ext's kernel for aten function `op`."""
    return getattr(torch.ops.mps_ext, op.__name__)  # F.linear's __name__ is 'linear' too


def torch_lacks_kernel(case: Case, device: str) -> bool:
    """Whether the case's op is an aten op of its family for which torch has
    no kernel of its own where `device` ("cpu": CPU tensors) runs it
    (mps_ext registers one there rather than overriding torch's)."""
    name = f"aten::{case.op.__name__}"
    return (name in mps_ext._C.family_aten_ops(case.family)
            and not mps_ext._C.has_stock_kernel(name, "CPU" if device == "cpu" else "MPS"))


def devices() -> list[str]:
    """What the self-check runs the kernels on here: "mps" where mps_ext is
    available, "cpu" where a backend of CPU tensors is installed."""
    return (["cpu"] if _cpu_backend.installed() else []) + (["mps"] if mps_ext.is_available() else [])


def run() -> list[Result]:
    # The CPU backend is asked for (on a Mac, torch.ops.mps_ext ops on CPU
    # tensors reach it only then).
    with _cpu_backend.request():
        return _run()


def _run() -> list[Result]:
    results = []
    here = devices()
    if not here:
        return results
    for case in cases():
        for device in here:
            off = case.family not in mps_ext.enabled_ops() or (
                device == "mps" and case.family not in mps_ext.installed_overrides())
            if off and torch_lacks_kernel(case, device):
                # Switched off, with nothing of torch's to run instead (an op
                # mps_ext registers where torch has none): a decision, not run.
                results.append(Result(case, device, True, "not run: off, and torch has no kernel for it",
                                      ours=False, ran=False))
                continue
            ours = True
            try:
                if device == "cpu":
                    op, args = cpu_op(case.op), case.args
                else:
                    op, args = case.op, [a.to("mps") if isinstance(a, torch.Tensor) else a for a in case.args]
                # Only the op's call between the two: moving float8 tensors
                # to and from the GPU is a call of the fp8 family too.
                before = mps_ext.stats()[case.family]
                got = op(*args)
                after = mps_ext.stats()[case.family]
                ok, detail = close(got, case.want)
                ours, problem = judge(case.family, device, before, after)
                if problem:
                    ok, detail = False, problem
            except Exception as e:
                ok, detail = False, f"{type(e).__name__}: {e}".splitlines()[0]
            results.append(Result(case, device, ok, detail, ours))
    return results
