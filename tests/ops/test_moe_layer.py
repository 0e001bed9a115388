"""torch.ops.mps_ext.moe_layer, a whole mixture-of-experts layer from one
call, against the layer written with torch's CPU ops in float64 (softmax,
topk, per-expert matmuls), and against the five ops it stands for (router
GEMV, moe_route, moe_experts twice, moe_combine), bit for bit: it runs
three dispatches, the routing in the gate/up product (moe_gate_up_routed,
tests/ops/test_moe_routed.py; moe_route's dispatch where that kernel does
not take the shapes) and the down product and moe_combine fused
(moe_down_combine of kernels_metal/grouped_mm.metal), which also adds a
decoder layer's residual when given one (torch's `residual + moe_out`, bit
for bit)."""

import pytest
import torch
import torch.nn.functional as F

import mps_ext_executor as cpu_metal
from rounding import fma32

gen = torch.Generator().manual_seed(3)
FP8 = torch.float8_e4m3fn


def randn(*shape, scale=1.0, dtype=torch.float32):
    return (torch.randn(shape, generator=gen) * scale).to(dtype)


def on(device):
    """Calls torch.ops.mps_ext.<name> with its tensors on `device`, the result back on the CPU."""
    def call(name, *args):
        if device == "mps":
            args = [a.to("mps") if isinstance(a, torch.Tensor) else a for a in args]
        out = getattr(torch.ops.mps_ext, name)(*args)
        return tuple(t.cpu() for t in out) if isinstance(out, tuple) else out.cpu()
    return call


def quantize_rows(w):
    scale = w.float().abs().amax(-1).clamp(min=1e-12) / 448
    return (w.float() / scale[..., None]).to(FP8), scale


def reference(x, router, gate_up, gate_up_scale, down, down_scale, top_k, renormalize, shared):
    """The layer in float64 with torch's CPU ops; the router's logits in x's
    dtype and each product's output rounded to the activations' dtype where
    the kernels store them."""
    logits = F.linear(x, router).double()
    e = logits.shape[1] - shared
    w, ids = torch.topk(torch.softmax(logits[:, :e], -1), top_k, -1)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    if shared:
        ids = torch.cat([ids, torch.full((len(ids), 1), e)], 1)
        w = torch.cat([w, torch.sigmoid(logits[:, e:])], 1)
    act = torch.bfloat16 if gate_up.dtype == FP8 else x.dtype
    gu = gate_up.double() * (1 if gate_up_scale is None else gate_up_scale.double()[..., None])
    dn = down.double() * (1 if down_scale is None else down_scale.double()[..., None])
    xe = x.to(act).double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            g, u = (gu[ids[t, j]] @ xe[t]).chunk(2)
            h = (F.silu(g) * u).to(act).double()
            out[t] += w[t, j] * (dn[ids[t, j]] @ h).to(act).double()
    return out


