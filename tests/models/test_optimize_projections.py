"""mps_ext.optimize's fused projections (mps_ext/passes/projections.py) on
transformers 5's tiny qwen3_moe, qwen3_5_moe and lfm2_moe: each group of
projections that read one input is one host call and one dispatch at
decode (it was one per projection), on every release's policy, float and
fp8; logits against the same model optimized without the fusion, stock
torch and float64; torch.compile; state dict, casts, quantize_fp8 after
optimize; what it leaves and why; members that turn out not to share
their input."""

import copy

import pytest
import torch
from torch import nn

import mps_ext
import mps_ext_executor
from mps_ext.passes import projections as fused_projections
from mps_ext_executor import run_model
from mps_ext.passes.projections import ProjectionRows
from model_compare import RELEASE
from test_optimize import decode_counts, ids, make, optimized_against_stock_and_float64, prefill_and_decode, rel_err


@pytest.fixture(autouse=True)
def norms_apart(monkeypatch):
    """The groups' own calls: a decoder layer's input norm apart from the
    group that reads it (mps_ext.passes.decoder would otherwise run the
    group's GEMV with the norm, rms_norm_linear, outside the mixer these
    tests count; tests/models/test_optimize_decoder.py tests that)."""
    from mps_ext.passes import decoder
    monkeypatch.setattr(decoder, "norm_into_projection", lambda x, norm, mixer: norm(x))

QKV = ("q_proj", "k_proj", "v_proj")
# Per model, the groups optimize fuses: (parent, members, the fused layer's name). The shared expert
# of qwen3_5_moe is expert 8 of its block's banks, its gate_proj and up_proj views of them: left.
GROUPS = {
    "qwen3_moe": [("model.layers.0.self_attn", QKV, "qkv_proj"), ("model.layers.1.self_attn", QKV, "qkv_proj")],
    "qwen3_5_moe": [("model.layers.0.linear_attn", ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
                     "in_proj_qkvzba"),
                    ("model.layers.1.self_attn", QKV, "qkv_proj")],
    # layer 0: convolution and the dense MLP (w1, w3, w2); layer 1 attention; layer 2 convolution
    "lfm2_moe": [("model.layers.0.feed_forward", ("w1", "w3"), "w13"),
                 ("model.layers.1.self_attn", QKV, "qkv_proj")],
}


def group_counts(model, name, release=RELEASE):
    """{parent: (host calls, executor dispatches)} of each group's members
    together in one decode step."""
    groups = GROUPS[name]
    members = {id(model.get_submodule(f"{p}.{m}")): p for p, ms, _ in groups for m in ms}
    out = dict.fromkeys((p for p, _, _ in groups), (0, 0))
    for mod, calls, dispatches in decode_counts(model, [model.get_submodule(f"{p}.{m}") for p, ms, _ in groups
                                                        for m in ms], release):
        c, d = out[members[id(mod)]]
        out[members[id(mod)]] = (c + calls, d + dispatches)
    return out


def unfused(monkeypatch, name, dtype):
    """optimized_against_stock_and_float64 with optimize's projection fusion turned off."""
    with monkeypatch.context() as m:
        m.setattr(fused_projections, "GROUPS", ())
        return optimized_against_stock_and_float64(name, dtype)[0]


# ----------------------------------------------------------- host calls and dispatches --
@pytest.mark.parametrize("kind", ["float32", "bfloat16", "fp8"])
@pytest.mark.parametrize("name", list(GROUPS))
def test_each_group_is_one_call_and_one_dispatch_at_decode(name, kind):
    model = make(name, torch.float32 if kind == "float32" else torch.bfloat16)
    if kind == "fp8":
        mps_ext.quantize_fp8(model)
    before = group_counts(model, name)
    mps_ext.optimize(model)
    after = group_counts(model, name)
    print(f"\n{name} {kind}: per group and decoded token, (host calls, dispatches) before {before}, after {after}")
    assert before == {p: (len(ms), len(ms)) for p, ms, _ in GROUPS[name]}
    assert after == {p: (1, 1) for p, _, _ in GROUPS[name]}
    s = model.optimize_summary
    assert sorted(s["projections"].converted) == sorted(f"{p}.{f}" for p, _, f in GROUPS[name])
    assert all("views of the MoE kernel's banks" in why for why in s["projections"].left.values())  # shared experts
    assert f"{len(GROUPS[name])} groups of projections" in str(s)
    for p, ms, f in GROUPS[name]:
        parent = model.get_submodule(p)
        assert all(isinstance(getattr(parent, m), ProjectionRows) for m in ms)
        fused = getattr(parent, f)
        assert type(fused) is (mps_ext.FP8Linear if kind == "fp8" else nn.Linear)
        assert fused.out_features == sum(getattr(parent, m).out_features for m in ms)


