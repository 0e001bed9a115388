"""torch.compile traces torch.ops.mps_ext.* through their Meta kernels (the
aten ops' own, or the family's: scaled_mm, fp8_linear) and runs mps_ext's
kernels in the compiled code. What a compiled model on MPS reaches of the
aten overrides is in tests/test_install.py."""

import inspect

import pytest
import torch
from torch import nn

import mps_ext
import mps_ext_executor

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


def fp8_model(x, a8, w8, ws, sa, sb, idx):
    y = torch.ops.mps_ext.fp8_linear(x, w8, ws, "row", None)
    y = y + torch.ops.mps_ext._scaled_mm(a8, w8.t(), sa, sb, None, None, torch.float32)
    y = y + torch.ops.mps_ext._scaled_mm_v2(a8, w8.t(), [sa], [1], [], [sb], [1], [], None, torch.float32, [],
                                            False)
    rows = torch.ops.mps_ext.index_select(torch.ops.mps_ext.cat([w8, w8], 0), 0, idx)
    return y, rows.view(torch.uint8)


def fp8_inputs(rows=3):
    w8 = (torch.randn(40, 64) * 50).to(torch.float8_e4m3fn)
    return (torch.randn(rows, 64), (torch.randn(rows, 64) * 50).to(torch.float8_e4m3fn), w8,
            torch.rand(40, 1) / 50, torch.rand(rows, 1) / 50, torch.rand(1, 40) / 50, torch.tensor([79, 0, 41]))


def fp8_in_place(x, dst8, idx):
    # Ops that write into an argument. aot_eager cannot functionalize a
    # custom op whose output aliases an input (torch refuses "a custom
    # (non-ATen) operator whose output has alias annotations"; aten's own
    # copy_/fill_/zero_ are functionalized and reach mps_ext's MPS override
    # through aten), so these are traced by dynamo alone (their Meta kernels
    # on fake tensors) and run eagerly.
    torch.ops.mps_ext.copy_(dst8, x)
    torch.ops.mps_ext.fill_.Scalar(dst8[0], 2.5)
    torch.ops.mps_ext.fill_.Tensor(dst8[1], x[0, 0])
    torch.ops.mps_ext.zero_(dst8[2])
    out = torch.empty(dst8.shape)
    torch.ops.mps_ext.copy_(out, dst8)
    return out.index_select(1, idx)


def fp8_value_ops(x8, y8, mask, idx):
    # The fp8 family's value ops: comparisons, indexing, bit moves, scalars.
    cmp = [torch.ops.mps_ext.eq.Tensor(x8, y8), torch.ops.mps_ext.eq.Scalar(x8, 1.0),
           torch.ops.mps_ext.ne.Tensor(x8, y8), torch.ops.mps_ext.ne.Scalar(x8, 1.0),
           torch.ops.mps_ext.lt.Tensor(x8, y8), torch.ops.mps_ext.lt.Scalar(x8, 1.0),
           torch.ops.mps_ext.le.Tensor(x8, y8), torch.ops.mps_ext.le.Scalar(x8, 1.0),
           torch.ops.mps_ext.gt.Tensor(x8, y8), torch.ops.mps_ext.gt.Scalar(x8, 1.0),
           torch.ops.mps_ext.ge.Tensor(x8, y8), torch.ops.mps_ext.ge.Scalar(x8, 1.0)]
    z = torch.ops.mps_ext.where.self(mask, x8, y8)
    z = torch.ops.mps_ext.repeat(torch.ops.mps_ext.flip(z, [0]), [2, 1])
    z = torch.ops.mps_ext.gather(z, 1, idx.expand(z.shape[0], -1))
    w = x8.clone()
    torch.ops.mps_ext._index_put_impl_(w, [None, idx], y8[:, :2], False, False)
    torch.ops.mps_ext.masked_fill_.Scalar(w, mask, 0.5)
    torch.ops.mps_ext.masked_fill_.Tensor(w, ~mask, torch.tensor(-2.0))
    picked = torch.ops.mps_ext.index.Tensor(w, [mask])
    return torch.stack(cmp), z.view(torch.uint8), w.view(torch.uint8), picked.view(torch.uint8), fp8_scalars(x8, y8)


@torch.compiler.disable  # Python values: dynamo runs them eagerly (as it does aten's .item() on MPS)
def fp8_scalars(x8, y8):
    return torch.tensor([float(torch.ops.mps_ext._local_scalar_dense(x8[0, 0])),
                         float(torch.ops.mps_ext.equal(x8, y8))])