def layer(tokens, experts, top_k, shared, kind, hidden=64, inter=32):
    dtype = torch.bfloat16 if kind == "fp8" else kind
    x = randn(tokens, hidden, dtype=dtype)
    router = randn(experts + shared, hidden, scale=0.3, dtype=dtype)
    gate_up = randn(experts + shared, 2 * inter, hidden, scale=hidden ** -0.5, dtype=dtype)
    down = randn(experts + shared, hidden, inter, scale=inter ** -0.5, dtype=dtype)
    gate_up_scale = down_scale = None
    if kind == "fp8":
        (gate_up, gate_up_scale), (down, down_scale) = quantize_rows(gate_up), quantize_rows(down)
    return x, router, gate_up, gate_up_scale, down, down_scale


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 2), (4, 16, 4), (9, 8, 8)])  # 9 tokens: the router
@pytest.mark.parametrize("renormalize,shared", [(True, 0), (False, 1), (True, 1)])  # past linear's 8 rows
@pytest.mark.parametrize("kind", [torch.float32, torch.float16, torch.bfloat16, "fp8"], ids=str)
def test_layer_matches_torch_and_is_the_five_ops(device, tokens, experts, top_k, renormalize, shared, kind):
    args = layer(tokens, experts, top_k, shared, kind)
    x, router, gate_up, gate_up_scale, down, down_scale = args
    run = on(device)
    with cpu_metal.record() as rec:
        out = run("moe_layer", *args, top_k, renormalize, bool(shared))
    ref = reference(*args, top_k, renormalize, shared)
    assert out.dtype == x.dtype and out.shape == x.shape
    tol = 1e-5 if kind == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())
    # The same bits as the five ops called one by one, and as moe_combine's sums redone with torch.
    y, w, row_of_slot = five_ops(run, *args, top_k, renormalize, shared, out)
    assert torch.equal(out, combine_ref(y, w, row_of_slot, out.dtype))
    if device == "executor":
        kernels = [d.kernel for d in rec.dispatches]
        t = "bf16" if kind == "fp8" else {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}[kind]
        w_t = "bf16_e4m3w" if kind == "fp8" else t
        # The routing in the gate/up dispatch (tests/ops/test_moe_routed.py) up to its 128 token slots:
        # 9 tokens x 8 slots; past them (9 x 9) moe_route's dispatch before it.
        routed = tokens * (top_k + shared) <= 128
        gate_up = [f"moe_gate_up_routed_{w_t}_vec"] if routed else [f"moe_route_{t}", f"gmm_decode_rows_{w_t}_vec"]
        assert kernels[-3 + routed:] == gate_up + [f"moe_down_combine_{w_t}_vec"], kernels
        # The router's logits: mps_ext's GEMV (one dispatch) up to 8 rows; past them mps_ext's prefill tile
        # in 16-bit (fp8's activations are bf16), torch's CPU matmul in float32 (which linear leaves to
        # torch): three dispatches but for float32 past 8 rows.
        assert len(kernels) == 3 - routed + (tokens <= 8 or kind != torch.float32), kernels
        if kind == torch.float32:  # (rounded to f16 or bf16, sums in another order mostly round alike)
            assert_order_matters(y, w, row_of_slot, out)


def five_ops(run, x, router, gate_up, gate_up_scale, down, down_scale, top_k, renormalize, shared, out,
             expert_bias=None, sigmoid=False, scale=1.0, renorm_eps=0.0):
    """The layer as the five separate ops (the path moe_layer took before it
    fused the down product with the combine), checked to give `out`'s bits;
    returns the down product's rows y and the routing (weights, row_of_slot)."""
    logits = run("linear", x, router, None) if x.shape[0] <= 8 else F.linear(x, router)
    w, offs, slot_of_row, row_of_slot = run("moe_route", logits, top_k, renormalize, bool(shared), expert_bias,
                                            sigmoid, scale, renorm_eps)
    xe = x.bfloat16() if gate_up.dtype == FP8 else x
    h = run("moe_experts", xe, gate_up, gate_up_scale, offs, slot_of_row, top_k + shared, True)
    y = run("moe_experts", h, down, down_scale, offs, None, 1, False)
    old = run("moe_combine", y, w, row_of_slot)
    assert torch.equal(out, old.to(out.dtype)), (out - old.to(out.dtype)).abs().max()
    return y, w, row_of_slot


def combine_ref(y, weights, row_of_slot, dtype, order=None, fused=True, residual=None, residual_at="last"):
    """moe_combine's sums with torch's CPU ops, rounding where the kernel
    does: y in its dtype, each token's slots added in slot order (or
    `order`) to a float32 sum, each weight * y and the add one fused
    multiply-add (rounding.fma32; fused=False rounds the product first),
    the sum rounded to y's dtype and
    then to `dtype`. With `residual`, what moe_layer(..., residual) must
    give: `residual + that` with torch's add (residual_at="last"); or, to
    show that the data tell the orders apart, the residual added to the
    float32 sum before its one rounding ("unrounded") or as the sum's start
    ("first")."""
    tokens, slots = weights.shape
    rows = y.float()[row_of_slot.long()].view(tokens, slots, -1)
    acc = torch.zeros(tokens, y.shape[1], dtype=torch.float32)
    if residual is not None and residual_at == "first":
        acc = residual.float()
    for j in order if order is not None else range(slots):
        w = weights[:, j, None]
        acc = fma32(w, rows[:, j], acc) if fused else w * rows[:, j] + acc  # torch: two roundings
    if residual is not None and residual_at == "unrounded":
        return (acc + residual.float()).to(dtype)
    out = acc.to(y.dtype).to(dtype)
    return out if residual is None or residual_at == "first" else residual + out


