"""moe_layer's gate/up dispatch with the routing folded in
(moe_gate_up_routed of kernels_metal/grouped_mm.metal): each threadgroup
routes the tokens itself from the router's logits, threadgroup (0, 0)
writes moe_route's outputs for the down product, and the layer is three
dispatches where moe_route made four. Against moe_route then moe_experts
(the path it replaces), bit for bit: the gated rows h, the weights, offs
and both row maps, over dtypes, softmax and sigmoid scoring, ties, NaN
logits, 1 to 8 tokens and the launch geometries of a small and a large
GPU; and the shapes it leaves to moe_route."""

import pytest
import torch

import mps_ext
import mps_ext_executor as cpu_metal
from host_names import host_names

FP8 = torch.float8_e4m3fn
TYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
SMALL_GPU, LARGE_GPU = cpu_metal.GPU(cores=8, family=7), cpu_metal.GPU(cores=80, family=9)


def banks(experts, kind, hidden=64, inter=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16 if kind == "fp8" else kind
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) * hidden ** -0.5).to(dtype)
    down = (torch.randn(experts, hidden, inter, generator=g) * inter ** -0.5).to(dtype)
    if kind != "fp8":
        return gate_up, None, down, None
    q = []
    for w in (gate_up, down):
        s = w.float().abs().amax(-1).clamp(min=1e-12) / 448
        q += [(w.float() / s[..., None]).to(FP8), s]
    return tuple(q)