@pytest.mark.parametrize("release", ["2.9", "2.15"])
def test_every_release_runs_a_group_as_one_call(release):
    """A group is one call of one GEMV dispatch under the policy of torch
    2.9 and of 2.15 (F.linear, mps_ext::linear; fp8: mps_ext's own op)."""
    for quantize in (False, True):
        model = make("qwen3_5_moe", torch.bfloat16)
        mps_ext.optimize(mps_ext.quantize_fp8(model) if quantize else model)
        assert group_counts(model, "qwen3_5_moe", release) == {p: (1, 1) for p, _, _ in GROUPS["qwen3_5_moe"]}


def test_a_layers_decode_step_loses_the_calls_of_the_fused_members():
    """Qwen3.5-MoE's attention layer, one decode step: q_proj, k_proj and
    v_proj were three of mps_ext's linear calls, now one (o_proj is
    sigmoid_gate_linear, the output gate in its GEMV, both ways)."""
    from test_optimize import decode_layer_ops
    model = make("qwen3_5_moe", torch.bfloat16)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(fused_projections, "GROUPS", ())
        before = decode_layer_ops(mps_ext.optimize(copy.deepcopy(model)), 1)
    after = decode_layer_ops(mps_ext.optimize(model), 1)
    assert before["mps_ext::linear"] == 3 and after["mps_ext::linear"] == 1
    assert before["mps_ext::sigmoid_gate_linear"] == after["mps_ext::sigmoid_gate_linear"] == 1
    assert sum(after.values()) == sum(before.values()) - 2


# ----------------------------------------------------------- results --
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(GROUPS))
def test_fused_model_matches_unfused_stock_and_float64(figures, monkeypatch, name, dtype):
    model, prompt, step, ref, stock = optimized_against_stock_and_float64(name, dtype)
    assert len(model.optimize_summary["projections"].converted) == len(GROUPS[name])
    apart = unfused(monkeypatch, name, dtype)
    assert not apart.optimize_summary["projections"].converted
    # CPU tensors outside the runner: torch's CPU ops, a GEMM of the concatenated weight.
    for s, o in zip(stock, prefill_and_decode(model, prompt, step)):
        assert rel_err(o, s) <= (1e-5 if dtype == torch.float32 else 2e-2)
    with run_model(RELEASE) as report:
        ours = prefill_and_decode(model, prompt, step)
        theirs = prefill_and_decode(apart, prompt, step)
    figures.families = report.ran_kernels()
    for what, i in (("prefill", 0), ("decode", 1)):
        figures.no_worse(what, ours[i], stock[i], ref[i], dtype)
    # The decode step's GEMV computes each output row as the unfused one did.
    assert torch.equal(ours[1], theirs[1])


@pytest.mark.parametrize("granularity", ["row", "tensor"])
@pytest.mark.parametrize("name", ["qwen3_5_moe", "lfm2_moe"])
def test_fp8_groups_match_the_quantized_model(monkeypatch, name, granularity):
    """quantize_fp8, then optimize: one FP8Linear a group with a scale per
    row (a tensor scale repeated over its rows: the same products), against
    the quantized model optimized without the fusion, on the kernels."""
    model = mps_ext.quantize_fp8(make(name, torch.bfloat16), granularity=granularity)
    apart = copy.deepcopy(model)
    prompt, step = ids(), ids(1, seed=2)
    want = prefill_and_decode(model, prompt, step)
    mps_ext.optimize(model)
    with monkeypatch.context() as m:
        m.setattr(fused_projections, "GROUPS", ())
        mps_ext.optimize(apart)
    for p, ms, f in GROUPS[name]:
        fused = model.get_submodule(f"{p}.{f}")
        assert fused.granularity == "row" and fused.weight_scale.shape == (fused.out_features, 1)
        if granularity == "tensor":
            assert "tensor scale repeated per row" in model.optimize_summary["projections"].converted[f"{p}.{f}"]
    with run_model(RELEASE) as report:
        got = prefill_and_decode(model, prompt, step)
        unf = prefill_and_decode(apart, prompt, step)
    assert report.families["scaled_mm"].ops["mps_ext::fp8_linear"].ran
    assert torch.equal(got[1], unf[1])
    # Against the quantized model on torch's CPU ops: the MoE layer's bf16 routing apart, as in test_optimize.
    for g, w in zip(got, want):
        assert rel_err(g, w) < 0.1