def assert_order_matters(y, weights, row_of_slot, out):
    """These data tell the rounding apart: the slots summed in reverse, or
    with the products rounded before the adds, give other bits (so the
    equalities above would fail if the kernel rounded another way)."""
    slots = weights.shape[1]
    assert not torch.equal(out, combine_ref(y, weights, row_of_slot, out.dtype, order=range(slots)[::-1]))
    assert not torch.equal(out, combine_ref(y, weights, row_of_slot, out.dtype, fused=False))


KINDS = [torch.float32, torch.float16, torch.bfloat16, "fp8"]
INTERS = [32, 18]  # 18: rows of down and h not 16-byte multiples: the _scalar kernel


def down_combine_kernel(kind, inter):
    """The moe_down_combine variant a layer of `kind` and expert width `inter` runs."""
    w_t = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", "fp8": "bf16_e4m3w"}[kind]
    return f"moe_down_combine_{w_t}_{'vec' if inter % 8 == 0 else 'scalar'}"


@pytest.mark.parametrize("kind", KINDS, ids=str)
@pytest.mark.parametrize("inter", INTERS)
def test_down_combine_kernels(device, kind, inter):
    """Every moe_down_combine variant: the bits of the five ops and of
    moe_combine's sums redone with torch; one dispatch reads each chosen
    expert's down rows once."""
    tokens, experts, top_k, shared = 4, 16, 4, 1
    args = layer(tokens, experts, top_k, shared, kind, inter=inter)
    run = on(device)
    with cpu_metal.record() as rec:
        out = run("moe_layer", *args, top_k, True, True)
    y, w, row_of_slot = five_ops(run, *args, top_k, True, shared, out)
    assert torch.equal(out, combine_ref(y, w, row_of_slot, out.dtype))
    if device == "executor":
        d = rec.dispatches[-1]
        assert d.kernel == down_combine_kernel(kind, inter)
        down = args[4]
        ids = expert_of_slot(run, *args, top_k, shared)
        chosen = len(set(ids.tolist()))
        assert d.bytes_read[d.buffer("w")] == chosen * down[0].numel() * down.element_size()
        assert d.bytes_written[d.buffer("out")] == out.numel() * out.element_size()


def expert_of_slot(run, x, router, gate_up, gate_up_scale, down, down_scale, top_k, shared):
    """The expert of every token slot, from moe_route's offs and slot_of_row."""
    logits = run("linear", x, router, None)
    _, offs, slot_of_row, _ = run("moe_route", logits, top_k, True, bool(shared))
    counts = torch.diff(offs.long(), prepend=torch.zeros(1, dtype=torch.long))
    by_row = torch.repeat_interleave(torch.arange(len(offs)), counts)
    return torch.empty_like(by_row).index_copy_(0, slot_of_row.long(), by_row)


