"""torch.ops.mps_ext.add_rms_norm_moe_layer (csrc/ops/moe.cpp): a decoder
layer's residual add and post-attention norm in its MoE router's GEMV
(linear.metal's add_rms_norm_gemv_rows), then the rest of moe_layer with
the sum added in its last dispatch. Its contract is the two ops it
replaces, to the bit: (h, normed) = add_rms_norm(x, residual, weight, eps,
variant), out = moe_layer(normed, ..., residual=h), as mps_ext runs them
(themselves tested against torch and float64: test_norm.py,
test_moe_layer.py); so the oracle here is those two ops, compared with
torch.equal, and the fused path's kernels and dispatch count."""

import pytest
import torch

import mps_ext_executor as cpu_metal
from host_names import host_names
from test_moe_layer import layer, on, randn, residual_for

SHORT = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
KINDS = [torch.float32, torch.float16, torch.bfloat16, "fp8"]
# (rows, outputs per simdgroup) of the variants, as test_rms_norm_linear.py's
RQ = [(1, 1), (2, 1), (1, 2), (2, 2), (4, 2), (8, 2)]
EPS = 1e-6


def norm_weight(n, dtype, variant):
    # Trained weights: around 1 (weight variant) or around 0 (zero-centred).
    g = torch.Generator().manual_seed(n)
    return (torch.randn(n, generator=g) * 0.2 + (1 if variant == "weight" else 0)).to(dtype)


def both(device, x, residual, nw, variant, moe_args, options=()):
    """(fused, unfused): add_rms_norm_moe_layer's (h, normed, out), and
    add_rms_norm then moe_layer(normed, ..., residual=h), on `device`,
    back on the CPU; the dispatches of each (executor)."""
    run = on(device)
    router, gate_up, gate_up_scale, down, down_scale, top_k, *rest = (*moe_args, *options)
    with cpu_metal.record() as fused_rec:
        fused = run("add_rms_norm_moe_layer", x, residual, nw, EPS, variant, router, gate_up, gate_up_scale, down,
                    down_scale, top_k, *rest)
    with cpu_metal.record() as unfused_rec:
        h, normed = run("add_rms_norm", x, residual, nw, EPS, variant)
        # moe_layer's optional arguments up to its residual, defaults where the call gives none
        defaults = [True, False, None, False, 1.0, 0.0]
        rest = list(rest) + defaults[len(rest):]
        out = run("moe_layer", normed, router, gate_up, gate_up_scale, down, down_scale, top_k, *rest, h)
    return fused, (h, normed, out), fused_rec.dispatches, unfused_rec.dispatches


def assert_equal(fused, unfused):
    for got, want, what in zip(fused, unfused, ("h", "normed", "out")):
        assert got.shape == want.shape and got.dtype == want.dtype, what
        assert torch.equal(got, want), (what, (got.double() - want.double()).abs().max())


def case(tokens, experts, top_k, shared, kind, hidden=64, variant="weight"):
    """x (a mixer's output), a residual stream, the norm's weight and
    moe_layer's arguments after its x."""
    x, *moe_args = layer(tokens, experts, top_k, shared, kind, hidden=hidden)
    residual = residual_for(x)
    return x, residual, norm_weight(hidden, x.dtype, variant), (*moe_args, top_k)


@pytest.mark.parametrize("tokens", [1, 3, 8])
@pytest.mark.parametrize("variant,shared", [("weight", 0), ("zero_centred", 1)])
@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_is_add_rms_norm_then_moe_layer(device, kind, variant, shared, tokens):
    """Bit for bit add_rms_norm then moe_layer(residual=h), in three
    dispatches instead of four: the add, the norm and the router's logits
    in the first (the GEMV variant the router would take), then the gate/up
    product with the routing, and the down product with the combine."""
    x, residual, nw, moe_args = case(tokens, 8, 2, shared, kind, variant=variant)
    fused, unfused, fused_d, unfused_d = both(device, x, residual, nw, variant, moe_args, (True, bool(shared)))
    assert_equal(fused, unfused)
    if device == "executor":
        t = SHORT[x.dtype]
        w_t = "bf16_e4m3w" if kind == "fp8" else t
        r = {1: 1, 3: 4, 8: 8}[tokens]
        gemv = f"gemv_rows_{t}_r{r}_q{1 if r <= 2 else 2}_vec"  # (8 experts: two outputs a simdgroup from 3 rows)
        assert [d.kernel for d in fused_d] == [f"add_rms_norm_{gemv}", f"moe_gate_up_routed_{w_t}_vec",
                                               f"moe_down_combine_{w_t}_vec"]
        assert [d.kernel for d in unfused_d][:2] == [f"add_rms_norm_{t}", gemv]
        assert len(unfused_d) == 4


