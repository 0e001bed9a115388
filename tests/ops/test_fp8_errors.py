"""Any aten op the fp8 family does not handle, on a float8 tensor, fails
with an error that names the op and says to cast first (csrc/ops/fp8_errors.cpp).

On a Mac the wrappers go on the MPS key when float8 values first reach the
GPU. Here they are put on the CPU key, in a process of their own (they stay
for the life of the process), where torch's CPU kernels refuse float8
arithmetic the way its MPS kernels do: with an error naming the dtype only.
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
"""


@pytest.fixture(scope="module")
def run():
    r = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(CASES)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.splitlines()[-1])


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
    """Only the MPS key is wrapped when float8 values arrive (float8_reached)."""
    x = torch.ones(4).to(torch.float8_e4m3fn)
    out = torch.empty_like(x)
    torch.ops.mps_ext.copy_(out, x)
    assert "fp8_errors.cpp" not in torch._C._dispatch_dump("aten::add.Tensor")