@pytest.mark.parametrize("tokens", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("kind", [torch.bfloat16, "fp8"], ids=str)
def test_each_chosen_expert_is_read_once(tokens, kind):
    """Decode of 1 to 16 sequences: the two expert products read each chosen
    expert's weights once, however many of the sequences chose it (the
    census's bytes, census.expected_experts, assume this): gate_up's and
    down's bytes read are the distinct experts moe_route chose times one
    expert's, and no weight byte is read twice."""
    experts, top_k = 32, 4
    args = layer(tokens, experts, top_k, 0, kind)
    if tokens > 1:  # two sequences alike choose the same experts, whatever the random draw (others may too)
        args[0][1] = args[0][0]
    run = on("executor")
    with cpu_metal.record(counters=True) as rec:
        run("moe_layer", *args, top_k, True, False)
    distinct = int(expert_of_slot(run, *args, top_k, 0).unique().numel())
    assert tokens == 1 or distinct <= (tokens - 1) * top_k  # sequences share experts: the case this tests
    _, _, gate_up, _, down, _ = args
    seen = set()
    for d in rec.dispatches:
        bank = gate_up if d.kernel.startswith("moe_gate_up_routed") else down if d.kernel.startswith(
            "moe_down_combine") else None
        if bank is None:
            continue
        w = next(i for i, n in d.buffer_names.items() if n == "w")
        assert d.bytes_read[w] == d.unique_bytes_read[w] == distinct * bank[0].nbytes, (d.kernel, distinct)
        seen.add(d.kernel.split("_bf16")[0])
    assert seen == {"moe_gate_up_routed", "moe_down_combine"}


def test_every_down_combine_kernel_runs():
    """Each [[host_name]] of moe_down_combine is the variant one case of
    test_down_combine_kernels runs (and checks that it ran)."""
    from tests.ops.host_names import host_names
    names = {k for k in host_names("grouped_mm") if k.startswith("moe_down_combine_")}
    assert len(names) == 8 and names == {down_combine_kernel(k, i) for k in KINDS for i in INTERS}


@pytest.mark.parametrize("tokens,top_k,shared", [(32, 7, 1), (128, 7, 1)])
def test_down_combine_up_to_moe_routes_limit(tokens, top_k, shared):
    """Up to moe_route's 1024 token slots (128 tokens x 8 slots): a
    threadgroup keeps every row's outputs of its columns (at 1024 rows one
    simdgroup's 2), and the bits are the five ops'."""
    args = layer(tokens, 8, top_k, shared, torch.float32)
    run = on("executor")
    with cpu_metal.record() as rec:
        out = run("moe_layer", *args, top_k, True, bool(shared))
    y, w, row_of_slot = five_ops(run, *args, top_k, True, shared, out)
    assert torch.equal(out, combine_ref(y, w, row_of_slot, out.dtype))
    d = rec.dispatches[-1]
    assert d.kernel == "moe_down_combine_f32_vec"
    rows = tokens * (top_k + shared)
    assert d.threads_per_threadgroup[0] * 2 // 32 * rows <= 2048


def residual_for(x):
    """A decoder layer's residual stream for x: of x's shape and dtype, and
    large beside the layer's output, as a residual stream is (so that the
    order of the roundings shows in the bits)."""
    g = torch.Generator().manual_seed(x.shape[0])
    return (torch.randn(x.shape, generator=g) * 4).to(x.dtype)


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 2), (4, 16, 4), (9, 8, 8)])
@pytest.mark.parametrize("shared", [0, 1])
@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_residual_is_added_in_the_last_dispatch(device, tokens, experts, top_k, shared, kind):
    """moe_layer(..., residual): torch's `residual + moe_out` bit for bit,
    moe_out the layer's output without it (the five ops' bits, rounded to
    the dtype), in the same dispatches: moe_down_combine adds it as it
    stores, after rounding the layer's output, which other orders would not
    give."""
    args = layer(tokens, experts, top_k, shared, kind)
    x = args[0]
    residual = residual_for(x)
    run = on(device)
    with cpu_metal.record() as plain:
        moe_out = run("moe_layer", *args, top_k, True, bool(shared))
    with cpu_metal.record() as rec:
        out = run("moe_layer", *args, top_k, True, bool(shared), None, False, 1.0, 0.0, residual)
    y, w, row_of_slot = five_ops(run, *args, top_k, True, shared, moe_out)
    assert torch.equal(moe_out, combine_ref(y, w, row_of_slot, x.dtype))
    want = combine_ref(y, w, row_of_slot, x.dtype, residual=residual)
    assert torch.equal(want, residual + moe_out)
    assert out.dtype == x.dtype and torch.equal(out, want), (out.double() - want.double()).abs().max()
    for other in ("unrounded", "first"):
        if kind == torch.float32 and other == "unrounded":
            continue  # the float32 sum is the output: no rounding between
        assert not torch.equal(out, combine_ref(y, w, row_of_slot, x.dtype, residual=residual, residual_at=other))
    if device == "executor":
        kernels = [d.kernel for d in rec.dispatches]
        assert kernels == [d.kernel for d in plain.dispatches]
        routed = tokens * (top_k + shared) <= 128  # (the routing and the router: as above)
        assert len(kernels) == 3 - routed + (tokens <= 8 or kind != torch.float32), kernels
        d = rec.dispatches[-1]
        assert d.kernel.startswith("moe_down_combine_")
        assert d.bytes_read[d.buffer("residual")] == residual.nbytes
        assert plain.dispatches[-1].bytes_read.get(d.buffer("residual"), 0) == 0


