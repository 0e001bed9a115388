"""Installing the overrides: torch's "Overriding a previously registered
kernel" warning is not printed, every other warning is; and what a
torch.compile'd model reaches. On a Mac the overrides go on the MPS key; the
same mechanism puts them on the CPU key here, each time in a process of its
own (the aten CPU kernels of the test process stay torch's)."""

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCH_WARNING = "Overriding a previously registered kernel for the same operator and the same dispatch key"


def python(code):
    r = subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return r


def test_torch_warns_at_the_first_override_of_a_process():
    """The premise: without mps_ext's filter, the first override a process
    makes prints torch's warning."""
    r = python("""
import torch
lib = torch.library.Library("aten", "IMPL", "CPU")
lib.impl("mm", lambda *args: None)  # aten::mm has a CPU kernel to override
""")
    assert TORCH_WARNING in r.stderr


def test_installing_overrides_prints_no_override_warning():
    r = python("""
import warnings, torch, mps_ext
warnings.simplefilter("error")  # a Python warning would fail the process
# aten::linear, mm and addmm have CPU kernels: this is the override torch warns about.
print(mps_ext._C.install_overrides(["linear"], "CPU"))
print(mps_ext._C.install_overrides(["linear", "softmax", "pad"], "CPU"))
import mps_ext_executor
mps_ext_executor.install()  # mps_ext runs kernels on CPU tensors through it
mps_ext_executor._C._set_requested(True)  # on a Mac CPU tensors reach the executor only when asked
x = torch.ones(2, 3)
assert torch.equal(torch.nn.functional.pad(x, (1, 1)), torch.cat([torch.zeros(2, 1), x, torch.zeros(2, 1)], 1))
print(mps_ext.stats()["pad"]["ran"])
""")
    assert r.stdout.splitlines() == ["['linear']", "['linear', 'softmax', 'pad']", "1"]  # the aten op reached ours
    assert TORCH_WARNING not in r.stderr and "Warning" not in r.stderr, r.stderr


def test_the_filter_passes_every_other_warning(capfd):
    from mps_ext import _C
    _C._warn_without_override_warning("something else torch says")
    _C._warn_without_override_warning(f"Warning only once for all operators.\n  {TORCH_WARNING}\n  operator: x")
    err = capfd.readouterr().err
    assert "something else torch says" in err
    assert TORCH_WARNING not in err


COMPILED_MODEL = """
import torch, mps_ext, torch.nn.functional as F
FAMILIES = ["grouped_mm", "linalg", "linear", "softmax", "pad"]
mps_ext._C.install_overrides(FAMILIES, "CPU")
import mps_ext_executor
mps_ext_executor.install()  # mps_ext runs kernels on CPU tensors through it
mps_ext_executor._C._set_requested(True)  # on a Mac CPU tensors reach the executor only when asked
grouped_mm = getattr(F, "grouped_mm", torch._grouped_mm)  # aten::_grouped_mm either way (F's from torch 2.10)
def model(x, w, b, w2, m, experts, offs):
    y = F.linear(x, w, b)    # aten::addmm once traced
    y = torch.softmax(y, -1)
    y = F.pad(y, (1, 1))
    moe = grouped_mm(x.bfloat16(), experts.transpose(-2, -1), offs=offs)  # aten::_grouped_mm
    return y @ w2, torch.linalg.solve(m, x[:, :16].mT), moe  # aten::mm; aten::_linalg_solve_ex
x, w, b, w2 = torch.randn(2, 64), torch.randn(32, 64), torch.randn(32), torch.randn(34, 16)
m = torch.randn(16, 16) + 8 * torch.eye(16)
experts, offs = torch.randn(3, 8, 64).bfloat16(), torch.tensor([1, 1, 2], dtype=torch.int32)
want = model(x, w, b, w2, m, experts, offs)
torch._dynamo.reset()
mps_ext.reset_stats()
got = torch.compile(model, backend=BACKEND)(x, w, b, w2, m, experts, offs)
torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
print({fam: s["ran"] for fam, s in sorted(mps_ext.stats().items()) if fam in FAMILIES})
"""


def test_a_model_compiled_with_aot_eager_reaches_every_override():
    r = python(COMPILED_MODEL.replace("BACKEND", "'aot_eager'"))
    assert r.stdout.strip() == "{'grouped_mm': 1, 'linalg': 1, 'linear': 2, 'pad': 1, 'softmax': 1}"


