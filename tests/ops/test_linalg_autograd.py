"""Autograd through mps_ext's linalg kernels.

On MPS, mps_ext's kernels sit below torch's autograd: the forward ops are
ours and torch's derivative formulas call aten ops again (linalg_lu_solve,
linalg_solve_triangular, lu_unpack, ...), which are ours too. The same setup
is made here on CPU tensors, in a subprocess: torch's aten ops get mps_ext's
kernels (the CPU Metal executor) as their CPU kernels, and every entry point
users call is differentiated, against the gradients of torch's own kernels
and against finite differences."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = r"""
import torch
import mps_ext
import mps_ext_executor

mps_ext_executor.install()  # mps_ext runs kernels on CPU tensors through it
mps_ext_executor._C._set_requested(True)  # on a Mac CPU tensors reach the executor only when asked

# linalg_lu_factor is composite on CPU (and on MPS from torch 2.10): it is
# not overridden, as a kernel of its own would bypass its autograd.
OPS = ["linalg_lu_factor_ex", "linalg_lu", "lu_unpack", "linalg_solve_triangular", "triangular_solve",
       "linalg_inv_ex", "_linalg_solve_ex", "linalg_lu_solve", "_linalg_det", "_linalg_slogdet"]

# mps_ext sends what it does not handle to the kernel aten had: let it see
# torch's own CPU kernels before they are replaced (float64 is not handled).
A64 = torch.randn(3, 3, dtype=torch.float64) + 3 * torch.eye(3, dtype=torch.float64)
B64 = torch.randn(3, 2, dtype=torch.float64)
LU64, P64 = torch.linalg.lu_factor(A64)
E = torch.ops.mps_ext
E.linalg_lu_factor_ex(A64); E.linalg_lu(A64); E.lu_unpack(LU64, P64); E.linalg_solve_triangular(A64, B64, upper=True)
E.triangular_solve(B64, A64); E.linalg_inv_ex(A64); E._linalg_solve_ex(A64, B64); E.linalg_lu_solve(LU64, P64, B64)
E._linalg_det(A64); E._linalg_slogdet(A64)

def entry_points(n, dtype, g):
    def rand(*s):
        x = torch.randn(*s, generator=g, dtype=torch.float64)
        if dtype.is_complex:
            x = x + 1j * torch.randn(*s, generator=g, dtype=torch.float64)
        return x.to(dtype)
    A = rand(2, n, n) + 2 * n ** 0.5 * torch.eye(n, dtype=dtype)
    B = rand(2, n, 3)
    W = rand(2, n, 3)
    Wn = rand(2, n, n)
    dot = lambda x, w: (x * w).real.sum()  # a real linear functional of a complex result
    cases = {
        "linalg.solve": (lambda a, b: dot(torch.linalg.solve(a, b), W), (A, B)),
        "linalg.solve left=False": (lambda a, b: dot(torch.linalg.solve(a, b.mT, left=False), W.mT), (A, B)),
        "linalg.solve vector": (lambda a, b: dot(torch.linalg.solve(a, b[..., 0]), W[..., 0]), (A, B)),
        "linalg.inv": (lambda a: dot(torch.linalg.inv(a), Wn), (A,)),
        "inverse transposed": (lambda a: dot(torch.inverse(a.mT), Wn), (A,)),
        "linalg.det": (lambda a: dot(torch.linalg.det(a), W[:, 0, 0]), (A,)),
        "linalg.slogdet": (lambda a: sum(dot(t, W[:, 0, 0]) for t in torch.linalg.slogdet(a)), (A,)),
        "linalg.lu_factor": (lambda a: dot(torch.linalg.lu_factor(a)[0], Wn), (A,)),
        "linalg.lu": (lambda a: sum(dot(t, Wn) for t in torch.linalg.lu(a)[1:]), (A,)),
        "lu_unpack": (lambda a: sum(dot(t, Wn) for t in torch.lu_unpack(*torch.linalg.lu_factor(a))[1:]), (A,)),
        "linalg.lu_solve": (lambda a, b: dot(torch.linalg.lu_solve(*torch.linalg.lu_factor(a), b), W), (A, B)),
        "linalg.lu_solve adjoint": (lambda a, b: dot(torch.linalg.lu_solve(*torch.linalg.lu_factor(a), b,
                                                                          adjoint=True), W), (A, B)),
        "linalg.lu_solve left=False": (lambda a, b: dot(torch.linalg.lu_solve(*torch.linalg.lu_factor(a), b.mT,
                                                                             left=False), W.mT), (A, B)),
        "linalg.solve_triangular": (lambda a, b: dot(torch.linalg.solve_triangular(a.triu(), b, upper=True), W),
                                    (A, B)),
        "linalg.solve_triangular left=False": (
            lambda a, b: dot(torch.linalg.solve_triangular(a.tril(), b.mT, upper=False, left=False), W.mT), (A, B)),
        "triangular_solve": (lambda a, b: dot(torch.triangular_solve(b, a.triu(), transpose=True)[0], W), (A, B)),
    }
    if not dtype.is_complex:
        cases["logdet"] = (lambda a: dot(torch.logdet(a @ a.mT), W[:, 0, 0]), (A,))
    return cases