@pytest.mark.parametrize("variant", ["weight", "zero_centred"])
def test_a_decode_row_of_2048(variant):
    """A decode token's hidden state of Qwen3.6 and LFM2.5 (2048, bfloat16):
    rms_norm's team is 256 threads, 8 simdgroups whose sums add in order,
    which the GEMV's simdgroups run one after another; every threadgroup
    adds and norms the row, threadgroup 0 writes h and normed once."""
    x, residual, nw, moe_args = case(1, 8, 2, 1, torch.bfloat16, hidden=2048, variant=variant)
    fused, unfused, fused_d, _ = both("executor", x, residual, nw, variant, moe_args, (True, True))
    assert_equal(fused, unfused)
    d = fused_d[0]
    assert d.kernel == "add_rms_norm_gemv_rows_bf16_r1_q1_vec"
    assert d.bytes_written[d.buffer("sum_out")] == d.bytes_written[d.buffer("normed_out")] == x.nbytes


@pytest.mark.parametrize("vec", [True, False], ids=["vec", "scalar"])
@pytest.mark.parametrize("r,q", RQ)
@pytest.mark.parametrize("dtype", list(SHORT), ids=str)
def test_every_variant(dtype, r, q, vec):
    """Every add_rms_norm_gemv_rows variant, each bit for bit the two ops:
    3 and 7 rows take the 4- and 8-row variants; a router of 128 experts on
    an 8-core GPU takes two outputs a simdgroup at 1 and 2 rows
    (decode_geometry: Qwen3-30B's router on the smallest Macs), 8 experts
    one; a router whose rows start one element off 16 bytes, element
    loads."""
    rows = {1: 1, 2: 2, 4: 3, 8: 7}[r]
    experts = 128 if q == 2 else 8
    x, residual, nw, (router, *rest) = case(rows, experts, 2, 0, dtype)
    if not vec:
        base = torch.empty(router.numel() + 1, dtype=dtype)
        router = base[1:].view(router.shape).copy_(router)
    before = cpu_metal.set_gpu(cpu_metal.GPU(cores=8) if q == 2 and r <= 2 else cpu_metal.GPU(cores=80))
    try:
        fused, unfused, fused_d, _ = both("executor", x, residual, nw, "weight", (router, *rest))
    finally:
        cpu_metal.set_gpu(before)
    assert_equal(fused, unfused)
    assert fused_d[0].kernel == f"add_rms_norm_gemv_rows_{SHORT[dtype]}_r{r}_q{q}_{'vec' if vec else 'scalar'}"


def test_every_kernel_is_tested():
    # test_every_variant runs each of these.
    fused = {k for k in host_names("linear") if k.startswith("add_rms_norm_gemv_rows_")}
    assert fused == {f"add_rms_norm_gemv_rows_{t}_r{r}_q{q}_{v}" for t in SHORT.values() for r, q in RQ
                     for v in ("vec", "scalar")}


@pytest.mark.parametrize("bias", [False, True])
def test_sigmoid_scoring(device, bias):
    """LFM2-MoE's router (sigmoid scores, an expert bias, renormalised with
    an eps, scaled) behind the fused norm: the two ops' bits."""
    x, residual, nw, moe_args = case(4, 16, 4, 0, torch.float32)
    expert_bias = randn(16, scale=0.3) if bias else None
    fused, unfused, _, _ = both(device, x, residual, nw, "weight", moe_args,
                                (True, False, expert_bias, True, 2.5, 1e-6))
    assert_equal(fused, unfused)