def test_block_scaled_members_fuse_where_no_block_straddles_two():
    """128x128 block scales: Qwen3.5's in_proj_qkv (128 rows) and in_proj_z
    (64, last) fuse; in_proj_b and in_proj_a (4 rows each) would share a
    block with another member, so they stay apart, said so; q_proj (128
    rows, with the gate), k_proj and v_proj (32 each): q_proj and k_proj."""
    model = mps_ext.quantize_fp8(make("qwen3_5_moe"), granularity="block")
    prompt, step = ids(), ids(1, seed=2)
    want = prefill_and_decode(model, prompt, step)
    mps_ext.optimize(model)
    s = model.optimize_summary
    assert s["projections"].converted["model.layers.0.linear_attn.in_proj_qkvz"].startswith(
        "in_proj_qkv, in_proj_z -> one FP8Linear, block scales [192, 64]")
    assert s["projections"].left["model.layers.0.linear_attn.in_proj_qkv, in_proj_z, in_proj_b, in_proj_a"] == (
        "in_proj_b, in_proj_a: 128x128 block scales whose rows are not a multiple of 128 (a block would straddle "
        "two projections)")
    assert type(model.model.layers[0].linear_attn.in_proj_b) is mps_ext.FP8Linear
    assert "model.layers.1.self_attn.qk_proj" in s["projections"].converted
    with run_model(RELEASE):
        got = prefill_and_decode(model, prompt, step)
    for g, w in zip(got, want):
        assert rel_err(g, w) < 1e-5


# ----------------------------------------------------------- torch.compile --
class _Linears:
    """A torch.compile backend (aot_autograd: aten graphs) counting the
    matrix products of each graph; runs the graphs eagerly."""

    PRODUCTS = ("aten::mm", "aten::addmm", "mps_ext::fp8_linear")

    def __init__(self):
        from torch._dynamo.backends.common import aot_autograd
        self.graphs = []
        self.backend = aot_autograd(fw_compiler=self.inspect)

    def inspect(self, gm, example_inputs):
        self.graphs.append(sum(1 for n in gm.graph.nodes if n.op == "call_function" and
                               getattr(n.target, "name", lambda: "")() in self.PRODUCTS))
        return gm.forward


@mps_ext_executor.request()  # traced inside request(): the kernels' path, the one a Mac takes
@pytest.mark.parametrize("kind", ["bfloat16", "fp8"])
def test_compiled_fused_model(kind):
    """One graph for the whole model, with 3 + 2 products fewer than
    without the fusion (qwen3_5_moe: in_proj_qkv, _z, _b, _a as one;
    q_proj, k_proj, v_proj as one), and the uncompiled model's logits."""
    counts = {}
    for fuse in (False, True):
        model = make("qwen3_5_moe", torch.bfloat16)
        if kind == "fp8":
            mps_ext.quantize_fp8(model)
        with pytest.MonkeyPatch.context() as m:
            if not fuse:
                m.setattr(fused_projections, "GROUPS", ())
            mps_ext.optimize(model)
        prompt, step = ids(), ids(1, seed=2)
        want = prefill_and_decode(model, prompt, step)
        torch._dynamo.reset()
        linears = _Linears()
        got = prefill_and_decode(torch.compile(model, backend=linears.backend, fullgraph=True), prompt, step)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)
        counts[fuse] = linears.graphs
        assert all(p.shared for p in _memos(model))  # no member ever found apart from its group
    print(f"\nproducts per compiled graph, unfused -> fused: {counts[False]} -> {counts[True]}")
    assert len(counts[True]) == len(counts[False])
    assert all(f == u - 5 for f, u in zip(counts[True], counts[False])), counts


