"""Any aten op the fp8 family does not handle, on a float8 tensor, fails
with an error that names the op and says to cast first (csrc/ops/fp8_errors.cpp).

On a Mac the wrappers go on the MPS key at `import mps_ext`. Here they are
put on the CPU key, in a process of their own (they stay for the life of the
process), where torch's CPU kernels refuse float8 arithmetic the way its MPS
kernels do: with an error naming the dtype only.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

import mps_ext

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Each case: an expression on float8 `x`, run before and after wrapping.
CASES = {
    "add": "x + x",
    "sum": "x.sum()",
    "exp": "x.exp()",
    "cumsum": "x.cumsum(0)",
    "abs": "x.abs()",  # torch's CPU kernel takes float8: unchanged
    "clone": "x.clone()",
    "view": "x.view(torch.uint8)",
    "shape": "torch.ones(2) + torch.ones(3)",  # an error not about float8: unchanged
}

SCRIPT = r"""
import json, sys, torch, mps_ext
cases = json.loads(sys.argv[1])
x = torch.tensor([1.0, -2.0, 0.5]).to(torch.float8_e4m3fn)
a, b = torch.randn(5, 3), torch.randn(3, 4)

def run():
    out = {}
    for name, expr in cases.items():
        try:
            v = eval(expr)
            out[name] = ["ok", v.view(torch.uint8).tolist() if v.dtype == x.dtype else v.tolist()]
        except Exception as e:
            out[name] = [type(e).__name__, str(e)]
    out["values"] = [(a @ b).tolist(), (a + 1).sum().item(), torch.softmax(a, 1).tolist()]
    return out

before = run()
wrapped = mps_ext._C.name_float8_errors("CPU")
again = mps_ext._C.name_float8_errors("CPU")
after = run()
dumps = {op: torch._C._dispatch_dump(op) for op in ("aten::add.Tensor", "aten::view", "aten::copy_", "aten::empty.memory_format")}
print(json.dumps(dict(before=before, after=after, wrapped=wrapped, again=again, dumps=dumps)))
"""  # noqa: E501


def run_script(script, *args):
    """The JSON `script` prints last, run in a process of its own."""
    r = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def run():
    return run_script(SCRIPT, json.dumps(CASES))


@pytest.mark.parametrize("op, aten", [("add", "aten::add.Tensor"), ("sum", "aten::sum"), ("exp", "aten::exp"),
                                      ("cumsum", "aten::cumsum")])
def test_an_op_refusing_float8_is_named_with_the_advice_to_cast(run, op, aten):
    kind, torch_message = run["before"][op]
    assert kind == "NotImplementedError" and "Float8_e4m3fn" in torch_message and aten not in torch_message
    kind_after, message = run["after"][op]
    assert kind_after == kind  # the same Python exception class
    assert message.startswith(f"mps_ext fp8: {aten}") and "cast first" in message
    assert torch_message in message  # torch's own words kept


@pytest.mark.parametrize("op", ["abs", "clone", "view", "shape"])
def test_what_torch_does_not_refuse_for_float8_is_unchanged(run, op):
    assert run["after"][op] == run["before"][op]


def test_other_dtypes_get_the_same_results(run):
    assert run["after"]["values"] == run["before"]["values"]


def test_views_ops_without_tensors_and_mps_ext_overrides_are_not_wrapped(run):
    assert run["wrapped"] == run["again"] > 300  # once per key
    dumps = run["dumps"]
    assert "fp8_errors.cpp" in dumps["aten::add.Tensor"]
    for op in ("aten::view", "aten::copy_", "aten::empty.memory_format"):
        assert "fp8_errors.cpp" not in dumps[op], op


def test_only_mps_or_cpu():
    with pytest.raises(ValueError, match="'MPS' or 'CPU'"):
        mps_ext._C.name_float8_errors("CUDA")


def test_a_float8_cpu_tensor_of_the_fp8_family_does_not_wrap_cpu_ops():
    """The fp8 family's CPU kernels never wrap the CPU key (on a Mac, the MPS
    key is wrapped at import)."""
    x = torch.ones(4).to(torch.float8_e4m3fn)
    out = torch.empty_like(x)
    torch.ops.mps_ext.copy_(out, x)
    assert "fp8_errors.cpp" not in torch._C._dispatch_dump("aten::add.Tensor")


# A third party's kernel for an op, registered before or after the wrappers
# and then removed (a torch.library.Library destroyed): the op must be
# torch's again. A wrapper holding the removed kernel would raise on every
# call ("SafeKernelFunction has been invalidated").
THIRD_PARTY = r"""
import json, torch, mps_ext