def test_fp8_banks_under_float32_activations(device):
    """fp8 banks under float32 x: the kernels take bfloat16 activations and
    give a bfloat16 output, converted to float32, to which torch adds h, as
    moe_layer does."""
    x, residual, nw, (router, gate_up, gate_up_scale, down, down_scale, top_k) = case(2, 8, 2, 1, "fp8")
    x, residual, nw, router = x.float(), residual.float(), nw.float(), router.float()
    fused, unfused, _, _ = both(device, x, residual, nw, "weight",
                                (router, gate_up, gate_up_scale, down, down_scale, top_k), (True, True))
    assert fused[2].dtype == torch.float32
    assert_equal(fused, unfused)


def test_calls_the_kernel_does_not_take_are_the_two_ops():
    """More than 8 rows, normed rows past the kernel's threadgroup memory
    (2 rows of 2048 float32), and a router not contiguous along the hidden
    size: add_rms_norm, then moe_layer, the same dispatches and bits."""
    x9, r9, nw9, args9 = case(9, 8, 2, 0, torch.bfloat16)
    xw, rw, nww, argsw = case(2, 8, 2, 0, torch.float32, hidden=2048)
    xt, rt, nwt, (router, *rest) = case(2, 8, 2, 0, torch.float16)
    router_t = router.t().contiguous().t()  # [E, H] with stride (1, E)
    for x, residual, nw, moe_args in ((x9, r9, nw9, args9), (xw, rw, nww, argsw), (xt, rt, nwt, (router_t, *rest))):
        fused, unfused, fused_d, unfused_d = both("executor", x, residual, nw, "weight", moe_args)
        assert_equal(fused, unfused)
        assert [d.kernel for d in fused_d] == [d.kernel for d in unfused_d]
        assert fused_d[0].kernel.startswith("add_rms_norm_") and not fused_d[0].kernel.startswith("add_rms_norm_gemv")


def test_no_tokens():
    x, residual, nw, moe_args = case(1, 8, 2, 0, torch.float32)
    h, normed, out = torch.ops.mps_ext.add_rms_norm_moe_layer(x[:0], residual[:0], nw, EPS, "weight", *moe_args)
    assert h.shape == normed.shape == out.shape == (0, 64)


@pytest.mark.parametrize("change,message", [
    (dict(norm_weight=torch.ones(63)), "mps_ext add_rms_norm_moe_layer: weight must be 1-D of x's last dimension"),
    (dict(variant="gemma"), "mps_ext add_rms_norm_moe_layer: variant must be 'weight'"),
    (dict(residual=torch.ones(2, 32)), r"mps_ext add_rms_norm_moe_layer: residual must have x's shape \[2, 64\]"),
    (dict(residual=torch.ones(2, 64, dtype=torch.bfloat16)), "residual must have x's shape .* and dtype Float"),
    (dict(router=torch.ones(8, 64, dtype=torch.bfloat16)), "add_rms_norm_moe_layer: router must be .* in x's dtype"),
    (dict(x=torch.ones(1, 2, 64), residual=torch.ones(1, 2, 64)),
     r"add_rms_norm_moe_layer: x \[tokens, hidden\] expected"),
    (dict(top_k=9), r"moe_route: top_k must be in \[1, 8\]"),
])
def test_bad_input(change, message):
    x, residual, nw, (router, gate_up, _, down, _, top_k) = case(2, 8, 2, 0, torch.float32)
    args = dict(x=x, residual=residual, norm_weight=nw, eps=EPS, variant="weight", router=router, gate_up=gate_up,
                gate_up_scale=None, down=down, down_scale=None, top_k=top_k)
    args.update(change)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.mps_ext.add_rms_norm_moe_layer(**args)


@pytest.mark.parametrize("kind", [torch.bfloat16, "fp8"], ids=str)
def test_fake_kernel_for_torch_compile(kind):
    x, residual, nw, moe_args = case(3, 8, 2, 1, kind)
    # test_schema compares outputs with torch ops that have no float8 CPU kernel.
    checks = ("test_faketensor",) if kind == "fp8" else ("test_schema", "test_faketensor")
    torch.library.opcheck(torch.ops.mps_ext.add_rms_norm_moe_layer.default,
                          (x, residual, nw, EPS, "zero_centred", *moe_args, True, True), test_utils=checks)
