"""How the model tests compare runs. They run real library model code
(transformers, diffusers, torch's own consumers of linear algebra) in tiny
seeded random configs, three ways on CPU tensors: in float64 (the reference), with stock torch in the
test dtype, and under mps_ext_executor.run_model (ours: mps_ext's kernels
on the CPU Metal executor wherever a Mac with torch RELEASE would run them).

The bound, `no_worse`: err(ours) <= FACTOR * err(stock) + ATOL[dtype], with
err the largest absolute difference from the float64 run over the largest
magnitude of that run. Ours and stock compute in the same dtype with fp32
accumulation, so their rounding errors against float64 are of one size but
fall on different elements with different signs (another summation order);
a factor of 2 leaves room for stock being the luckier on the worst element,
while a real defect (a lost term, a wrong row, a half-precision
accumulator) is far outside it. ATOL, a few units in the dtype's last place,
covers outputs that stock gets almost exactly (err(stock) near 0).

Each test records its figures (families that ran kernels, both errors, its
time) in a Figures."""

import time

import torch

# The torch release whose policy the runs follow: the installed one, where
# every family but the ones torch 2.14/2.15 took over runs mps_ext's kernels.
RELEASE = "2.13"
FACTOR = 2.0
ATOL = {torch.float32: 4 * torch.finfo(torch.float32).eps, torch.bfloat16: 4 * torch.finfo(torch.bfloat16).eps,
        torch.complex64: 4 * torch.finfo(torch.float32).eps}



def rel_err(x, ref):
    """Largest |x - ref| over the largest |ref| (ref in float64)."""
    x, ref = x.detach(), ref.detach()
    wide = torch.complex128 if ref.is_complex() else torch.float64
    x, ref = x.to(wide), ref.to(wide)
    return float((x - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


class Figures:
    """What one test measured: per compared output, the two errors."""

    def __init__(self, name):
        self.name, self.errors, self.families, self.start = name, {}, set(), time.perf_counter()

    def no_worse(self, what, ours, stock, ref, dtype):
        e_ours, e_stock = rel_err(ours, ref), rel_err(stock, ref)
        self.errors[what] = (e_stock, e_ours)
        bound = FACTOR * e_stock + ATOL[dtype]
        assert e_ours <= bound, (f"{what}: error of mps_ext's run vs float64 {e_ours:.3g} > {FACTOR} x stock's "
                                 f"{e_stock:.3g} + {ATOL[dtype]:.3g}")

    def ran(self, report, families):
        """The families that ran kernels are exactly `families`."""
        self.families = report.ran_kernels()
        assert self.families == set(families), f"{self.families} ran kernels, expected {set(families)}\n{report}"




def without_passes(monkeypatch, *names):
    """mps_ext.optimize without the passes `names` (a test's "before")."""
    from mps_ext import passes
    monkeypatch.setattr(passes, "PASSES", tuple(p for p in passes.PASSES if p.name not in names))
