"""torch.compile traces torch.ops.mps_ext.* through their Meta kernels (the
aten ops' own, registered for every op of every family) and runs mps_ext's
kernels in the compiled code. What a compiled model on MPS reaches of the
aten overrides is in tests/test_install.py."""

import pytest
import torch

import mps_ext

torch.manual_seed(0)


def model(x, w, b, grad):
    y = torch.ops.mps_ext.linear(x, w, b) + torch.ops.mps_ext.mm(x, w.t())
    y = y + torch.ops.mps_ext.addmm(b, x, w.t(), beta=0.5, alpha=2.0)
    p = torch.ops.mps_ext._softmax(y, -1, False)
    lp = torch.ops.mps_ext._log_softmax(y, 0, False)
    g = torch.ops.mps_ext._softmax_backward_data(grad, p, -1, p.dtype)
    g = g + torch.ops.mps_ext._log_softmax_backward_data(grad, lp, 0, lp.dtype)
    return torch.ops.mps_ext.constant_pad_nd(g, [1, 2, 0, 1], 0.25)


def inputs(rows=3):
    return torch.randn(rows, 64), torch.randn(40, 64) / 8, torch.randn(40), torch.randn(rows, 40)


def test_every_op_is_in_the_model():
    names = {op.split("::")[1] for fam in mps_ext.families() for op in mps_ext._C.family_aten_ops(fam)}
    import inspect
    source = inspect.getsource(model)
    assert all(f"torch.ops.mps_ext.{n}(" in source for n in names)


@pytest.mark.parametrize("dynamic", [False, True])
def test_aot_eager(dynamic):
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=dynamic)
    for rows in (3, 5):
        args = inputs(rows)
        want = model(*args)
        mps_ext.reset_stats()
        got = compiled(*args)
        torch.testing.assert_close(got, want)
        assert {fam: s["ran"] for fam, s in mps_ext.stats().items()} == {"linear": 3, "softmax": 4, "pad": 1}


def test_inductor_on_cpu():
    torch._dynamo.reset()
    args = inputs()
    want = model(*args)
    mps_ext.reset_stats()
    got = torch.compile(model, backend="inductor", fullgraph=True)(*args)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert {fam: s["ran"] for fam, s in mps_ext.stats().items()} == {"linear": 3, "softmax": 4, "pad": 1}