def fp8_error(fn):
    try:
        fn(torch.tensor([1.0, 2.0]).to(torch.float8_e4m3fn))
    except Exception as e:
        return str(e)

def value(fn):
    try:
        return fn(torch.ones(2)).tolist()
    except Exception as e:
        return f"{type(e).__name__}: {e}"

out = {}
before = torch.library.Library("aten", "IMPL")
before.impl("exp", lambda x: torch.full_like(x, 7.0), "CPU")
out["wrapped"] = mps_ext._C.name_float8_errors("CPU")
out["exp with the third party's kernel"] = value(torch.exp)
before._destroy()
out["exp once it is removed"] = value(torch.exp)
out["exp's float8 error"] = fp8_error(torch.exp)
after = torch.library.Library("aten", "IMPL")
after.impl("sin", lambda x: torch.full_like(x, 5.0), "CPU")
out["sin with the third party's kernel"] = value(torch.sin)
after._destroy()
out["sin once it is removed"] = value(torch.sin)
out["sin's float8 error"] = fp8_error(torch.sin)
print(json.dumps(out))
"""


def test_a_third_party_kernel_removed_leaves_torchs_kernel():
    out = run_script(THIRD_PARTY)
    e, s = torch.ones(2).exp().tolist(), torch.ones(2).sin().tolist()
    # Registered before the wrappers: that op is left unwrapped (the
    # dispatcher cannot reach the kernel beneath a removed one).
    assert out["exp with the third party's kernel"] == [7.0, 7.0]
    assert out["exp once it is removed"] == e
    assert out["exp's float8 error"] and not out["exp's float8 error"].startswith("mps_ext fp8")
    # Registered after them: the wrapper is beneath it, and once it is gone
    # the wrapper calls torch's kernel and names the op.
    assert out["sin with the third party's kernel"] == [5.0, 5.0]
    assert out["sin once it is removed"] == s
    assert out["sin's float8 error"].startswith("mps_ext fp8: aten::sin does not take float8 tensors")


# Another thread runs ops on float8 tensors while the wrappers are
# registered (the binding releases the GIL, as a Mac's install leaves other
# threads running): it must see the ops unnamed, then named, switching once
# (one pass may straddle the switch: unnamed ops, then named ones), never a
# table where some ops are named and others not.
CONCURRENT = r"""
import json, threading, time, torch, mps_ext

x = torch.tensor([1.0, 2.0]).to(torch.float8_e4m3fn)
ops = [lambda: x + x, lambda: x.sum(), lambda: x.exp(), lambda: x.cumsum(0), lambda: x / x, lambda: x.sin(),
       lambda: x.log(), lambda: x.sqrt(), lambda: x.mean(), lambda: x.prod(), lambda: x.tanh(), lambda: x.cos()]

def named(op):
    try:
        op()
    except Exception as e:
        return str(e).startswith("mps_ext fp8")
    raise AssertionError("an op took float8")

passes, stop = [], threading.Event()

def dispatch():
    while not stop.is_set():
        passes.append([named(op) for op in ops])

def wait_for(n):
    while len(passes) < n and worker.is_alive():
        time.sleep(0.001)

worker = threading.Thread(target=dispatch)
worker.start()
wait_for(20)
start = len(passes)
mps_ext._C.name_float8_errors("CPU")
during = len(passes) - start
wait_for(len(passes) + 20)
stop.set()
worker.join()
print(json.dumps(dict(passes=passes, during=during)))
"""


def test_threads_running_ops_see_all_ops_named_or_none():
    out = run_script(CONCURRENT)
    passes = out["passes"]
    assert out["during"] > 0  # the other thread ran while the wrappers were registered
    assert not any(passes[0]) and all(passes[-1])
    flat = [named for p in passes for named in p]  # in the order the thread ran them
    switches = sum(a != b for a, b in zip(flat, flat[1:]))
    assert switches == 1, [p for p in passes if 0 < sum(p) < len(p)]