@pytest.mark.parametrize("kind", KINDS, ids=str)
@pytest.mark.parametrize("inter", INTERS)
def test_down_combine_kernels_add_the_residual(kind, inter):
    """Every moe_down_combine variant adds the residual (the flag of its
    parameters, no variant of its own)."""
    args = layer(2, 8, 2, 1, kind, inter=inter)
    residual = residual_for(args[0])
    run = on("executor")
    with cpu_metal.record() as rec:
        out = run("moe_layer", *args, 2, True, True, None, False, 1.0, 0.0, residual)
    assert rec.dispatches[-1].kernel == down_combine_kernel(kind, inter)
    assert torch.equal(out, residual + run("moe_layer", *args, 2, True, True))


def test_residual_under_fp8_banks_and_float32_activations(device):
    """fp8 banks under float32 x: the kernels' bfloat16 output is converted
    to float32, then torch adds the residual, as it would to the layer's
    output."""
    x, router, gate_up, gate_up_scale, down, down_scale = layer(2, 8, 2, 1, "fp8")
    x, router = x.float(), router.float()
    residual = residual_for(x)
    args = (x, router, gate_up, gate_up_scale, down, down_scale, 2, True, True)
    out = on(device)("moe_layer", *args, None, False, 1.0, 0.0, residual)
    assert out.dtype == torch.float32 and torch.equal(out, residual + on(device)("moe_layer", *args))


def test_bad_residual():
    x, router, gate_up, _, down, _ = layer(2, 8, 2, 0, torch.float32)

    def call(residual):
        return torch.ops.mps_ext.moe_layer(x, router, gate_up, None, down, None, 2, residual=residual)
    accepted = r"residual must be a contiguous tensor of x's shape, dtype and device \(\[2, 64\] Float on cpu\)"
    with pytest.raises(RuntimeError, match=accepted + r", got \[2, 32\] Float on cpu$"):
        call(randn(2, 32))
    with pytest.raises(RuntimeError, match=accepted + r", got \[1, 64\] Float on cpu$"):
        call(randn(1, 64))
    with pytest.raises(RuntimeError, match=accepted + r", got \[2, 64\] BFloat16 on cpu$"):
        call(randn(2, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match=accepted + r", got \[2, 64\] Float on cpu, not contiguous"):
        call(randn(2, 128)[:, ::2])
    with pytest.raises(RuntimeError, match=r"residual must be a contiguous tensor of x's shape, dtype and device "
                       r"\(\[2, 64\] torch.float32 on cpu\), got \[2, 64\] torch.float32 on meta"):
        call(torch.empty(2, 64, device="meta"))  # (the meta kernel's check: the dispatcher chooses it)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("renormalize", [False, True])
def test_sigmoid_scoring(device, bias, renormalize):
    """LFM2-MoE's router: sigmoid scores, the top-k of score + expert_bias
    chosen, weighted by their scores (renormalised with 1e-6 in the
    denominator), times a scale. float32, where equal scores are unlikely
    (moe_route breaks ties by the lower expert, torch.topk leaves them open)."""
    tokens, experts, top_k, scale = 4, 16, 4, 2.5
    x, router, gate_up, _, down, _ = layer(tokens, experts, top_k, 0, torch.float32)
    expert_bias = randn(experts, scale=0.3) if bias else None
    out = on(device)("moe_layer", x, router, gate_up, None, down, None, top_k, renormalize, False, expert_bias, True,
                     scale, 1e-6)
    scores = torch.sigmoid(F.linear(x, router).double())
    index = torch.topk(scores + (0 if expert_bias is None else expert_bias.double()), top_k, -1).indices
    w = scores.gather(1, index)
    if renormalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-6)
    w = w * scale
    ref = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(tokens):
        for j in range(top_k):
            g, u = (gate_up[index[t, j]].double() @ x[t].double()).chunk(2)
            ref[t] += w[t, j] * (down[index[t, j]].double() @ (F.silu(g) * u))
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    y, w, row_of_slot = five_ops(on(device), x, router, gate_up, None, down, None, top_k, renormalize, 0, out,
                                 expert_bias, True, scale, 1e-6)
    assert torch.equal(out, combine_ref(y, w, row_of_slot, out.dtype))