def _memos(model):
    return {id(m._memo): m._memo for m in model.modules() if isinstance(m, ProjectionRows)}.values()


# ----------------------------------------------------------- what it changes --
def test_state_dict_casts_and_a_second_optimize():
    """The state dict keeps the members' names (their rows of the fused
    weight); it loads into another optimized model; deepcopy and casts
    follow the fused weights (the members are views of them, no second
    copy); a second optimize says the groups are already fused."""
    model = make("qwen3_5_moe")
    keys = set(model.state_dict())
    mps_ext.optimize(model)
    assert set(model.state_dict()) == keys
    assert {"model.layers.0.linear_attn.in_proj_qkvzba.weight", "model.layers.1.self_attn.qkv_proj.weight"} <= \
        {n for n, _ in model.named_parameters()}
    attn = model.model.layers[1].self_attn
    assert attn.k_proj.weight.data_ptr() == attn.qkv_proj.weight[attn.q_proj.out_features:].data_ptr()
    assert mps_ext.optimize(model).optimize_summary["projections"].already == [
        "model.layers.0.linear_attn", "model.layers.1.self_attn"]
    assert not model.optimize_summary["projections"].converted
    # The shared experts' gate and up are views of their block's banks (expert 8): left where they are.
    assert all("views of the MoE kernel's banks" in why for why in model.optimize_summary["projections"].left.values())
    prompt, step = ids(), ids(1, seed=2)
    want = prefill_and_decode(model, prompt, step)
    other = mps_ext.optimize(make("qwen3_5_moe"))
    for p in other.parameters():
        p.data.zero_()
    other.load_state_dict(model.state_dict())
    for g, w in zip(prefill_and_decode(other, prompt, step), want):
        assert torch.equal(g, w)
    clone = copy.deepcopy(model).to(torch.bfloat16)
    c_attn = clone.model.layers[1].self_attn
    assert c_attn.q_proj.weight.dtype == torch.bfloat16 and c_attn.q_proj.fused is c_attn.qkv_proj
    assert c_attn.q_proj._memo is not attn.q_proj._memo
    stock = mps_ext.optimize(make("qwen3_5_moe", torch.bfloat16))
    for g, w in zip(prefill_and_decode(clone, prompt, step), prefill_and_decode(stock, prompt, step)):
        torch.testing.assert_close(g, w)


def test_quantize_fp8_after_optimize_quantizes_the_fused_layers():
    """The other order: quantize_fp8 makes each fused nn.Linear an
    FP8Linear, and the members take their rows from it."""
    model = mps_ext.optimize(make("lfm2_moe", torch.bfloat16))
    prompt, step = ids(), ids(1, seed=2)
    want = prefill_and_decode(model, prompt, step)
    mps_ext.quantize_fp8(model)
    for p, ms, f in GROUPS["lfm2_moe"]:
        assert f"{p}.{f}" in model.fp8_summary.converted["FP8Linear"]
        assert all(getattr(model.get_submodule(p), m).weight.dtype == torch.float8_e4m3fn for m in ms)
    assert group_counts(model, "lfm2_moe") == {p: (1, 1) for p, _, _ in GROUPS["lfm2_moe"]}
    with run_model(RELEASE):
        got = prefill_and_decode(model, prompt, step)
    for g, w in zip(got, want):
        assert rel_err(g, w) < 0.1  # fp8 weights


# ----------------------------------------------------------- members that do not share --
class _CrossAttention(nn.Module):
    """q_proj reads the decoder's states, k_proj and v_proj the encoder's
    (a cross-attention, as Whisper's): names of a group, inputs apart."""

    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(16, 8), nn.Linear(16, 4), nn.Linear(16, 4)

    def forward(self, x, enc):
        return torch.cat([self.q_proj(x), self.k_proj(enc), self.v_proj(enc)], -1)


