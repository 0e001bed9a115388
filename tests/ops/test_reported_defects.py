"""Defects an outside test suite (PyTorch's OpInfo samples and adversarial
cases against torch.ops.mps_ext) found, one test each, and how tensors on
another device than the kernel's are handled."""

import os
import subprocess
import sys

import pytest
import torch

import mps_ext
import mps_ext_executor as cpu_metal

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_two_threads_making_their_first_calls_do_not_deadlock(tmp_path):
    """Each thread's first call builds attention_gate.metal for the executor
    (a fresh cache directory, so the build runs Python and the compiler).
    The build used to run under a lock taken while holding the GIL, and
    released the GIL inside: the other thread then waited for the lock
    holding the GIL. The build sleeps first, releasing the GIL as the
    compiler's subprocesses do, so that the second call comes while the
    first builds however fast the library builds. With the lock planted
    back into executor/csrc/backend.cpp (taken after the GIL) the process
    deadlocked, with and without the sleep; the test used to build
    linear.metal for its window, two minutes of CI's run."""
    code = """
import threading, time, torch, mps_ext, mps_ext_executor
from mps_ext_executor import _compiler
mps_ext_executor.install()  # mps_ext runs kernels on CPU tensors through it
mps_ext_executor._C._set_requested(True)  # on a Mac CPU tensors reach the executor only when asked
build = _compiler.build
def slow_build(*args, **kwargs):
    time.sleep(2)
    return build(*args, **kwargs)
_compiler.build = slow_build
def work():
    torch.ops.mps_ext.sigmoid_gate(torch.randn(4, 64), torch.randn(4, 64))
threads = [threading.Thread(target=work) for _ in range(2)]
for t in threads: t.start()
for t in threads: t.join()
print(mps_ext.stats()["attention_gate"]["ran"])
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                       env={**os.environ, "MPS_EXT_CACHE_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "2"


def misaligned(t):
    """A copy of `t` whose data is 8 bytes past a 16-byte boundary, as
    torch.frombuffer, numpy or a memory-mapped checkpoint can give."""
    raw = bytearray(t.numel() * t.element_size() + 32)
    base = torch.frombuffer(raw, dtype=torch.uint8).data_ptr()
    offset = (8 - base % 16) % 16
    out = torch.frombuffer(raw, dtype=t.dtype, offset=offset, count=t.numel()).view(t.shape)
    out.copy_(t)
    assert out.data_ptr() % 16 == 8
    return out


@pytest.mark.parametrize("which", ["weight", "activation"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_data_pointers_only_8_byte_aligned(which, dtype):
    x, w = torch.randn(3, 256).to(dtype), torch.randn(100, 256).to(dtype)
    with cpu_metal.record() as rec:
        torch.ops.mps_ext.linear(x, w, None)
    assert rec.dispatches[0].kernel.endswith("_vec")  # aligned: 16-byte loads
    if which == "weight":
        w = misaligned(w)
    else:
        x = misaligned(x)
    with cpu_metal.record() as rec:
        got = torch.ops.mps_ext.linear(x, w, None)
    assert rec.dispatches[0].kernel.endswith("_scalar")
    torch.testing.assert_close(got, (x.double() @ w.double().t()).to(dtype), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype,value", [(torch.uint8, 300.7), (torch.int8, float("nan")), (torch.float16, 1e6),
                                         (torch.float32, 2.5)])
@pytest.mark.parametrize("pad", [[], [0, 0], [-1, 0, 0, -1], [0, -2]])
def test_pad_with_nothing_to_fill_copies_the_cropped_input(run, dtype, value, pad):
    """aten returns a clone of the narrowed input and never converts the
    fill value, so a value the dtype cannot hold is no error."""
    x = torch.arange(12).reshape(3, 4).to(dtype)
    got = run("constant_pad_nd", x, pad, value, family="pad")
    want = torch.constant_pad_nd(x, pad, value)
    assert torch.equal(got, want)
    assert got.stride() == want.stride()


def test_pad_with_nothing_to_fill_keeps_the_stride_order(run):
    x = torch.randn(3, 4).t()
    got = run("constant_pad_nd", x, [], 0, family="pad")
    assert torch.equal(got, x) and got.stride() == (1, 4) == torch.constant_pad_nd(x, []).stride()


@pytest.mark.parametrize("dtype,value,name", [(torch.uint8, 300.7, "uint8_t"), (torch.int8, float("nan"), "int8_t"),
                                              (torch.float16, 1e6, "c10::Half")])
def test_pad_fill_values_out_of_range_raise_torch_error(dtype, value, name):
    x = torch.ones(3, 4, dtype=dtype)
    with pytest.raises(RuntimeError, match=f"value cannot be converted to type {name} without overflow"):
        torch.constant_pad_nd(x, [1, 0], value)
    with pytest.raises(RuntimeError, match=f"value cannot be converted to type {name} without overflow"):
        torch.ops.mps_ext.constant_pad_nd(x, [1, 0], value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("scalars", [dict(alpha=1e39), dict(beta=-1e39), dict(alpha=3.5e38, beta=1.0)])
def test_addmm_scalars_out_of_float_range_raise_torch_error(dtype, scalars):
    b, x, w = torch.randn(2, 3).to(dtype), torch.randn(2, 4).to(dtype), torch.randn(4, 3).to(dtype)
    msg = "value cannot be converted to type float without overflow"
    with pytest.raises(RuntimeError, match=msg):
        torch.addmm(b, x, w, **scalars)
    mps_ext.reset_stats()
    with pytest.raises(RuntimeError, match=msg):
        torch.ops.mps_ext.addmm(b, x, w, **scalars)
    assert mps_ext.stats()["linear"]["fallbacks"] == {}  # raised by mps_ext's own op


def test_addmm_with_nothing_to_multiply_converts_no_scalar(run):
    b, x, w = torch.randn(2, 3), torch.randn(2, 0), torch.randn(0, 3)
    got = run("addmm", b, x, w, beta=1e39, family="linear")
    assert torch.equal(got, torch.addmm(b, x, w, beta=1e39))


def test_pad_complex32(run):
    x = torch.randn(3, 4, dtype=torch.complex64).to(torch.complex32)
    got = run("constant_pad_nd", x, [1, 2, 0, 1], 2 - 1j, family="pad")
    want = torch.constant_pad_nd(x, [1, 2, 0, 1], 2 - 1j)
    assert torch.equal(got.view(torch.float16), want.view(torch.float16))


# ------------------------------------------------- tensors on another device
# PyTorch's MPS ops get 0-dim CPU tensors beside MPS tensors (the dispatcher
# picks the MPS kernel). route() sends any call with a tensor on another
# device than its kernel's to the stock kernel, which does what torch does.

def test_a_tensor_on_another_device_goes_to_the_stock_kernel():
    """The same decision on the CPU key: a 0-dim tensor of another device
    (meta, the only other one here) beside CPU tensors, handed to the CPU
    kernel by redispatch as the dispatcher hands a CPU scalar to an MPS
    kernel."""
    cpu = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
    scalar, x, w = torch.tensor(1.5, device="meta"), torch.randn(2, 3), torch.randn(3, 4)
    with pytest.raises(Exception) as aten_error:
        torch.ops.aten.addmm.default.redispatch(cpu, scalar, x, w)
    mps_ext.reset_stats()
    with pytest.raises(type(aten_error.value), match=str(aten_error.value)):
        torch.ops.mps_ext.addmm.default.redispatch(cpu, scalar, x, w)
    assert mps_ext.stats()["linear"]["fallbacks"] == {"a META tensor beside CPU tensors": 1}


def test_a_cpu_scalar_beside_cpu_tensors_is_ours():
    mps_ext.reset_stats()
    x, w = torch.randn(2, 3), torch.randn(3, 4)
    got = torch.ops.mps_ext.addmm(torch.tensor(1.5), x, w)
    torch.testing.assert_close(got, torch.addmm(torch.tensor(1.5), x, w))
    assert mps_ext.stats()["linear"]["ran"] == 1


@pytest.mark.skipif(not mps_ext.is_available(), reason="needs MPS")
@pytest.mark.parametrize("op,args", [
    ("addmm", lambda d: (torch.tensor(0.5), torch.randn(2, 8, device=d), torch.randn(8, 5, device=d))),
    ("linear", lambda d: (torch.randn(3, 8, device=d), torch.randn(5, 8, device=d), torch.tensor(2.0))),
])
def test_cpu_scalars_beside_mps_tensors_do_what_torch_does(op, args):
    torch.manual_seed(0)
    a = args("mps")
    fam = "linear"
    before = mps_ext.stats()[fam]["fallbacks"].get("a CPU tensor beside MPS tensors", 0)
    with mps_ext.disabled(fam):
        try:
            want, want_error = getattr(torch.ops.aten, op)(*a).cpu(), None
        except Exception as e:
            want, want_error = None, e
    if want_error is not None:
        with pytest.raises(type(want_error)):
            getattr(torch.ops.aten, op)(*a)
    else:
        torch.testing.assert_close(getattr(torch.ops.aten, op)(*a).cpu(), want)
    if fam in mps_ext.installed_overrides():
        assert mps_ext.stats()[fam]["fallbacks"].get("a CPU tensor beside MPS tensors", 0) == before + 1