def test_fp8_banks_take_float32_activations(device):
    """The fp8 kernels take bfloat16 activations: a float32 x is rounded to
    them, the router's logits stay float32, and the output is float32."""
    x, router, gate_up, gate_up_scale, down, down_scale = layer(2, 8, 2, 1, "fp8")
    x, router = x.float(), router.float()
    out = on(device)("moe_layer", x, router, gate_up, gate_up_scale, down, down_scale, 2, True, True)
    assert out.dtype == torch.float32
    ref = reference(x, router, gate_up, gate_up_scale, down, down_scale, 2, True, 1)
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
    # The sums rounded to bfloat16 as the kernels store them, then to float32.
    y, w, row_of_slot = five_ops(on(device), x, router, gate_up, gate_up_scale, down, down_scale, 2, True, 1, out)
    assert torch.equal(out, combine_ref(y, w, row_of_slot, out.dtype))


def test_no_tokens():
    x, *rest = layer(1, 8, 2, 0, torch.float32)
    out = torch.ops.mps_ext.moe_layer(x[:0], *rest, 2, True, False)
    assert out.shape == (0, 64)


def test_checks():
    x, router, gate_up, _, down, _ = layer(2, 8, 2, 0, torch.float32)
    op = torch.ops.mps_ext.moe_layer
    with pytest.raises(RuntimeError, match="x must be float32, float16 or bfloat16, got Double"):
        op(x.double(), router.double(), gate_up.double(), None, down.double(), None, 2)
    with pytest.raises(RuntimeError, match="router must be .* in x's dtype"):
        op(x, router.bfloat16(), gate_up, None, down, None, 2)
    with pytest.raises(RuntimeError, match=r"gate_up \[E, 2I, H\] and down \[E, H, I\]"):
        op(x, router, gate_up[:7], None, down, None, 2)
    with pytest.raises(RuntimeError, match="banks must both be float8_e4m3fn"):
        op(x, router, gate_up.to(FP8), None, down, None, 2)
    with pytest.raises(RuntimeError, match="fp8 weights need weight_scale"):
        op(x.bfloat16(), router.bfloat16(), gate_up.to(FP8), None, down.to(FP8), None, 2)
    with pytest.raises(RuntimeError, match=r"top_k must be in \[1, 8\]"):
        op(x, router, gate_up, None, down, None, 9)
    with pytest.raises(RuntimeError, match="moe_route is for decode: at most 1024 token slots"):
        op(randn(513, 64), router, gate_up, None, down, None, 2)
    with pytest.raises(RuntimeError, match="expert_bias is for sigmoid scoring"):
        op(x, router, gate_up, None, down, None, 2, True, False, randn(8))
    with pytest.raises(RuntimeError, match=r"expert_bias must be contiguous float32 \[8\]"):
        op(x, router, gate_up, None, down, None, 2, True, False, randn(8).double(), True)


@pytest.mark.parametrize("kind", [torch.bfloat16, "fp8"], ids=str)
def test_fake_kernel_for_torch_compile(kind):
    args = layer(3, 8, 2, 1, kind)
    # test_schema compares outputs with torch ops that have no float8 CPU kernel.
    checks = ("test_faketensor",) if kind == "fp8" else ("test_schema", "test_faketensor")
    torch.library.opcheck(torch.ops.mps_ext.moe_layer.default, (*args, 2, True, True), test_utils=checks)
    residual = residual_for(args[0])
    torch.library.opcheck(torch.ops.mps_ext.moe_layer.default, (*args, 2, True, True),
                          {"residual": residual}, test_utils=checks)