def mm_out_forms(x, w, b):
    # The out= forms, traced by dynamo alone and run eagerly, as fp8_in_place
    # (their out argument is an alias annotation).
    y = torch.empty(x.shape[0], w.shape[0])
    torch.ops.mps_ext.mm.out(x, w.t(), out=y)
    z = torch.empty(x.shape[0], w.shape[0])
    torch.ops.mps_ext.addmm.out(b, x, w.t(), beta=0.5, alpha=2.0, out=z)
    return y + z


def linalg_model(a, b):
    """Every op of the linalg family, on a batch of n x n matrices `a` and
    right-hand sides `b` (n x 2)."""
    lu, piv, _ = torch.ops.mps_ext.linalg_lu_factor_ex(a)
    lu_np, _ = torch.ops.mps_ext.linalg_lu_factor(a, pivot=False)
    p, l, u = torch.ops.mps_ext.linalg_lu(a)
    p2, l2, u2 = torch.ops.mps_ext.lu_unpack(lu, piv)
    x1 = torch.ops.mps_ext.linalg_solve_triangular(u, b, upper=True)
    x2, _ = torch.ops.mps_ext.triangular_solve(b, l2, upper=False, unitriangular=True)
    inv, _ = torch.ops.mps_ext.linalg_inv_ex(a)
    x3, *_ = torch.ops.mps_ext._linalg_solve_ex(a, b)
    x4 = torch.ops.mps_ext.linalg_lu_solve(lu, piv, b, adjoint=True)
    det, *_ = torch.ops.mps_ext._linalg_det(a)
    sign, logabsdet, *_ = torch.ops.mps_ext._linalg_slogdet(a)
    return (lu_np + p @ l + p2 @ u2 + inv, x1 + x2 + x3 + x4, det + sign * logabsdet)


def linalg_inputs(batch=3, n=5):
    return torch.randn(batch, n, n) + 2 * n * torch.eye(n), torch.randn(batch, n, 2)


def moe_model(x, router, w_gate_up, w_down, a8, b8, scale_a, scale_b, offs8, bank8, bank_scale):
    """A mixture-of-experts decode layer through mps_ext's own ops (their fake
    kernels, mps_ext/_meta.py), op by op and as moe_layer, its first expert product again through
    _grouped_mm and through FP8Experts' prefill op (fp8_grouped_linear, fp8
    experts), and an fp8 _scaled_grouped_mm (v1 and v2)."""
    top_k = 2
    logits = torch.ops.mps_ext.linear(x, router, None)
    weights, offs, slot_of_row, row_of_slot = torch.ops.mps_ext.moe_route(logits, top_k, True, False)
    h = torch.ops.mps_ext.moe_experts(x, w_gate_up, None, offs, slot_of_row, top_k, True)
    y = torch.ops.mps_ext.moe_experts(h, w_down, None, offs)
    out = torch.ops.mps_ext.moe_combine(y, weights, row_of_slot)
    layer = torch.ops.mps_ext.moe_layer(
        x, router, w_gate_up, None, w_down, None, top_k, True, False
    )  # the same, one op
    rows = x[slot_of_row.long() // top_k]  # the tokens' rows sorted by expert
    gate_up = torch.ops.mps_ext._grouped_mm(rows, w_gate_up.transpose(-2, -1), offs)
    gate_up8 = torch.ops.mps_ext.fp8_grouped_linear(rows, bank8, bank_scale, offs)
    fp8 = torch.ops.mps_ext._scaled_grouped_mm(a8, b8, scale_a, scale_b, offs8)
    fp8_v2 = torch.ops.mps_ext._scaled_grouped_mm_v2(a8, b8, [scale_a], [1], [], [scale_b], [1], [], offs8)
    return out, layer, gate_up, gate_up8, fp8, fp8_v2


def moe_inputs(tokens=3, hidden=64, experts=8, ffn=32):
    g = torch.Generator().manual_seed(tokens)
    bf16 = lambda *shape, scale=1.0: (torch.randn(shape, generator=g) * scale).bfloat16()  # noqa: E731
    w8 = torch.randn(4, 16, hidden, generator=g).to(torch.float8_e4m3fn)  # W[E, N, K]
    return (bf16(tokens, hidden), bf16(experts, hidden), bf16(experts, 2 * ffn, hidden, scale=1 / 8),
            bf16(experts, hidden, ffn, scale=1 / 6), torch.randn(6, hidden, generator=g).to(torch.float8_e4m3fn),
            w8.transpose(-2, -1), torch.rand(6, generator=g) + 0.5, torch.rand(4, 16, generator=g) + 0.5,
            torch.tensor([1, 1, 4, 6], dtype=torch.int32),
            torch.randn(experts, 2 * ffn, hidden, generator=g).to(torch.float8_e4m3fn),
            torch.rand(experts, 2 * ffn, generator=g) / 50)


def test_every_op_is_in_a_model():
    names = {op.split("::")[1] for fam in mps_ext.families() for op in mps_ext._C.family_aten_ops(fam)}
    names |= {"fp8_linear", "moe_route", "moe_experts", "moe_combine", "moe_layer",
              "fp8_grouped_linear"}  # mps_ext's own ops
    source = "".join(inspect.getsource(f) for f in (model, mm_out_forms, linalg_model, fp8_model, fp8_in_place,
                                                     fp8_value_ops, fp8_scalars, moe_model))
    assert all(f"torch.ops.mps_ext.{n}(" in source for n in names)


# name -> (model, its inputs for a size, two sizes, calls of mps_ext's kernels
# per family: every family that ran)
MODELS = {
    "nn": (model, inputs, [(3,), (5,)], {"linear": 3, "softmax": 4, "pad": 1}),
    "linalg": (linalg_model, linalg_inputs, [(3, 5), (2, 7)], {"linalg": 11}),
    "fp8": (fp8_model, fp8_inputs, [(3,), (5,)], {"scaled_mm": 3, "fp8": 2}),
    "moe": (moe_model, moe_inputs, [(3,), (5,)], {"moe": 5, "grouped_mm": 4, "linear": 1}),
}


def ran():
    return {fam: s["ran"] for fam, s in mps_ext.stats().items() if s["ran"]}


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("dynamic", [False, True])
def test_aot_eager(dynamic, name):
    fn, make_inputs, sizes, calls = MODELS[name]
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=dynamic)
    for size in sizes:  # a second size: dynamic shapes, or a recompilation
        args = make_inputs(*size)
        want = fn(*args)
        mps_ext.reset_stats()
        got = compiled(*args)
        torch.testing.assert_close(got, want)
        assert ran() == calls


