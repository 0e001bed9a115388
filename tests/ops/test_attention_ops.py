"""torch.ops.mps_ext.sigmoid_gate and torch.ops.mps_ext.kv_append
(csrc/ops/attention.cpp, kernels_metal/attention.metal) on the executor:
the output gate against torch's CPU ops (`x * torch.sigmoid(gate)`, the
models' line) and float64, reading the gate where q_proj's output holds
it; the cache append against torch's copy into the same rows; one
dispatch each, every byte moved once, coalesced; clear errors."""

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


# ------------------------------------------------------------------ kv_append --
def new_rows(b, h, t, d, dtype, seed):
    """k as qk_norm_rope gives it ([b, h, t, d] contiguous) and v as the
    models' v_proj(...).view(b, t, h, d).transpose(1, 2) (strided)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(b, h, t, d, generator=g).to(dtype)
    v = torch.randn(b, t, h, d, generator=g).to(dtype).transpose(1, 2)
    return k, v


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("b,h,t,d,start", [(1, 2, 1, 256, 7), (2, 3, 5, 16, 0), (1, 4, 1, 300, 12)],
                         ids=["decode-256", "prefill", "long-row"])
def test_kv_append_writes_the_rows_in_place(device, dtype, b, h, t, d, start):
    """The new rows land at start .. start + t - 1 of each head, bit for
    bit, and nothing else of the caches changes; one dispatch writing only
    the new rows (k and v once each), coalesced."""
    cap = 16
    g = torch.Generator().manual_seed(3)
    k_cache, v_cache = (torch.randn(b, h, cap, d, generator=g).to(dtype) for _ in range(2))
    k, v = new_rows(b, h, t, d, dtype, seed=4)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want_k[:, :, start:start + t] = k
    want_v[:, :, start:start + t] = v
    kc, vc, kk, vv = on(device, k_cache, v_cache, k, v)
    with cpu_metal.record(counters=True) as rec:
        torch.ops.mps_ext.kv_append(kc, vc, kk, vv, start)
    assert torch.equal(kc.cpu(), want_k) and torch.equal(vc.cpu(), want_v)
    if device == "executor":
        (disp,) = rec.dispatches
        assert disp.kernel == "kv_append_" + KERNEL_TYPE[dtype]
        assert disp.bytes_written == {0: k.nbytes, 1: v.nbytes}
        assert (disp.bytes_read[2], disp.bytes_read[3]) == (k.nbytes, v.nbytes)
        if d * k.element_size() % 128 == 0:  # rows whole 128-byte lines (else a simdgroup's row straddles one more)
            assert max(disp.coalescing.values()) <= 1.1, disp.coalescing


def test_kv_append_errors():
    kc, vc = torch.zeros(1, 2, 8, 16), torch.zeros(1, 2, 8, 16)
    k = torch.randn(1, 2, 1, 16)
    with pytest.raises(RuntimeError, match="kv_append: rows 8 to 9 do not fit a cache of capacity 8"):
        torch.ops.mps_ext.kv_append(kc, vc, k, k, 8)
    with pytest.raises(RuntimeError, match="kv_append: rows -1 to 0 do not fit"):
        torch.ops.mps_ext.kv_append(kc, vc, k, k, -1)
    with pytest.raises(RuntimeError, match=r"kv_append: k and v must be \[1, 2, tokens, 16\]"):
        torch.ops.mps_ext.kv_append(kc, vc, torch.randn(1, 3, 1, 16), torch.randn(1, 3, 1, 16), 0)
    with pytest.raises(RuntimeError, match="kv_append: the caches and the new rows must have one dtype"):
        torch.ops.mps_ext.kv_append(kc, vc, k.half(), k.half(), 0)
    with pytest.raises(RuntimeError, match=r"kv_append: k_cache and v_cache must be contiguous .* \(not contiguous\)"):
        torch.ops.mps_ext.kv_append(kc.transpose(2, 3), vc.transpose(2, 3), k, k, 0)
    with pytest.raises(RuntimeError, match="kv_append: k_cache must be float32, float16 or bfloat16"):
        torch.ops.mps_ext.kv_append(kc.long(), vc.long(), k.long(), k.long(), 0)


def test_every_kernel_is_tested():
    # test_sigmoid_gate_is_the_models_line and test_kv_append_writes_the_rows_in_place run each dtype's kernels.
    assert host_names("attention") == {f"{op}_{t}" for op in ("sigmoid_gate", "kv_append")
                                       for t in ("f32", "f16", "bf16")}


def test_meta_kernels_and_compile():
    """The fake kernels: sigmoid_gate gives x's shape and dtype, kv_append
    nothing (in place); compiled whole (aot_eager traces them on fake
    tensors, kv_append functionalised), the eager results."""
    out = torch.ops.mps_ext.sigmoid_gate(torch.empty(2, 3, 8, device="meta"), torch.empty(2, 3, 8, device="meta"))
    assert out.shape == (2, 3, 8) and out.device.type == "meta"
    assert torch.ops.mps_ext.kv_append(*(torch.empty(1, 2, 4, 16, device="meta") for _ in range(2)),
                                       *(torch.empty(1, 2, 1, 16, device="meta") for _ in range(2)), 3) is None
    _, gate = q_proj_output(1, 2, 3, 16, torch.float32)
    x = torch.randn(1, 2, 3, 16)
    k, v = new_rows(1, 2, 1, 16, torch.float32, seed=5)

    def step(x, gate, k_cache, v_cache, k, v):
        torch.ops.mps_ext.kv_append(k_cache, v_cache, k, v, 2)
        return torch.ops.mps_ext.sigmoid_gate(x, gate)

    caches = [torch.zeros(1, 2, 4, 16) for _ in range(4)]
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(x, gate, caches[0], caches[1], k, v)
    want = step(x, gate, caches[2], caches[3], k, v)
    assert torch.equal(got, want) and torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[0][:, :, 2:3].equal(k)