def test_what_inductor_calls():
    """Inductor decomposes softmax and constant padding into kernels of its
    own (they do not reach the overrides), and calls matmuls as extern
    kernels with out= (aten::addmm.out, aten::mm.out), which mps_ext
    overrides too: on the CPU here as on MPS (the lowering of mm and addmm
    to extern kernels does not depend on the device). The linear-algebra
    ops have no lowering: inductor calls the functional aten op as a
    fallback, which reaches the override; _grouped_mm is an extern kernel
    without out= (extern_kernels._grouped_mm, torch._grouped_mm), which
    reaches it too."""
    code = (
        COMPILED_MODEL.replace("BACKEND", "'inductor'")
        + """
from torch._inductor.utils import run_and_get_code
torch._dynamo.reset()
_, (source, *_) = run_and_get_code(torch.compile(model, backend="inductor"), x, w, b, w2, m, experts, offs)
print(sorted(line.strip().split("(")[0] for line in source.splitlines() if "extern_kernels." in line and "out=" in line))
print(sorted({line.split("=")[1].strip().split("(")[0] for line in source.splitlines()
              if "= torch.ops.aten." in line}))
print(sorted({line.split("=")[1].strip().split("(")[0] for line in source.splitlines()
              if "= extern_kernels." in line and "out=" not in line}))
"""  # noqa: E501
    )
    r = python(code)
    ran, extern, fallbacks, functional_extern = r.stdout.strip().splitlines()
    assert ran == "{'grouped_mm': 1, 'linalg': 1, 'linear': 2, 'pad': 0, 'softmax': 0}"
    assert extern == "['extern_kernels.addmm', 'extern_kernels.mm']"
    assert fallbacks == "['torch.ops.aten._linalg_solve_ex.default']"
    assert functional_extern == "['extern_kernels._grouped_mm']"


def test_a_compiled_model_reaches_the_float8_overrides():
    """Float8 tensor ops and _scaled_mm in a compiled model reach the fp8 and
    scaled_mm overrides (on the CPU key here): .to(float8) and .float() as
    copy_ inside aten's _to_copy, zeros as zero_, fill_, cat, index_select,
    _scaled_mm. Every call of torch's own that the overrides make inside
    (fill_'s conversion of the value on a CPU tensor) goes to aten's CPU
    kernel, not back into the override."""
    r = python("""
import torch, mps_ext
mps_ext._C.install_overrides(["fp8", "scaled_mm"], "CPU")
import mps_ext_executor
mps_ext_executor.install()  # mps_ext runs kernels on CPU tensors through it
mps_ext_executor._C._set_requested(True)  # on a Mac CPU tensors reach the executor only when asked
def model(x, w8, sa, sb, idx):
    q = torch.cat([x.to(torch.float8_e5m2)] * 2).index_select(0, idx)
    y = torch._scaled_mm(x.to(torch.float8_e4m3fn), w8.t(), sa, sb, out_dtype=torch.float32)
    z = torch.zeros(3, dtype=torch.float8_e5m2).fill_(2.0)
    return q.float(), y, z.float()
x, w8 = torch.randn(4, 64) * 10, (torch.randn(48, 64) * 10).to(torch.float8_e4m3fn)
sa, sb, idx = torch.rand(4, 1), torch.rand(1, 48), torch.tensor([7, 0, 3])
want = model(x, w8, sa, sb, idx)
assert torch.equal(want[2], torch.full((3,), 2.0))
for backend in ["eager", "aot_eager"]:
    torch._dynamo.reset()
    mps_ext.reset_stats()
    got = torch.compile(model, backend=backend, fullgraph=True)(x, w8, sa, sb, idx)
    torch.testing.assert_close(got, want)
    print(backend, {fam: s["ran"] for fam, s in sorted(mps_ext.stats().items()) if fam in ("fp8", "scaled_mm")})
""")
    # fp8: two .to(float8) and two .float() (copy_), cat, index_select, zero_, fill_
    assert r.stdout.splitlines() == ["eager {'fp8': 8, 'scaled_mm': 1}", "aot_eager {'fp8': 8, 'scaled_mm': 1}"]


@pytest.mark.skipif(
    not hasattr(torch.nn.functional, "scaled_grouped_mm"),
    reason="this torch has no F.scaled_grouped_mm (torch 2.9; from 2.10 it calls _scaled_grouped_mm_v2)",
)
def test_f_grouped_mm_and_f_scaled_grouped_mm_reach_the_overrides():
    """The public functions of torch 2.10+ reach the grouped_mm overrides (on
    the CPU key here, as on MPS): F.grouped_mm as _grouped_mm, and
    F.scaled_grouped_mm, with row-wise scales, as _scaled_grouped_mm_v2,
    which no torch runs off CUDA."""
    r = python("""
import torch, torch.nn.functional as F, mps_ext
mps_ext._C.install_overrides(["grouped_mm"], "CPU")
import mps_ext_executor
mps_ext_executor.install()  # mps_ext runs kernels on CPU tensors through it
mps_ext_executor._C._set_requested(True)  # on a Mac CPU tensors reach the executor only when asked
a, w = torch.randn(6, 32), torch.randn(3, 16, 32) / 6
offs = torch.tensor([2, 2, 6], dtype=torch.int32)
want = torch.cat([a[:2] @ w[0].t(), a[2:] @ w[2].t()])
a8, w8 = a.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
got = F.grouped_mm(a, w.transpose(-2, -1), offs=offs)
torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
sa, sw = torch.full((6,), 0.5), torch.full((3, 16), 2.0)
got8 = F.scaled_grouped_mm(a8, w8.transpose(-2, -1), sa, F.ScalingType.RowWise, sw, F.ScalingType.RowWise, offs=offs)
want8 = torch.cat([a8[:2].float() @ w8[0].float().t(), a8[2:].float() @ w8[2].float().t()]).bfloat16()
assert got8.dtype == torch.bfloat16
torch.testing.assert_close(got8.float(), want8.float(), rtol=1e-2, atol=1e-2)
print(mps_ext.stats()["grouped_mm"])
""")
    assert r.stdout.strip() == "{'ran': 2, 'fallbacks': {}, 'unavailable': {}}"