def ran():
    return mps_ext.stats()["linalg"]["ran"]

# Entry points whose derivative formulas call the family's ops again.
BACKWARD_CALLS = {"linalg.solve", "linalg.solve left=False", "linalg.solve vector", "linalg.det", "linalg.slogdet",
                  "linalg.lu_factor", "linalg.lu", "linalg.lu_solve", "linalg.lu_solve adjoint",
                  "linalg.lu_solve left=False", "linalg.solve_triangular", "linalg.solve_triangular left=False",
                  "triangular_solve", "logdet", "lu_unpack"}

def measure(overridden):
    out = {}
    for n in (3, 6):  # one thread per matrix, and the panel kernel
        for dtype in (torch.float32, torch.complex64):
            for name, (fn, args) in entry_points(n, dtype, torch.Generator().manual_seed(n)).items():
                leaves = [a.clone().requires_grad_() for a in args]
                start = ran()
                loss = fn(*leaves)
                forward = ran() - start
                g = torch.autograd.grad(loss, leaves)
                backward = ran() - start - forward
                assert (forward > 0) == overridden, (name, forward)
                assert (backward > 0) == (overridden and name in BACKWARD_CALLS), (name, backward)
                out[(name, n, dtype)] = (loss.detach(), g, args, fn)
    return out

stock = measure(False)
lib = torch.library.Library("aten", "IMPL")
for op in OPS:
    lib.impl(op, (lambda name: lambda *a, **k: getattr(torch.ops.mps_ext, name)(*a, **k))(op), "CPU")
mps_ext.reset_stats()
ours = measure(True)
assert not mps_ext.stats()["linalg"]["fallbacks"], mps_ext.stats()

for key, (loss, g, args, fn) in ours.items():
    loss0, g0 = stock[key][:2]
    assert torch.allclose(loss, loss0, rtol=1e-4, atol=1e-4), (key, loss, loss0)
    for a, b in zip(g, g0):
        err = (a - b).abs().max().item() / max(b.abs().max().item(), 1)
        assert err < 1e-4, (key, err)
    # A directional finite difference in float64 of the stock function
    # agrees with our gradient.
    v = [torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).to(x.dtype) for x in args]
    eps = 1e-3
    with mps_ext.disabled("linalg"):
        f = lambda s: fn(*[(x.to(torch.complex128 if x.is_complex() else torch.float64) + s * d) for x, d in zip(args, v)])
        fd = (f(eps) - f(-eps)).item() / (2 * eps)
    analytic = sum((gi.conj() * d).real.sum().item() for gi, d in zip(g, v))
    assert abs(fd - analytic) <= 1e-3 * max(abs(fd), 1), (key, fd, analytic)
print("checked", len(ours), "gradients;", mps_ext.stats()["linalg"]["ran"], "calls ran mps_ext's kernels")
"""  # noqa: E501


def test_autograd_through_the_kernels_matches_torch():
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "checked 66 gradients" in r.stdout
