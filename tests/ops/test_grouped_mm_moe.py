"""mps_ext's fused MoE decode ops (moe_route, moe_experts, moe_combine)
against a float64 layer written with torch's own ops (softmax, topk, per
expert matmuls), and the traffic of a whole layer."""

import pytest
import torch
import torch.nn.functional as F

import mps_ext
from mps_ext import cpu_metal

gen = torch.Generator().manual_seed(2)
FP8 = torch.float8_e4m3fn


def randn(*shape, scale=1.0, dtype=torch.bfloat16):
    return (torch.randn(shape, generator=gen) * scale).to(dtype)


def ops(device):
    """The ops, run on `device` ('executor': CPU tensors; 'mps': the GPU)."""
    if device == "executor":
        return lambda name, *a: getattr(torch.ops.mps_ext, name)(*a)
    to = lambda v: v.to("mps") if isinstance(v, torch.Tensor) else v  # noqa: E731
    back = lambda v: tuple(t.cpu() for t in v) if isinstance(v, tuple) else v.cpu()  # noqa: E731
    return lambda name, *a: back(getattr(torch.ops.mps_ext, name)(*map(to, a)))


def routing_ref(logits, top_k, renormalize, shared):
    lf = logits.double()
    experts = lf.shape[1] - shared
    probs = torch.softmax(lf[:, :experts], -1)
    w, ids = torch.topk(probs, top_k, -1)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    if shared:
        ids = torch.cat([ids, torch.full((len(ids), 1), experts)], 1)
        w = torch.cat([w, torch.sigmoid(lf[:, experts:])], 1)
    return w, ids


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 256, 8), (8, 128, 8), (3, 32, 4), (5, 7, 7), (1, 1000, 2)])
@pytest.mark.parametrize("renormalize,shared", [(True, False), (False, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_matches_softmax_topk_and_sorts_slots_by_expert(device, tokens, experts, top_k, renormalize, shared,
                                                              dtype):
    logits = randn(tokens, experts + shared, scale=3, dtype=dtype)
    w, offs, slot_of_row, row_of_slot = ops(device)("moe_route", logits, top_k, renormalize, bool(shared))
    w_ref, ids_ref = routing_ref(logits, top_k, renormalize, shared)
    slots = top_k + shared
    # Each slot's expert, as the kernel sorted them: rows [offs[e-1], offs[e]) are expert e's.
    assert offs[-1] == tokens * slots and bool((offs[1:] >= offs[:-1]).all())
    ids = torch.repeat_interleave(torch.arange(len(offs)), torch.diff(offs.long(), prepend=torch.zeros(1).long()))
    ids = torch.empty_like(ids).index_copy_(0, slot_of_row.long(), ids).view(tokens, slots)
    # The same experts as torch.topk (up to the order of equal logits), with the same weights.
    lg = logits.double()
    torch.testing.assert_close(lg.gather(1, ids[:, :top_k]).sort(1).values, lg.gather(1, ids_ref[:, :top_k]).sort(1).values)
    torch.testing.assert_close(w.double(), w_ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(ids[:, top_k:], ids_ref[:, top_k:])  # the shared expert
    assert all(len(set(row)) == slots for row in ids.tolist())  # distinct experts per token
    # Slots sorted by expert, stably; the two maps are inverses.
    assert torch.equal(slot_of_row.long(), torch.argsort(ids.flatten(), stable=True))
    assert torch.equal(row_of_slot[slot_of_row.long()], torch.arange(tokens * slots, dtype=torch.int32))


def moe_layer_ref(x, router, w_gate_up, w_down, top_k, shared, gate_up_scale=None, down_scale=None):
    """float64 reference of the layer; h is rounded to bfloat16 as the fused op stores it."""
    def dequant(w, s):
        return w.double() if s is None else w.double() * s.double()[..., None]
    logits = (x.double() @ router.double().t()).to(x.dtype)
    w, ids = routing_ref(logits, top_k, True, shared)
    inter = w_gate_up.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            g, u = (dequant(w_gate_up[e], None if gate_up_scale is None else gate_up_scale[e]) @ x[t].double()).split(inter)
            h = (F.silu(g) * u).to(x.dtype).double()
            out[t] += float(w[t, j]) * (dequant(w_down[e], None if down_scale is None else down_scale[e]) @ h)
    return out


def quantize_rows(w):
    scale = w.float().abs().amax(-1).clamp(min=1e-12) / 448
    return (w.float() / scale[..., None]).to(FP8), scale


def moe_layer(run, x, router, w_gate_up, w_down, top_k, shared, s_gu=None, s_d=None):
    slots = top_k + shared
    logits = run("linear", x, router, None)
    w, offs, slot_of_row, row_of_slot = run("moe_route", logits, top_k, True, bool(shared))
    h = run("moe_experts", x, w_gate_up, s_gu, offs, slot_of_row, slots, True)
    y = run("moe_experts", h, w_down, s_d, offs, None, 1, False)
    return run("moe_combine", y, w, row_of_slot)


@pytest.mark.parametrize("tokens,top_k", [(1, 4), (2, 4), (8, 4), (8, 8)])  # 8 x (8 + 1) = 72 rows
@pytest.mark.parametrize("weights", ["bf16", "fp8"])
def test_layer_matches_reference_and_streams_each_chosen_expert_once(device, tokens, top_k, weights):
    hidden, experts, inter, shared = 128, 32, 48, 1
    x = randn(tokens, hidden)
    router = randn(experts + shared, hidden, scale=0.3)
    w_gate_up = randn(experts + shared, 2 * inter, hidden, scale=hidden ** -0.5)
    w_down = randn(experts + shared, hidden, inter, scale=inter ** -0.5)
    s_gu = s_d = None
    if weights == "fp8":
        (w_gate_up, s_gu), (w_down, s_d) = quantize_rows(w_gate_up), quantize_rows(w_down)
    run = ops(device)
    with cpu_metal.record() as rec:
        out = moe_layer(run, x, router, w_gate_up, w_down, top_k, shared, s_gu, s_d)
    ref = moe_layer_ref(x, router, w_gate_up, w_down, top_k, shared, s_gu, s_d)
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
    if device == "executor":
        kernels = [d.kernel for d in rec.dispatches]
        wtype = "bf16_fp8w" if weights == "fp8" else "bf16"
        # The router's GEMV (mps_ext's linear, unless torch's own takes one row), then four dispatches.
        assert kernels[-4:] == ["moe_route_bf16", f"gmm_decode_rows_{wtype}_vec", f"gmm_decode_rows_{wtype}_vec",
                                "moe_combine_bf16"]
        ids = routing_ref((x.double() @ router.double().t()).to(x.dtype), top_k, True, shared)[1]
        chosen = len(set(ids.flatten().tolist()))
        item = 1 if weights == "fp8" else 2
        gate_up, down = rec.dispatches[-3], rec.dispatches[-2]
        # The shared expert has 8 rows at 8 tokens: still one chunk, read once.
        assert gate_up.bytes_read[2] == chosen * 2 * inter * hidden * item
        assert down.bytes_read[2] == chosen * hidden * inter * item


def test_experts_checks():
    x, w = randn(2, 32), randn(4, 16, 32)
    offs = torch.tensor([1, 1, 2, 2], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="at most 1024 routed rows"):
        torch.ops.mps_ext.moe_experts(randn(1025, 32), w, None, torch.tensor([1025] * 4, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="fp8 weights need weight_scale"):
        torch.ops.mps_ext.moe_experts(x, w.float().to(FP8), None, offs)
    with pytest.raises(RuntimeError, match="weight must have x's dtype"):
        torch.ops.mps_ext.moe_experts(x.float(), w, None, offs)
    with pytest.raises(RuntimeError, match="swiglu needs weight rows"):
        torch.ops.mps_ext.moe_experts(x, randn(4, 15, 32), None, offs, None, 1, True)
    with pytest.raises(RuntimeError, match="moe_route is for decode"):
        torch.ops.mps_ext.moe_route(randn(200, 16), 8, True, False)


def test_counts_as_grouped_mm_runs():
    mps_ext.reset_stats()
    torch.ops.mps_ext.moe_route(randn(1, 8), 2, True, False)
    assert mps_ext.stats()["grouped_mm"]["ran"] == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_combine_sums_each_tokens_slots_with_their_weights(device, dtype):
    tokens, slots, hidden = 3, 5, 37  # hidden not a multiple of a thread's 8 outputs
    y = randn(tokens * slots + 2, hidden, dtype=dtype)  # two rows no slot uses
    weights = torch.rand(tokens, slots, generator=gen)
    row_of_slot = torch.randperm(tokens * slots + 2, generator=gen)[:tokens * slots].int()
    got = ops(device)("moe_combine", y, weights, row_of_slot)
    exp = (weights.double()[..., None] * y.double()[row_of_slot.long()].view(tokens, slots, hidden)).sum(1)
    torch.testing.assert_close(got.double(), exp, rtol=4e-3, atol=4e-3)
    assert got.dtype == dtype


def test_route_of_half_logits(device):
    logits = randn(2, 40, dtype=torch.float16)
    w, offs, _, _ = ops(device)("moe_route", logits, 3, False, False)
    w_ref, _ = routing_ref(logits, 3, False, 0)
    torch.testing.assert_close(w.double(), w_ref, rtol=1e-5, atol=1e-6)
    assert int(offs[-1]) == 6


@pytest.mark.parametrize("fp8", [False, True])
def test_experts_with_unaligned_activations_take_element_loads(device, fp8):
    # x one element off 16-byte alignment: element loads, same result.
    store = randn(3 * 64 + 1)
    x = store[1:].view(3, 64)
    w = randn(4, 16, 64, scale=0.125)
    scale = None
    if fp8:
        w, scale = quantize_rows(w)
    offs = torch.tensor([1, 1, 3, 3], dtype=torch.int32)
    with cpu_metal.record() as rec:
        got = ops(device)("moe_experts", x, w, scale, offs, None, 1, False)
    wd = w.double() * (scale.double()[..., None] if fp8 else 1)
    exp = torch.cat([x[:1].double() @ wd[0].t(), x[1:].double() @ wd[2].t()])
    torch.testing.assert_close(got.double(), exp, rtol=1e-2, atol=1e-2)
    if device == "executor":
        assert rec.dispatches[0].kernel == ("gmm_decode_rows_bf16_fp8w_scalar" if fp8 else "gmm_decode_rows_bf16_scalar")


def test_a_layer_launches_the_same_whatever_the_routing_and_reads_nothing_on_the_host():
    from test_grouped_mm import _GuardedOffsets, guarded
    hidden, experts, inter, top_k = 64, 16, 32, 4
    x = randn(4, hidden)
    w_gate_up = randn(experts, 2 * inter, hidden)
    w_down = randn(experts, hidden, inter)
    launches = set()
    for seed in range(3):
        router = torch.randn(experts, hidden, generator=torch.Generator().manual_seed(seed)).bfloat16()
        with cpu_metal.record() as rec:
            logits = torch.ops.mps_ext.linear(x, router, None)
            w, offs, slot_of_row, row_of_slot = torch.ops.mps_ext.moe_route(logits, top_k, True, False)
            _GuardedOffsets.touched.clear()
            h = torch.ops.mps_ext.moe_experts(x, w_gate_up, None, guarded(offs), slot_of_row, top_k, True)
            assert _GuardedOffsets.touched == []
            torch.ops.mps_ext.moe_combine(torch.ops.mps_ext.moe_experts(h, w_down, None, offs), w, row_of_slot)
        launches.add(tuple((d.kernel, d.threadgroups, d.threads_per_threadgroup) for d in rec.dispatches))
    assert len(launches) == 1