@pytest.mark.parametrize("name", MODELS)
def test_inductor_on_cpu(name):
    fn, make_inputs, sizes, calls = MODELS[name]
    torch._dynamo.reset()
    args = make_inputs(*sizes[0])
    want = fn(*args)
    mps_ext.reset_stats()
    got = torch.compile(fn, backend="inductor", fullgraph=True)(*args)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert ran() == calls


def test_fp8_in_place_ops_trace_with_dynamo():
    torch._dynamo.reset()
    compiled = torch.compile(fp8_in_place, backend="eager", fullgraph=True)
    x, idx = torch.randn(4, 6) * 30, torch.tensor([5, 1])
    want = fp8_in_place(x, torch.empty(4, 6, dtype=torch.float8_e5m2), idx)
    mps_ext.reset_stats()
    got = compiled(x, torch.empty(4, 6, dtype=torch.float8_e5m2), idx)
    assert torch.equal(got, want)
    assert mps_ext.stats()["fp8"]["ran"] == 5


@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_value_ops_run_compiled(fmt):
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    x8, y8 = ((torch.randn(4, 6, generator=g) * 3).to(fmt) for _ in range(2))
    mask, idx = torch.rand(4, 6, generator=g) > 0.5, torch.tensor([5, 1])
    want = fp8_value_ops(x8, y8, mask, idx)
    mps_ext.reset_stats()
    got = torch.compile(fp8_value_ops, backend="eager")(x8, y8, mask, idx)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert mps_ext.stats()["fp8"]["ran"] == 22


def test_mm_out_forms_trace_with_dynamo():
    torch._dynamo.reset()
    compiled = torch.compile(mm_out_forms, backend="eager", fullgraph=True)
    x, w, b, _ = inputs()
    want = mm_out_forms(x, w, b)
    mps_ext.reset_stats()
    torch.testing.assert_close(compiled(x, w, b), want)
    assert ran() == {"linear": 2}


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(64, 256), nn.Linear(256, 64)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


@pytest.mark.parametrize("granularity", ["tensor", "row", "block"])
@mps_ext_executor.request()  # traced inside request(): the kernels' path, as on MPS
def test_quantized_model_aot_eager(granularity):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = mps_ext.quantize_fp8(TwoLayers().bfloat16(), granularity=granularity)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=True)
    for rows in (1, 4, 40):  # decode and prefill kernels
        x = torch.randn(rows, 64).bfloat16()
        want = model(x)
        mps_ext.reset_stats()
        assert torch.equal(compiled(x), want)
        assert mps_ext.stats()["scaled_mm"]["ran"] == 2
