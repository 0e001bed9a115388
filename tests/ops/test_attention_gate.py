"""torch.ops.mps_ext.sigmoid_gate, the attention layer's output gate
(csrc/ops/attention_gate.cpp, kernels_metal/attention_gate.metal) on the
executor: against torch's CPU ops (`x * torch.sigmoid(gate)`, the models'
line) and float64, reading the gate where q_proj's output holds it; one
dispatch, every byte moved once, coalesced; clear errors."""

import pytest
import torch

import mps_ext
from host_names import host_names
import mps_ext_executor as cpu_metal
from rounding import sigmoid_reach

# The oracle is `x * torch.sigmoid(gate)` on torch's CPU ops (float32's changes
# with ATEN_CPU_CAPABILITY); scripts/test.sh runs this file again with torch's
# CPU kernels capped.
pytestmark = pytest.mark.torch_cpu_oracle

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
KERNEL_TYPE = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
DEVICES = ["executor"] + ([pytest.param("mps", marks=pytest.mark.mac)] if mps_ext.is_available() else [])


def on(device, *ts):
    return [t.to("mps") for t in ts] if device == "mps" else list(ts)


def q_proj_output(b, t, heads, d, dtype, seed=0):
    """A gated q_proj's output [b, t, heads * 2d] (each head's query, then
    its gate) and the model's gate view [b, t, heads, d] of it (strided)."""
    g = torch.Generator().manual_seed(seed)
    out = (torch.randn(b, t, heads * 2 * d, generator=g) * 4).to(dtype)
    _, gate = torch.chunk(out.view(b, t, heads, 2 * d), 2, dim=-1)
    return out, gate


# A decode token of Qwen3.6 (16 heads of 256), the tiny model's (4 of 16),
# a prefill of 5 tokens and 2 sequences, one element a row.
GATE_SHAPES = [(1, 1, 16, 256), (1, 1, 4, 16), (2, 5, 3, 40), (1, 2, 3, 1)]


U = {torch.float32: 2.0 ** -24}  # float32's unit roundoff: a rounding's relative error at most


def t_neighbours(v, dtype):
    """The two values of `dtype` around each (positive, finite) float64 in v:
    the one below or equal, and the one above or equal."""
    bits = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}[dtype]
    near = v.to(dtype)
    step = torch.where(near.double() > v, -1, torch.where(near.double() < v, 1, 0))
    other = (near.view(bits) + step.to(bits)).view(dtype)
    return torch.minimum(near, other), torch.maximum(near, other)


def flushed(x, gate):
    """Where the sigmoid or the product is below float32's smallest normal,
    which Apple GPUs flush to 0 (MSL 4, section 8.1), as the executor does;
    torch's CPU ops keep them."""
    sig = torch.sigmoid(gate.double())
    return (sig < 2.0 ** -126) | ((x.double() * sig).abs() < 2.0 ** -126)


def assert_gate_claim(got, x, gate):
    """What sigmoid_gate promises where Metal's precise exp is within 4 ulp
    (MSL 4, Table 8.1), not torch's 1:
    - float16 / bfloat16: out = T(x * s), s the dtype's value just below or
      just above the exact sigmoid (within 1 ulp of the dtype: torch's
      rounded sigmoid or its neighbour), the product of two T exact in
      float32 and rounded once: torch's bits unless the two float32
      sigmoids round to different T. A sigmoid or product below float32's
      smallest normal may be 0 (flushed, as on Apple GPUs).
    - float32: within (8 (1 - s) + 3) float32 roundoffs (2^-24) of x times
      the exact sigmoid s: the exp's 4 ulp (8 roundoffs) count as much as
      exp(-g) is of 1 + exp(-g), which is 1 - s; the add, the division and
      the product one each."""
    dtype = got.dtype
    sig = torch.sigmoid(gate.double())
    if dtype == torch.float32:
        want = x.double() * sig
        bound = (8 * (1 - sig) + 3.01) * U[dtype] * want.abs()
        assert bool(((got.double() - want).abs() <= bound).all()), float(((got.double() - want).abs() / bound).max())
        return
    below, above = t_neighbours(sig, dtype)
    candidates = [(x.float() * s.float()).to(dtype) for s in (below, above)]
    same = lambda a, b: (a == b) | (a.isnan() & b.isnan())  # noqa: E731
    ok = same(got, candidates[0]) | same(got, candidates[1]) | (flushed(x, gate) & (got == 0))
    assert bool(ok.all()), (got[~ok][:4], x[~ok][:4], gate[~ok][:4])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", GATE_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sigmoid_gate_is_the_models_line(device, dtype, shape):
    """The models' `attn_output * torch.sigmoid(gate)` as assert_gate_claim
    states it (float16 and bfloat16: torch's rounding of the sigmoid and the
    product, the sigmoid within an ulp of the dtype; float32: within its
    bound of float64); one dispatch of the dtype's kernel reading the gate
    in place."""
    b, t, h, d = shape
    _, gate = q_proj_output(b, t, h, d, dtype)
    x = (torch.randn(b, t, h * d, generator=torch.Generator().manual_seed(1)) * 2).to(dtype)
    xs, gs = on(device, x.view(b, t, h, d), gate)
    with cpu_metal.record(counters=True) as rec:
        got = torch.ops.mps_ext.sigmoid_gate(xs, gs).cpu().view(b, t, -1)
    assert got.dtype == dtype and got.shape == (b, t, h * d)
    assert_gate_claim(got, x, gate.reshape(b, t, -1))
    if device == "executor":
        (disp,) = rec.dispatches
        assert disp.kernel == "sigmoid_gate_" + KERNEL_TYPE[dtype]
        # x read once, the gate's elements once (not the queries between them), out written once
        assert (disp.bytes_read[1], disp.bytes_read[2]) == (x.nbytes, x.nbytes)
        assert disp.bytes_written == {0: x.nbytes}