class _CountLinear(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.rows = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is nn.functional.linear:
            self.rows.append(args[1].shape[0])
        return func(*args, **(kwargs or {}))


def test_members_found_reading_different_inputs_stop_sharing():
    """Each result is the member's own product whatever the inputs; after
    its output is twice computed anew before the members took it, the group
    runs each member's own rows (no product of rows nobody takes)."""
    torch.manual_seed(0)
    mod = _CrossAttention()
    want = copy.deepcopy(mod)
    mps_ext.optimize(mod)
    assert list(mod.optimize_summary["projections"].converted) == ["qkv_proj"] and mod.qkv_proj.bias.shape == (16,)
    seen = []
    for step in range(3):
        x, enc = torch.randn(2, 16), torch.randn(2, 16)
        with _CountLinear() as counted:
            got = mod(x, enc)
        torch.testing.assert_close(got, want(x, enc), rtol=0, atol=0)
        seen.append(counted.rows)
    # step 0: all rows for x (q_proj), all again for enc (k_proj, a miss), v_proj from it; step 1: q_proj
    # (the second miss) finds the group apart: each member its own rows from then on.
    assert seen == [[16, 16], [8, 4, 4], [8, 4, 4]]
    assert not mod.q_proj._memo.shared


def test_a_forward_interrupted_between_members_keeps_the_group_shared():
    """One output computed anew before all members took it (an exception
    between two members) is not enough to stop sharing."""
    torch.manual_seed(0)
    mod = mps_ext.optimize(make("qwen3_moe"))
    attn = mod.model.layers[0].self_attn
    attn.q_proj(torch.randn(1, 1, 64))  # k_proj and v_proj never called
    prompt, step = ids(), ids(1, seed=2)
    with _CountLinear() as counted:
        prefill_and_decode(mod, prompt, step)
    assert attn.q_proj._memo.shared and 128 in counted.rows and 32 not in counted.rows  # qkv; k or v alone


def test_groups_it_cannot_fuse_are_left_with_the_reason():
    """A member that is not a linear layer (the others of its group fuse),
    a member with a forward hook, members of different dtypes, with a bias
    and without, of different widths."""
    holder = nn.ModuleDict({
        "conv": nn.ModuleDict({"q_proj": nn.Linear(8, 8), "k_proj": nn.Conv1d(8, 8, 1), "v_proj": nn.Linear(8, 8)}),
        "hooked": nn.ModuleDict({"gate_proj": nn.Linear(8, 8), "up_proj": nn.Linear(8, 8)}),
        "dtypes": nn.ModuleDict({"gate_proj": nn.Linear(8, 8), "up_proj": nn.Linear(8, 8).half()}),
        "bias": nn.ModuleDict({"w1": nn.Linear(8, 8, bias=False), "w3": nn.Linear(8, 8)}),
        "width": nn.ModuleDict({"w1": nn.Linear(8, 8), "w3": nn.Linear(4, 8)}),
    })
    holder["hooked"]["up_proj"].register_forward_hook(lambda m, a, o: None)
    mps_ext.optimize(holder)
    s = holder.optimize_summary
    assert s["projections"].converted == {"conv.qv_proj": "q_proj, v_proj -> one Linear, float32 [16, 8]"}
    assert s["projections"].left == {
        "conv.q_proj, k_proj, v_proj": "k_proj is a Conv1d, not nn.Linear or FP8Linear",
        "hooked.gate_proj, up_proj": "forward hooks on up_proj",
        "dtypes.gate_proj, up_proj": "stored differently, not concatenated: gate_proj (Linear, float32, 8 inputs, "
                                     "with a bias), up_proj (Linear, float16, 8 inputs, with a bias)",
        "bias.w1, w3": "stored differently, not concatenated: w1 (Linear, float32, 8 inputs), w3 (Linear, float32, "
                       "8 inputs, with a bias)",
        "width.w1, w3": "stored differently, not concatenated: w1 (Linear, float32, 8 inputs, with a bias), w3 "
                        "(Linear, float32, 4 inputs, with a bias)"}
    assert [n for n, m in holder.named_modules() if isinstance(m, ProjectionRows)] == ["conv.q_proj", "conv.v_proj"]
    x = torch.randn(3, 8)
    torch.testing.assert_close(holder["conv"]["v_proj"](x), x @ holder["conv"]["qv_proj"].weight[8:].T +
                               holder["conv"]["qv_proj"].bias[8:], rtol=0, atol=1e-6)
