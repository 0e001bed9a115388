"""mps_ext's fused MoE decode ops (moe_route, moe_experts, moe_combine)
against a float64 layer written with torch's own ops (softmax, topk, per
expert matmuls), and the traffic of a whole layer. Their kernels are
kernels_metal/moe.metal's (moe_route_*, moe_combine_*) and
grouped_mm.metal's decode GEMV."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mps_ext
from host_names import host_names
import mps_ext_executor as cpu_metal
from rounding import sigmoid_reach

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


def chosen_experts(offs, slot_of_row, tokens, slots):
    """Each token slot's expert [tokens, slots], from moe_route's sorted
    slots: rows [offs[e-1], offs[e]) are expert e's, slot_of_row[row] their slot."""
    ids = torch.repeat_interleave(torch.arange(len(offs)), torch.diff(offs.long(), prepend=torch.zeros(1).long()))
    return torch.empty_like(ids).index_copy_(0, slot_of_row.long(), ids).view(tokens, slots)


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 256, 8), (8, 128, 8), (3, 32, 4), (5, 7, 7), (1, 1000, 2)])
@pytest.mark.parametrize("renormalize,shared", [(True, False), (False, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_matches_softmax_topk_and_sorts_slots_by_expert(device, tokens, experts, top_k, renormalize, shared,
                                                              dtype):
    logits = randn(tokens, experts + shared, scale=3, dtype=dtype)
    w, offs, slot_of_row, row_of_slot = ops(device)("moe_route", logits, top_k, renormalize, bool(shared))
    w_ref, ids_ref = routing_ref(logits, top_k, renormalize, shared)
    slots = top_k + shared
    assert offs[-1] == tokens * slots and bool((offs[1:] >= offs[:-1]).all())
    ids = chosen_experts(offs, slot_of_row, tokens, slots)
    # The same experts as torch.topk (up to the order of equal logits), with the same weights.
    lg = logits.double()
    torch.testing.assert_close(
        lg.gather(1, ids[:, :top_k]).sort(1).values, lg.gather(1, ids_ref[:, :top_k]).sort(1).values
    )
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
            g, u = (dequant(w_gate_up[e], None if gate_up_scale is None else gate_up_scale[e]) @ x[t].double()).split(
                inter
            )
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
        wtype = "bf16_e4m3w" if weights == "fp8" else "bf16"
        # The router's GEMV (mps_ext's linear, unless torch's own takes one row), then four dispatches.
        assert kernels[-4:] == ["moe_route_bf16", f"gmm_decode_rows_{wtype}_vec", f"gmm_decode_rows_{wtype}_vec",
                                "moe_combine_bf16"]
        ids = routing_ref((x.double() @ router.double().t()).to(x.dtype), top_k, True, shared)[1]
        chosen = len(set(ids.flatten().tolist()))
        item = 1 if weights == "fp8" else 2
        gate_up, down = rec.dispatches[-3], rec.dispatches[-2]
        # The shared expert has 8 rows at 8 tokens: still one chunk, read once.
        assert gate_up.bytes_read[gate_up.buffer("w")] == chosen * 2 * inter * hidden * item
        assert down.bytes_read[down.buffer("w")] == chosen * hidden * inter * item


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


def test_counts_as_moe_runs():
    mps_ext.reset_stats()
    torch.ops.mps_ext.moe_route(randn(1, 8), 2, True, False)
    assert mps_ext.stats()["moe"]["ran"] == 1


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_ranks_nan_logits_highest_as_torch_topk(device, dtype):
    # torch.topk ranks NaN above every number; softmax of a row with a NaN is
    # NaN throughout, so every weight of such a token is NaN.
    nan = float("nan")
    logits = randn(4, 40, scale=3, dtype=dtype)
    logits[0, 17] = nan                # one NaN expert: chosen first
    logits[1, [3, 30]] = nan           # two, with top_k 4
    logits[2, [1, 5, 9, 20, 33]] = nan  # more NaNs than top_k: the lowest-numbered
    top_k = 4
    w, offs, slot_of_row, _ = ops(device)("moe_route", logits, top_k, True, False)
    ids = chosen_experts(offs, slot_of_row, 4, top_k)
    ref = torch.topk(logits.float(), top_k, -1).indices
    for t in (0, 1, 3):  # a unique answer: torch's set
        assert set(ids[t].tolist()) == set(ref[t].tolist()), t
    # Among equal values (NaNs) torch.topk leaves the order open; mps_ext takes
    # the lowest expert numbers.
    assert set(ref[2].tolist()) < {1, 5, 9, 20, 33}
    assert set(ids[2].tolist()) == {1, 5, 9, 20}
    w_ref, _ = routing_ref(logits, top_k, True, 0)
    assert torch.isnan(w[:3]).all() and torch.isnan(w_ref[:3]).all()
    torch.testing.assert_close(w[3].double(), w_ref[3], rtol=1e-5, atol=1e-6)


def near_tie_logits(tokens, experts, dtype):
    """Logits 0.3 plus a few of the dtype's ulps there (float32: 2^-25,
    bfloat16: 2^-9): float32 sigmoid scores an ulp or two apart (the slope
    there is 0.24), bfloat16 ones mostly equal after their rounding. Every
    other token's steps are 64 times wider: scores 8 ulps apart, beyond the
    exp's reach (but where two experts draw the same step)."""
    g = torch.Generator().manual_seed(11)
    steps = torch.randint(0, 40, (tokens, experts), generator=g) * torch.tensor([1, 64]).repeat(tokens // 2)[:, None]
    ulp = 2.0 ** -25 if dtype == torch.float32 else 2.0 ** -9
    return (0.3 + steps.double() * ulp).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sigmoid_routing_chooses_as_exact_scores_up_to_ties_within_exps_reach(dtype):
    """Sigmoid scoring (LFM2-MoE) ranks experts by float(T(sigmoid(l))) +
    bias, whose exp Metal computes to 4 ulp, not torch's 1: experts whose
    scores are that close can be chosen either way. The claim: the chosen
    experts are the top k for some exp within the bound (no unchosen
    expert's lowest reachable score above a chosen one's highest, ties to
    the lower number), hence exactly the top k of the exact scores wherever
    no expert outside them reaches a chosen one's score. Tested on scores a
    few ulps apart with exp at the bound (perturb=1), where choices do
    change; an exp 4 times worse (perturb=4) breaks the claim. bfloat16:
    the scores are rounded to bfloat16 (2^15 float32 ulps apart), which an
    exp 4 ulps off moves about once in 10^4 sigmoids: the same claim, over
    equal scores that the expert number decides."""
    tokens, experts, top_k = 128, 16, 4
    logits = near_tie_logits(tokens, experts, dtype)
    bias = torch.zeros(experts)

    def route(perturb):
        with cpu_metal.math_mode(perturb=perturb):
            w, offs, slot_of_row, _ = torch.ops.mps_ext.moe_route(logits, top_k, False, False, bias, True, 1.0, 0.0)
        return w, chosen_experts(offs, slot_of_row, tokens, top_k)

    # The scores' reach: the sigmoid's, plus the bias in float32 (a rounding is monotone).
    lo, hi = sigmoid_reach(logits, dtype)
    lo, hi = lo + bias, hi + bias
    exact = torch.sigmoid(logits.double()) + bias.double()

    def consistent(ids):
        """Per token: the choice is the top k for some exp within the bound."""
        ok = []
        for t in range(tokens):
            chosen = set(ids[t].tolist())
            ok.append(all(hi[t, i] > lo[t, j] or (hi[t, i] == lo[t, j] and i < j)
                          for i in chosen for j in range(experts) if j not in chosen))
        return torch.tensor(ok)

    results = {p: route(p) for p in (0, 1, 4)}
    for p in (0, 1):
        w, ids = results[p]
        assert bool(consistent(ids).all()), p
        # Where no expert outside the exact top k reaches into it: exactly the exact top k.
        top = torch.topk(exact, top_k, -1).indices
        separated = 0
        for t in range(tokens):
            inside, outside = top[t].tolist(), [j for j in range(experts) if j not in top[t].tolist()]
            if all(lo[t, i] > hi[t, j] for i in inside for j in outside):
                separated += 1
                assert set(ids[t].tolist()) == set(inside), (p, t)
        assert separated >= (tokens // 4 if dtype == torch.float32 else 0)
        # The weights: each chosen expert's score without its bias, within its reach.
        picked = ids.long()
        assert bool(((w >= lo.gather(1, picked)) & (w <= hi.gather(1, picked))).all()), p
    if dtype == torch.float32:
        assert not torch.equal(results[0][1].sort(1).values, results[1][1].sort(1).values)  # the bound moves choices
        assert not bool(consistent(results[4][1]).all())  # a worse exp would be caught


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
        assert rec.dispatches[0].kernel == (
            "gmm_decode_rows_bf16_e4m3w_scalar" if fp8 else "gmm_decode_rows_bf16_scalar"
        )


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


# ------------------------------------------- quantize_fp8 of expert banks --
class Experts(nn.Module):
    """Expert banks as transformers stores them (Qwen3-MoE, Qwen3.5, LFM2-MoE):
    gate_up_proj [E, 2I, H], down_proj [E, H, I], SiLU gate; the forward is
    the per-expert loop those modules run."""

    def __init__(self, experts=16, hidden=128, inter=48):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5)
        self.down_proj = nn.Parameter(torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5)
        self.act_fn = nn.SiLU()

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for t in range(hidden_states.shape[0]):
            for j, e in enumerate(top_k_index[t].tolist()):
                gate, up = F.linear(hidden_states[t], self.gate_up_proj[e]).chunk(2, -1)
                out[t] += top_k_weights[t, j] * F.linear(self.act_fn(gate) * up, self.down_proj[e])
        return out


class Block(nn.Module):
    def __init__(self, experts=16, top_k=4, hidden=128):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = Experts(experts, hidden)

    def forward(self, x):
        w, ids = torch.topk(torch.softmax(self.gate(x).float(), -1), self.top_k, -1)
        return self.experts(x, ids, (w / w.sum(-1, keepdim=True)).to(x.dtype))


def experts_with_stored_fp8(fp8_experts, x, ids, w):
    """float64 reference of FP8Experts from its own fp8 banks and scales (h
    rounded to bf16 as the fused op stores it)."""
    gu = fp8_experts.gate_up_proj.double() * fp8_experts.gate_up_scale.double()[..., None]
    dn = fp8_experts.down_proj.double() * fp8_experts.down_scale.double()[..., None]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t].tolist()):
            g, u = (gu[e] @ x[t].double()).chunk(2)
            out[t] += float(w[t, j]) * (dn[e] @ (F.silu(g) * u).bfloat16().double())
    return out


@pytest.mark.parametrize("tokens", [1, 8])
@cpu_metal.request()  # FP8Experts on CPU tensors: through the kernels, not torch's CPU ops
def test_quantize_fp8_converts_expert_banks(tokens):
    torch.manual_seed(5)  # Block's weights (nn.Linear's init) whatever ran before in this process
    ref = Block().bfloat16()
    model = Block().bfloat16()
    model.load_state_dict(ref.state_dict())
    mps_ext.quantize_fp8(model)
    assert isinstance(model.experts, mps_ext.FP8Experts)
    assert isinstance(model.gate, nn.Linear)  # the router is kept by default
    assert "float8_e4m3fn" in repr(model.experts) and "scale per expert output row" in repr(model.experts)
    # Weight memory: one byte per weight plus a float32 scale per output row.
    bf16 = ref.experts.gate_up_proj.nbytes + ref.experts.down_proj.nbytes
    fp8 = sum(b.nbytes for b in model.experts.buffers())
    assert fp8 <= 0.51 * bf16 * (1 + 8 / 128)  # 0.5 + 2 / hidden (128 here; 0.501 at hidden 2048)
    x = randn(tokens, 128)
    ids = torch.stack([torch.randperm(16, generator=gen)[:4] for _ in range(tokens)])
    w = torch.softmax(torch.randn(tokens, 4, generator=gen), -1)
    mps_ext.reset_stats()
    with cpu_metal.record() as rec:
        got = model.experts(x, ids, w.bfloat16())
    # Four dispatches of mps_ext's (the slot sort is torch's, on the device).
    assert [d.kernel for d in rec.dispatches] == ["gmm_decode_rows_bf16_e4m3w_vec"] * 2 + ["moe_combine_bf16"]
    chosen = len(set(ids.flatten().tolist()))
    assert rec.dispatches[0].bytes_read[rec.dispatches[0].buffer("w")] == chosen * 96 * 128  # each chosen expert once
    assert mps_ext.stats()["moe"]["ran"] == 3
    # What the stored fp8 weights say, to bf16 rounding ...
    exact = experts_with_stored_fp8(model.experts, x, ids, w.bfloat16())
    torch.testing.assert_close(got.double(), exact, rtol=2e-2, atol=2e-2 * exact.abs().max().item())
    # ... and the bf16 experts within e4m3's rounding (3 mantissa bits: each
    # weight off by at most 2^-4 of its row's largest).
    want = ref.experts(x, ids, w.bfloat16())
    rel = (got.float() - want.float()).norm() / want.float().norm()
    assert rel < 0.06, rel
    # The whole block, with the bf16 router.
    rel = (model(x).float() - ref(x).float()).norm() / ref(x).float().norm()
    assert rel < 0.06, rel
    assert isinstance(mps_ext.quantize_fp8(Block(), filter=lambda name, m: True).gate, mps_ext.FP8Linear)
    # state_dict round trip.
    again = mps_ext.quantize_fp8(Block().bfloat16())
    again.load_state_dict(model.state_dict())
    assert torch.equal(again.experts(x, ids, w.bfloat16()), got)


@cpu_metal.request()
def test_fp8_experts_prefill_quantizes_activations_too():
    # Past 1024 routed rows the products are _scaled_grouped_mm's tiles with
    # row-wise e4m3 activations.
    torch.manual_seed(0)
    ref = Experts(experts=8, hidden=64, inter=32).bfloat16()
    fp8 = mps_ext.FP8Experts.from_experts(ref)
    tokens = 300  # x top-4 = 1200 rows
    x = randn(tokens, 64)
    ids = torch.stack([torch.randperm(8, generator=gen)[:4] for _ in range(tokens)])
    w = torch.softmax(torch.randn(tokens, 4, generator=gen), -1).bfloat16()
    with cpu_metal.record() as rec:
        got = fp8(x, ids, w)
    assert [d.kernel for d in rec.dispatches] == ["gmm_tiled_e4m3"] * 2 + ["moe_combine_bf16"]
    want = ref(x, ids, w)
    rel = (got.float() - want.float()).norm() / want.float().norm()
    assert rel < 0.08, rel  # weights and activations each within 2^-4 of their rows' largest


def test_quantize_weight_of_expert_banks():
    bank = torch.randn(3, 5, 40, generator=gen)
    q, s = mps_ext.fp8.quantize_weight(bank, "row")
    assert q.dtype == torch.float8_e4m3fn and q.shape == bank.shape and s.shape == (3, 5)
    # The largest magnitude of each row maps to 448; the rest round to nearest e4m3.
    torch.testing.assert_close(s, bank.abs().amax(-1) / 448)
    assert torch.equal(q, (bank / s[..., None]).to(torch.float8_e4m3fn))
    for granularity in ("tensor", "block"):
        with pytest.raises(ValueError, match="3-D expert bank with granularity 'row'"):
            mps_ext.fp8.quantize_weight(bank, granularity)
    # Not SiLU-gated: left as it is, with a warning.
    other = Experts()
    other.act_fn = nn.GELU()
    assert not mps_ext.FP8Experts.convertible(other) and mps_ext.FP8Experts.convertible(Experts())
    with pytest.warns(UserWarning, match="act_fn GELU.* is not SiLU"):
        assert isinstance(mps_ext.quantize_fp8(nn.Sequential(other))[0], Experts)


def test_every_kernel_is_tested():
    # moe_route: test_route_matches_softmax_topk_and_sorts_slots_by_expert (f32, bf16) and
    # test_route_of_half_logits (f16); moe_combine: test_combine_sums_each_tokens_slots_with_their_weights.
    assert host_names("moe") == {f"moe_{op}_{t}" for op in ("route", "combine") for t in ("f32", "f16", "bf16")}