# A GPU whose exp is off by this many times Metal's bound moves sigmoids by
# a few ulps of the dtype (float16: 2^13 float32 ulps an ulp, bfloat16 2^16).
PLANTED = {torch.float32: 2, torch.float16: 2 ** 12, torch.bfloat16: 2 ** 15}


def every_value(dtype):
    """Every finite value of a 16-bit dtype."""
    v = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    return v[torch.isfinite(v)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sigmoid_gate_claim_holds_at_metals_exp_bound(dtype):
    """assert_gate_claim with exp as far off as the specification allows
    (MathMode(perturb=1)); an exp worse than Metal's (PLANTED) breaks it.
    float16 and bfloat16 over every gate value of the dtype: the sigmoid
    rounds to torch's value of the dtype except at the gates where an exp
    within 4 ulp can move it across a rounding boundary (rounding.
    sigmoid_reach: 28 of the 63488 finite float16 values, 3 of bfloat16's
    65280, all near 0), so the output has torch's bits at every other gate;
    at those the bound does change bits (float16, where the executor's
    directions happen to go that way)."""
    g = torch.Generator().manual_seed(4)
    gate = (torch.randn(2 ** 17, generator=g) * 4).to(dtype) if dtype == torch.float32 else every_value(dtype)
    x = (torch.randn(gate.shape, generator=g) * 2).to(dtype)
    with cpu_metal.math_mode(perturb=1):
        got = torch.ops.mps_ext.sigmoid_gate(x, gate)
    assert_gate_claim(got, x, gate)
    if dtype != torch.float32:
        lo, hi = sigmoid_reach(gate, dtype)
        movable = lo != hi
        want = x * torch.sigmoid(gate)
        same = (got == want) | (got.isnan() & want.isnan())
        assert bool(same[~movable & ~flushed(x, gate)].all())
        assert int(movable.sum()) == {torch.float16: 28, torch.bfloat16: 3}[dtype]
        if dtype == torch.float16:
            assert not bool(same[movable].all())
    with cpu_metal.math_mode(perturb=PLANTED[dtype]):
        worse = torch.ops.mps_ext.sigmoid_gate(x, gate)
    with pytest.raises(AssertionError):
        assert_gate_claim(worse, x, gate)


def test_sigmoid_gate_layouts_and_edges():
    """A gate whose rows do not collapse into one stride (copied first), a
    contiguous one, extreme values (sigmoid 0 and 1, inf, nan) and an empty
    tensor: torch's results (extremes: bit for bit)."""
    dt = torch.bfloat16
    _, gate = q_proj_output(2, 3, 4, 8, dt)
    x = torch.randn(2, 3, 4, 8).to(dt)
    for g, xx in ((gate.transpose(0, 1), x.transpose(0, 1)), (gate.contiguous(), x)):
        assert_gate_claim(torch.ops.mps_ext.sigmoid_gate(xx, g), xx, g)
    g = torch.tensor([[-200.0, 200.0, float("inf"), -float("inf"), float("nan"), 0.0]]).to(dt)
    xx = torch.tensor([[1.0, 1.0, -2.0, 3.0, 1.0, float("inf")]]).to(dt)
    torch.testing.assert_close(torch.ops.mps_ext.sigmoid_gate(xx, g), xx * torch.sigmoid(g), rtol=0, atol=0,
                               equal_nan=True)
    empty = torch.ops.mps_ext.sigmoid_gate(torch.empty(0, 8, dtype=dt), torch.empty(0, 8, dtype=dt))
    assert empty.shape == (0, 8)


def test_sigmoid_gate_errors():
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match=r"sigmoid_gate: x and gate must have one shape \(no broadcasting\)"):
        torch.ops.mps_ext.sigmoid_gate(x, torch.randn(1, 8))
    with pytest.raises(RuntimeError, match=r"sigmoid_gate: gate must be in x's dtype \(Float\), got BFloat16"):
        torch.ops.mps_ext.sigmoid_gate(x, torch.randn(2, 8).bfloat16())
    with pytest.raises(RuntimeError, match="sigmoid_gate: x must be float32, float16 or bfloat16, got Long"):
        torch.ops.mps_ext.sigmoid_gate(x.long(), x.long())
    with pytest.raises(RuntimeError, match="must have a last dimension"):
        torch.ops.mps_ext.sigmoid_gate(torch.tensor(1.0), torch.tensor(1.0))


def test_every_kernel_is_tested():
    # test_sigmoid_gate_is_the_models_line runs each dtype's kernel.
    assert host_names("attention_gate") == {f"sigmoid_gate_{t}" for t in ("f32", "f16", "bf16")}


def test_meta_kernel_and_compile():
    """The fake kernel gives x's shape and dtype; compiled (aot_eager traces
    it on fake tensors), the eager result."""
    out = torch.ops.mps_ext.sigmoid_gate(torch.empty(2, 3, 8, device="meta"), torch.empty(2, 3, 8, device="meta"))
    assert out.shape == (2, 3, 8) and out.device.type == "meta"
    _, gate = q_proj_output(1, 2, 3, 16, torch.float32)
    x = torch.randn(1, 2, 3, 16)
    got = torch.compile(torch.ops.mps_ext.sigmoid_gate, fullgraph=True, backend="aot_eager")(x, gate)
    assert torch.equal(got, torch.ops.mps_ext.sigmoid_gate(x, gate))
    with pytest.raises(RuntimeError, match="must have a last dimension"):
        torch.ops.mps_ext.sigmoid_gate(torch.tensor(1.0), torch.tensor(1.0))