def logits_for(tokens, experts, dtype, seed=0, ties=False, nan=False):
    g = torch.Generator().manual_seed(seed)
    lg = torch.randn(tokens, experts, generator=g) * 3
    if ties:  # few distinct values: many equal logits, and -0 beside +0
        lg = (lg * 0.7).round()
        lg[0, ::5] = -0.0
    if nan:
        lg[0, experts // 3] = float("nan")
        lg[-1, 1] = float("nan")
        lg[-1, experts - 1] = float("nan")
    return lg.to(dtype)


def same_bits(a, b):
    if a.is_floating_point():
        return torch.equal(a.view(torch.int32 if a.element_size() == 4 else torch.int16),
                           b.view(torch.int32 if b.element_size() == 4 else torch.int16))
    return torch.equal(a, b)


def routed_and_unfused(x, gate_up, gate_up_scale, logits, top_k, renormalize, shared, expert_bias=None,
                       sigmoid=False, scale=1.0, renorm_eps=0.0):
    """(h, weights, offs, slot_of_row, row_of_slot) from the routed gate/up dispatch and from moe_route then
    moe_experts, with the dispatches of the first."""
    xe = x.bfloat16() if gate_up.dtype == FP8 else x
    with cpu_metal.record() as rec:
        got = mps_ext._C._moe_routed_gate_up(xe, gate_up, gate_up_scale, logits, top_k, renormalize, shared,
                                              expert_bias, sigmoid, scale, renorm_eps)
    w, offs, slot_of_row, row_of_slot = torch.ops.mps_ext.moe_route(logits, top_k, renormalize, shared, expert_bias,
                                                                     sigmoid, scale, renorm_eps)
    h = torch.ops.mps_ext.moe_experts(xe, gate_up, gate_up_scale, offs, slot_of_row, top_k + shared, True)
    return got, [h, w, offs, slot_of_row, row_of_slot], rec.dispatches


def assert_same(got, want):
    assert len(got) == 5, "the routed kernel did not take the operands"
    for name, a, b in zip(("h", "weights", "offs", "slot_of_row", "row_of_slot"), got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert same_bits(a, b), (name, a, b)


@pytest.mark.parametrize("gpu", [LARGE_GPU, SMALL_GPU], ids=["80-core", "8-core"])
@pytest.mark.parametrize("tokens", [1, 2, 5, 8])
@pytest.mark.parametrize("kind", [torch.float32, torch.float16, torch.bfloat16, "fp8"], ids=str)
@pytest.mark.parametrize("routing", ["softmax", "softmax-shared-plain", "sigmoid-bias"])
def test_routed_gate_up_is_moe_route_then_moe_experts(kind, tokens, routing, gpu):
    experts, top_k = (32, 4) if routing == "sigmoid-bias" else (48, 6)
    shared = routing == "softmax-shared-plain"
    dtype = torch.bfloat16 if kind == "fp8" else kind
    gate_up, gate_up_scale, _, _ = banks(experts + shared, kind)
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(tokens)).to(dtype)
    logits = logits_for(tokens, experts + shared, dtype, seed=tokens)
    kw = dict(renormalize=routing != "softmax-shared-plain")
    if routing == "sigmoid-bias":
        kw.update(expert_bias=torch.randn(experts, generator=torch.Generator().manual_seed(9)) * 0.3, sigmoid=True,
                  scale=2.5, renorm_eps=1e-6)
    before = cpu_metal.set_gpu(gpu)
    try:
        got, want, dispatches = routed_and_unfused(x, gate_up, gate_up_scale, logits, top_k, shared=shared, **kw)
    finally:
        cpu_metal.set_gpu(before)
    w_t = "bf16_e4m3w" if kind == "fp8" else TYPES[kind]
    assert [d.kernel for d in dispatches] == [f"moe_gate_up_routed_{w_t}_vec"]
    assert_same(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sigmoid", [False, True])
@pytest.mark.parametrize("case", ["ties", "nan"])
def test_ties_and_nan_logits_route_as_moe_route(dtype, sigmoid, case):
    """Equal logits (ties to the lower expert, -0 below +0) and NaN logits
    (ranked first, as torch.topk ranks them; softmax weights NaN)."""
    tokens, experts, top_k = 4, 40, 8
    gate_up, _, _, _ = banks(experts, dtype)
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(5)).to(dtype)
    logits = logits_for(tokens, experts, dtype, seed=7, ties=case == "ties", nan=case == "nan")
    got, want, _ = routed_and_unfused(x, gate_up, None, logits, top_k, True, False, sigmoid=sigmoid)
    assert_same(got, want)
    if case == "ties":  # the data have ties among the chosen: the order they are broken in shows
        ranked = logits.float()[0].sort(descending=True, stable=True).values
        assert (ranked[:top_k + 1].diff() == 0).any()


@pytest.mark.parametrize("tokens", [1, 8])
def test_qwen3_6_and_lfm2_5_routing(tokens):
    """The census models' routers: 256 experts, top-8, softmax,
    renormalised, a shared expert (Qwen3.6-35B-A3B; and not renormalised,
    where the softmax's denominator shows in the weights' bits: a sum in
    another order fails it); 32 experts, top-4, sigmoid scores with a bias
    (LFM2.5), each on a threadgroup of fewer threads than moe_route's 256
    (the softmax sums in moe_route's order)."""
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    gate_up, _, _, _ = banks(257, torch.bfloat16, inter=16)
    for renormalize in (True, False):
        got, want, d = routed_and_unfused(x, gate_up, None, logits_for(tokens, 257, torch.bfloat16), 8, renormalize,
                                          True)
        assert_same(got, want)
        assert d[0].threads_per_threadgroup[0] < 256
    gate_up, _, _, _ = banks(32, torch.bfloat16, inter=16)
    bias = torch.randn(32, generator=torch.Generator().manual_seed(2)) * 0.3
    got, want, _ = routed_and_unfused(x, gate_up, None, logits_for(tokens, 32, torch.bfloat16), 4, True, False, bias,
                                      True, 1.0, 1e-6)
    assert_same(got, want)


def layer_args(tokens, experts, top_k, shared, kind, inter=32, hidden=64):
    dtype = torch.bfloat16 if kind == "fp8" else kind
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    router = (torch.randn(experts + shared, hidden, generator=g) * 0.3).to(dtype)
    gate_up, gate_up_scale, down, down_scale = banks(experts + shared, kind, hidden=hidden, inter=inter)
    return x, router, gate_up, gate_up_scale, down, down_scale


@pytest.mark.parametrize("kind", [torch.float32, torch.float16, torch.bfloat16, "fp8"], ids=str)
def test_the_layer_is_three_dispatches(kind):
    args = layer_args(3, 16, 4, 1, kind)
    with cpu_metal.record() as rec:
        out = torch.ops.mps_ext.moe_layer(*args, 4, True, True)
    w_t = "bf16_e4m3w" if kind == "fp8" else TYPES[kind]
    kernels = [d.kernel for d in rec.dispatches]
    assert len(kernels) == 3 and kernels[1:] == [f"moe_gate_up_routed_{w_t}_vec", f"moe_down_combine_{w_t}_vec"]
    # The bits of the four-dispatch path.
    x, router, gate_up, gate_up_scale, down, down_scale = args
    logits = torch.ops.mps_ext.linear(x, router, None)
    w, offs, slot_of_row, row_of_slot = torch.ops.mps_ext.moe_route(logits, 4, True, True)
    h = torch.ops.mps_ext.moe_experts(x.bfloat16() if kind == "fp8" else x, gate_up, gate_up_scale, offs,
                                      slot_of_row, 5, True)
    y = torch.ops.mps_ext.moe_experts(h, down, down_scale, offs, None, 1, False)
    assert torch.equal(out, torch.ops.mps_ext.moe_combine(y, w, row_of_slot))


@pytest.mark.parametrize("case,why", [
    ("unaligned", "x and gate_up rows of 60 elements: not 16-byte aligned, and the kernel has only _vec"),
    ("experts", "600 experts: past MOE_FUSED_MAX_EXPERTS keys in the tile"),
    ("slots", "16 tokens x 9 slots: past MOE_FUSED_MAX_SLOTS"),
])
def test_shapes_the_routed_kernel_leaves_to_moe_route(case, why):
    tokens, experts, hidden = {"unaligned": (2, 8, 60), "experts": (1, 600, 64), "slots": (16, 8, 64)}[case]
    top_k = 8 if case == "slots" else 2
    args = layer_args(tokens, experts, top_k, 1, torch.bfloat16, inter=8 if case == "experts" else 32, hidden=hidden)
    with cpu_metal.record() as rec:
        out = torch.ops.mps_ext.moe_layer(*args, top_k, True, True)
    kernels = [d.kernel for d in rec.dispatches]
    assert "moe_route_bf16" in kernels and not any(k.startswith("moe_gate_up_routed") for k in kernels), why
    assert len(kernels) == 4, kernels
    x, router, gate_up, _, down, _ = args
    logits = torch.ops.mps_ext.linear(x, router, None) if tokens <= 8 else torch.nn.functional.linear(x, router)
    assert mps_ext._C._moe_routed_gate_up(x, gate_up, None, logits, top_k, True, True, None, False, 1.0, 0.0) == []
    assert out.shape == x.shape


def test_every_routed_kernel_runs():
    """Each [[host_name]] of moe_gate_up_routed is one that
    test_routed_gate_up_is_moe_route_then_moe_experts runs (and checks)."""
    names = {k for k in host_names("grouped_mm") if k.startswith("moe_gate_up_routed_")}
    assert names == {f"moe_gate_up_routed_{t}_vec" for t in ("f32", "f16", "bf16", "bf16_e4m3w")}
