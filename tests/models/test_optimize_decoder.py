"""mps_ext.optimize's decoder layers (mps_ext/passes/decoder.py) on
transformers 5's tiny qwen3_moe, qwen3_5_moe (linear and full attention),
lfm2_moe (short convolutions, a dense first layer), and the dense qwen3
and lfm2: the residual add and the post-attention norm are one
torch.ops.mps_ext.add_rms_norm call, a FusedMoE takes the second residual;
logits against the same model optimized without the swap (bit for bit)
and within the model tests' bound of float64, float and fp8, prefill,
torch.compile; host calls and dispatches per layer in the census; what it
leaves and why."""

import copy

import pytest
import torch

import transformers

import mps_ext
import mps_ext_executor
from mps_ext_executor import run_model
from mps_ext.passes.decoder import FusedDecoderLayerMixin
from mps_ext.passes.short_conv import FusedShortConvMixin
from model_compare import RELEASE, without_passes
from test_optimize import (MODELS, ids, make, optimized_against_stock_and_float64, prefill_and_decode,
                           quantized_against_stock_and_float64)

T = transformers
# Dense models of the same layers (test_optimize's MODELS holds the MoE ones).
NO_EXPERTS = dict(experts_implementation=None)  # test_optimize's COMMON sets one, which a dense model refuses
DENSE = {"qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM, NO_EXPERTS),
         "lfm2": (T.Lfm2Config, T.Lfm2ForCausalLM, dict(layer_types=["conv", "full_attention"], **NO_EXPERTS))}
# Per model, its decoder layers (the tiny configs) and their class.
LAYERS = {"qwen3_moe": (2, "Qwen3MoeDecoderLayer"), "qwen3_5_moe": (2, "Qwen3_5MoeDecoderLayer"),
          "lfm2_moe": (3, "Lfm2MoeDecoderLayer"), "qwen3": (2, "Qwen3DecoderLayer"), "lfm2": (2, "Lfm2DecoderLayer")}


@pytest.fixture(autouse=True)
def dense_models(monkeypatch):
    for name, spec in DENSE.items():
        monkeypatch.setitem(MODELS, name, spec)


def decoder_layers(model):
    return [n for n, m in model.named_modules() if isinstance(m, FusedDecoderLayerMixin)]


def without_swap(monkeypatch, model):
    """mps_ext.optimize(model) with everything but the decoder swap."""
    with monkeypatch.context() as m:
        without_passes(m, "decoder_layers")
        return mps_ext.optimize(model)


def ran(report, op, family="norm"):
    stats = report.families[family].ops.get(f"mps_ext::{op}") if family in report.families else None
    return stats.ran if stats else 0


def add_norms(report):
    """The layers' residual adds and post-attention norms run as one
    dispatch: add_rms_norm, or a MoE layer's in its router's GEMV
    (add_rms_norm_moe_layer)."""
    return ran(report, "add_rms_norm") + ran(report, "add_rms_norm_moe_layer", "moe")


# ----------------------------------------------------------- results --
@pytest.mark.parametrize("kind", ["float32", "bfloat16", "fp8"])
@pytest.mark.parametrize("name", list(LAYERS))
def test_swapped_layers_match_the_model_without_them(figures, monkeypatch, name, kind):
    """Decode and prefill logits bit-identical to the optimized model
    without the swap (the sum is torch's add, the norm rms_norm's of it);
    against float64 within the model tests' bound; one add_rms_norm per
    layer and forward in place of one rms_norm."""
    count, cls = LAYERS[name]
    if kind == "fp8":
        model, prompt, step, ref, stock = quantized_against_stock_and_float64(name)
        apart = without_swap(monkeypatch, copy.deepcopy(model))
        mps_ext.optimize(model)
        dtype = torch.bfloat16
    else:
        dtype = getattr(torch, kind)
        model, prompt, step, ref, stock = optimized_against_stock_and_float64(name, dtype)
        apart = without_swap(monkeypatch, make(name, dtype))
    s = model.optimize_summary
    layers = [f"model.layers.{i}" for i in range(count)]
    assert (
        decoder_layers(model) == layers
        and list(s["decoder_layers"].converted) == layers
        and not s["decoder_layers"].left
    )
    assert all(what.startswith(f"{cls} -> ") for what in s["decoder_layers"].converted.values()), s[
        "decoder_layers"
    ].converted
    assert f"optimize: {count} decoder layers" in str(s)
    assert not decoder_layers(apart) and "decoder_layers" not in apart.optimize_summary.sections
    with run_model(RELEASE) as report:
        ours = prefill_and_decode(model, prompt, step)
    with run_model(RELEASE) as theirs_report:
        theirs = prefill_and_decode(apart, prompt, step)
    figures.families = report.ran_kernels()
    assert add_norms(report) == 2 * count and not add_norms(theirs_report)
    # (An input norm the layer runs in its mixer's projection GEMV, rms_norm_linear, is no rms_norm call
    # either: test_input_norm_in_the_projection_gemv_changes_no_bit.)
    in_gemv = sum(report.families[f].ops[op].ran for f, op in (("linear", "mps_ext::rms_norm_linear"),
                                                                ("scaled_mm", "mps_ext::rms_norm_fp8_linear"))
                  if f in report.families and op in report.families[f].ops)
    assert ran(theirs_report, "rms_norm") - ran(report, "rms_norm") == 2 * count + in_gemv
    assert torch.equal(ours[0], theirs[0])
    assert torch.equal(ours[1], theirs[1])
    for what, i in (("prefill", 0), ("decode", 1)):
        figures.no_worse(what, ours[i], stock[i], ref[i], dtype)


def test_cpu_tensors_without_the_executor_run_the_layers_own_forward(monkeypatch):
    """Outside the model runner (plain CPU tensors, no kernels): each layer
    runs its own forward, so the logits are the unswapped model's bit for
    bit and no op of mps_ext is called."""
    model = mps_ext.optimize(make("qwen3_5_moe", torch.bfloat16))
    apart = without_swap(monkeypatch, make("qwen3_5_moe", torch.bfloat16))
    prompt, step = ids(), ids(1, seed=2)
    assert decoder_layers(model)
    for g, w in zip(prefill_and_decode(model, prompt, step), prefill_and_decode(apart, prompt, step)):
        assert torch.equal(g, w)


# ----------------------------------------------------------- host calls and dispatches --
@pytest.mark.parametrize("model_name", ["Qwen3-30B-A3B", "Qwen3.6-35B-A3B", "LFM2.5-8B-A1B"])
def test_a_layer_decodes_one_add_rms_norm_for_an_add_and_a_norm(monkeypatch, model_name):
    """benchmarks/census.py, one decode token after 8 of context, torch
    2.15's policy, every kind of layer (attention, DeltaNet, convolution;
    MoE and dense): eager, the layer's add and rms_norm after its mixer are
    one add_rms_norm call of one dispatch (a MoE layer's: in its router's
    GEMV, the add_rms_norm_moe_layer call of the block), a MoE layer's add
    after its feed-forward is in moe_layer's last dispatch, and an attention or
    DeltaNet layer's input norm is in its projection's GEMV; compiled, the
    same ops run (test_compiled_swapped_model), and the layer saves the
    input norm's generated kernel and a MoE layer's trailing add and its
    post-attention norm's generated kernel (in the router's dispatch), a
    dense layer's first add being one generated kernel with the
    post-attention norm before as after."""
    from benchmarks import census
    tiny = census.tiny_model(census.MODELS[model_name])

    def per_kind(transform):
        return census.per_kind(census.trace_step(tiny, tokens=1, context=8, torch_release="2.15",
                                                 transform=transform), tiny.config)

    with monkeypatch.context() as m:
        without_passes(m, "decoder_layers")
        before = per_kind(mps_ext.optimize)
    after = per_kind(mps_ext.optimize)
    kinds = set(census.layer_kinds(tiny.config))  # not the calls before and after the layers
    assert kinds and kinds <= set(before) and kinds <= set(after)
    for kind in sorted(kinds):
        layer = after[kind]
        ops = [c.op for c in layer]
        old = [c.op for c in before[kind]]
        moe = kind.endswith("+moe")
        # A MoE layer's add and norm go into its router's GEMV (add_rms_norm_moe_layer: one call for
        # add_rms_norm and moe_layer, one dispatch fewer).
        fused = "add_rms_norm_moe_layer" if moe else "add_rms_norm"
        assert ops.count(fused) == 1 and fused not in old, (kind, ops)
        assert "moe_layer" not in ops and "add_rms_norm" not in ops if moe else True, (kind, ops)
        # The input norm of an attention or DeltaNet layer goes into its fused projection's GEMV, and a
        # short convolution's into its in_proj's at a decode step (rms_norm_linear: one call and dispatch
        # for rms_norm and linear).
        in_gemv = ops.count("rms_norm_linear")
        assert in_gemv == 1, (kind, ops)
        assert old.count("rms_norm") - ops.count("rms_norm") == 1 + in_gemv, (kind, ops)
        assert old.count("linear") - ops.count("linear") == in_gemv, (kind, ops)
        # A MoE layer's second residual add moves into moe_layer's last dispatch (FusedMoE's residual).
        adds = 2 if moe else 1
        assert old.count("add") - ops.count("add") == adds, (kind, ops)
        saved = adds + in_gemv + (1 if moe else 0)
        b, a = ({mode: census.count(calls, "2.15", mode, True) for mode in census.MODES}
                for calls in (before[kind], layer))
        print(f"\n{model_name} {kind}, per layer eager: host calls {b['eager'].host:g} -> {a['eager'].host:g}, "
              f"dispatches {b['eager'].dispatches:g} -> {a['eager'].dispatches:g}")
        assert b["eager"].host - a["eager"].host == saved and b["eager"].dispatches - a["eager"].dispatches == saved
        # Compiled: Inductor would have fused the first add into the post-attention norm's kernel, so only
        # the input norm's kernel and a MoE layer's trailing add and that kernel (in the router's dispatch)
        # are saved.
        saved = in_gemv + (2 if moe else 0)
        print(f"{model_name} {kind}, per layer compiled: dispatches {b['compile'].dispatches:g} -> "
              f"{a['compile'].dispatches:g}")
        assert b["compile"].dispatches - a["compile"].dispatches == saved
        assert b["compile"].host - a["compile"].host == saved


# ----------------------------------------------------------- torch.compile --
@mps_ext_executor.request()  # traced inside request(): the kernels' path, the one a Mac takes
@pytest.mark.parametrize("name", ["qwen3_moe", "lfm2_moe"])
def test_compiled_swapped_model(name):
    """One graph for the whole model (fullgraph), the uncompiled model's
    logits; the graph holds the decoder layers' fused path as eager runs it
    (mps_ext.passes.norm, FusedRMSNorm.op_takes' `compiled`): add_rms_norm
    in every layer, the input norm in the first projection's GEMV
    (rms_norm_linear, at the decode step for a convolution layer) and the
    MoE layers' add and norm in the router's dispatch and second add in the
    down product's (add_rms_norm_moe_layer; lfm2_moe's dense layer
    add_rms_norm)."""
    from test_fp8_flows import Float8Inspector
    model = mps_ext.optimize(make(name, torch.bfloat16))
    assert decoder_layers(model)
    prompt, step = ids(), ids(1, seed=2)
    want = prefill_and_decode(model, prompt, step)
    torch._dynamo.reset()
    inspector = Float8Inspector()
    got = prefill_and_decode(torch.compile(model, backend=inspector.backend, fullgraph=True), prompt, step)
    fused = {"rms_norm_linear", "add_rms_norm_moe_layer"} | ({"add_rms_norm"} if name == "lfm2_moe" else set())
    assert fused <= inspector.mps_ext_ops, inspector.mps_ext_ops
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


# ----------------------------------------------------------- what it changes and leaves --
def test_state_dict_module_tree_and_a_second_optimize(monkeypatch):
    """The swap keeps parameters, state dict keys and children; a second
    optimize says the layers are already converted; a deepcopy and a cast
    keep the fused forward; positional arguments bind as the layer's own
    forward binds them."""
    model = make("lfm2_moe")
    without = without_swap(monkeypatch, copy.deepcopy(model))
    mps_ext.optimize(model)
    assert set(model.state_dict()) == set(without.state_dict())
    layer = model.model.layers[1]
    assert [n for n, _ in layer.named_children()] == [n for n, _ in without.model.layers[1].named_children()]
    assert (
        type(layer).__name__ == "FusedLfm2MoeDecoderLayer" and type(layer).__mro__[2].__name__ == "Lfm2MoeDecoderLayer"
    )
    mps_ext.optimize(model)
    assert model.optimize_summary["decoder_layers"].already == [f"model.layers.{i}" for i in range(3)]
    assert not model.optimize_summary["decoder_layers"].converted
    clone = copy.deepcopy(model).to(torch.bfloat16)
    assert decoder_layers(clone) == [f"model.layers.{i}" for i in range(3)]
    prompt, step = ids(), ids(1, seed=2)
    with run_model(RELEASE) as report:
        prefill_and_decode(clone, prompt, step)
    assert add_norms(report) == 2 * 3
    # A conv layer called positionally (hidden_states, position_embeddings, attention_mask): the same output.
    x = torch.randn(1, 3, 64, generator=torch.Generator().manual_seed(3))
    conv = model.model.layers[0]
    with torch.no_grad(), run_model(RELEASE):
        got = conv(x, None, None)
        want = type(conv).__mro__[2].forward(conv, x, None, None)
    assert torch.equal(got, want)


class _ScaledResidualLayer(transformers.models.qwen3.modeling_qwen3.Qwen3DecoderLayer):
    """A layer that scales its residual stream (as some models do): the
    fused forward would not."""

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False,
                position_embeddings=None, **kwargs):
        return super().forward(hidden_states, attention_mask, position_ids, past_key_values, use_cache,
                               position_embeddings, **kwargs) * 0.5


class _MaskDroppingLayer(transformers.models.qwen3.modeling_qwen3.Qwen3DecoderLayer):
    """A layer that calls its attention without the mask (another call than
    the fused forward's)."""

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False,
                position_embeddings=None, **kwargs):
        return super().forward(hidden_states, None, position_ids, past_key_values, use_cache, position_embeddings,
                               **kwargs)


def test_layers_it_does_not_know_are_left_with_the_reason():
    """A forward that computes something else (the probe's output), one
    that calls its mixer otherwise (the probe's mixer call), a child it does
    not know, norms that are not RMSNorms, a forward of other arguments:
    each left with the reason, and the model computes what it did."""
    config = make("qwen3").config
    Layer = transformers.models.qwen3.modeling_qwen3.Qwen3DecoderLayer
    scaled, masked, extra, layernorm = (_ScaledResidualLayer(config, 0), _MaskDroppingLayer(config, 0),
                                        Layer(config, 0), Layer(config, 0))
    extra.adapter = torch.nn.Linear(64, 64)
    layernorm.post_attention_layernorm = torch.nn.LayerNorm(64)
    holder = mps_ext.optimize(torch.nn.ModuleDict({"scaled": scaled, "masked": masked, "extra": extra,
                                                   "layernorm": layernorm}))
    left = holder.optimize_summary["decoder_layers"].left
    assert left["scaled"] == ("its output differs on a probe: its forward does something else than the residual "
                              "adds and norms")
    assert left["masked"].startswith("its forward calls self_attn otherwise than optimize would"), left["masked"]
    assert left["extra"] == ("it holds adapter beside its norms, self_attn and mlp (optimize knows no such layer)")
    assert left["layernorm"] == ("its input_layernorm and post_attention_layernorm (FusedRMSNorm, LayerNorm) are "
                                 "not RMSNorms optimize fuses")
    assert not decoder_layers(holder) and not hasattr(scaled, "_mps_ext_decoder")
    assert "0 decoder layers" in str(holder.optimize_summary) and "4 left" in str(holder.optimize_summary)


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_5_moe", "lfm2_moe"])
def test_arguments_bind_as_the_forwards_signature_binds_them(name):
    """The swapped forward binds the caller's arguments with a precomputed
    map (_Plan.bind) instead of inspect.Signature.bind (about 7 us a layer
    and token): for positional, keyword, extra-keyword and defaulted
    calls the same arguments as Signature.bind with its defaults applied;
    None for the calls Signature.bind refuses (an argument given twice, too
    many positions, a required one missing)."""
    model = mps_ext.optimize(make(name, torch.float32))
    layer = next(m for m in model.modules() if isinstance(m, FusedDecoderLayerMixin))
    plan = layer._mps_ext_decoder
    x, a, b = object(), object(), object()
    first, second = plan.positional[1:3]
    calls = [((x,), {}), ((), {"hidden_states": x}), ((x, a), {}), ((x, a, b), {}), ((x,), {second: b}),
             ((x,), {"output_attentions": a, second: b}), ((), {"hidden_states": x, first: a, "extra": b}),
             ((x, a), {first: b}), ((x,) * (len(plan.positional) + 1), {}), ((), {first: a})]
    for args, kwargs in calls:
        try:
            bound = plan.signature.bind(layer, *args, **kwargs)
        except TypeError:
            assert plan.bind(args, kwargs) is None, (args, kwargs)
            continue
        bound.apply_defaults()
        want = dict(bound.arguments)
        del want["self"]
        got = plan.bind(args, kwargs)
        assert got is not None and got.keys() == want.keys(), (args, kwargs)
        assert all(got[k] is want[k] or got[k] == want[k] for k in want), (args, kwargs)


# ------------------------------------------------- the input norm in the GEMV --
def total_dispatches(report):
    return sum(f.dispatches for f in report.families.values())


def _logits_tokens_report(model, prompt, step):
    """Prefill and decode logits, 4 greedy tokens, and the run's report, on
    mps_ext's kernels (run_model)."""
    with torch.no_grad(), run_model(RELEASE) as report:
        logits = prefill_and_decode(model, prompt, step)
        tokens = model.generate(prompt, max_new_tokens=4, do_sample=False)
    return logits, tokens, report


# (Block scales: qwen3_5_moe's, whose tiny q/k/v rows are whole 128-row blocks; the others' groups stay apart
# under block scales, _block_members.)
@pytest.mark.parametrize("name,kind", [(name, kind) for name in ("qwen3_moe", "qwen3_5_moe", "lfm2_moe")
                                       for kind in ("float32", "bfloat16", "bfloat16 fp8 row", "float32 fp8 tensor")]
                         + [("qwen3_5_moe", "bfloat16 fp8 block")])
def test_input_norm_in_the_projection_gemv_changes_no_bit(monkeypatch, name, kind):
    """A decoder layer whose mixer reads its input norm through a fused
    floating q/k/v or in_proj GEMV (qwen3_moe's and lfm2_moe's attention,
    qwen3_5_moe's attention and Gated DeltaNet) runs the norm and that GEMV
    as one rms_norm_linear dispatch at up to 8 rows, and lfm2_moe's short
    convolution its in_proj so at its decode steps (one token; a prompt runs
    the layer's own forward): prefill and decode logits and greedy tokens
    bit-identical to the same optimized model with the norm and the GEMV
    apart (norm_into_projection replaced by the norm), one dispatch fewer
    per such layer and call. So too after mps_ext.quantize_fp8 (each
    granularity; the projection an FP8Linear): one rms_norm_fp8_linear
    dispatch."""
    from mps_ext.passes import decoder
    dtype, *fp8 = kind.split()
    model = make(name, getattr(torch, dtype))
    if fp8:
        mps_ext.quantize_fp8(model, granularity=fp8[1])
    mps_ext.optimize(model)
    prompt, step = ids(), ids(1, seed=2)
    groups = [getattr(getattr(m, n, None), p, None) for m in model.modules() if isinstance(m, FusedDecoderLayerMixin)
              for n in ("self_attn", "linear_attn") for p in ("q_proj", "in_proj_qkv")]
    groups = [g for g in groups if isinstance(g, mps_ext.passes.projections.ProjectionRows)]
    readers = len(groups)
    assert readers == {"qwen3_moe": 2, "qwen3_5_moe": 2, "lfm2_moe": 1}[name]
    assert all(isinstance(g.fused, mps_ext.FP8Linear if fp8 else torch.nn.Linear) for g in groups)
    convs = [m.conv for m in model.modules() if isinstance(getattr(m, "conv", None), FusedShortConvMixin)]
    assert len(convs) == {"qwen3_moe": 0, "qwen3_5_moe": 0, "lfm2_moe": 2}[name]
    assert all(isinstance(c.in_proj, mps_ext.FP8Linear if fp8 else torch.nn.Linear) for c in convs)

    ours, our_tokens, report = _logits_tokens_report(model, prompt, step)
    with monkeypatch.context() as m:
        m.setattr(decoder, "norm_into_projection", lambda x, norm, mixer: norm(x))
        theirs, their_tokens, their_report = _logits_tokens_report(model, prompt, step)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    assert torch.equal(our_tokens, their_tokens)
    # Calls: the prefill and decode forwards, then generate's prefill and 3 decodes (the prompt's 6 rows
    # take the kernel too: at most 8); a short convolution's 4 decodes.
    calls = readers * 6 + len(convs) * 4
    family, op = ("scaled_mm", "mps_ext::rms_norm_fp8_linear") if fp8 else ("linear", "mps_ext::rms_norm_linear")
    fused = report.families[family].ops[op].ran
    assert fused == calls and op not in their_report.families[family].ops
    assert total_dispatches(their_report) - total_dispatches(report) == calls


# ------------------------------------------------- the add and norm in the MoE router --
# The MoE layers of each tiny model (test_optimize's configs).
MOE_LAYERS = {"qwen3_moe": 2, "qwen3_5_moe": 2, "lfm2_moe": 2}


@pytest.mark.parametrize("name,kind", [(name, kind) for name in MOE_LAYERS
                                       for kind in ("float32", "bfloat16", "float16", "bfloat16 fp8")])
def test_add_norm_in_the_moe_router_changes_no_bit(monkeypatch, name, kind):
    """A MoE decoder layer runs its residual add, its post-attention norm
    and its router's GEMV as one add_rms_norm_moe_layer call (the add and
    the norm in the router's dispatch) at up to 8 rows: prefill and decode
    logits and greedy tokens bit-identical to the same optimized model with
    add_rms_norm and moe_layer apart (FusedMoEMixin._mps_ext_add_norm_call
    declining), one dispatch fewer per MoE layer and call; so too after
    mps_ext.quantize_fp8 (fp8 expert banks)."""
    from mps_ext.passes.moe import FusedMoEMixin
    dtype, *fp8 = kind.split()
    model = make(name, getattr(torch, dtype))
    if fp8:
        mps_ext.quantize_fp8(model)
    mps_ext.optimize(model)
    prompt, step = ids(), ids(1, seed=2)
    moe = sum(isinstance(getattr(m, n, None), FusedMoEMixin) for m in model.modules()
              if isinstance(m, FusedDecoderLayerMixin) for n in ("mlp", "feed_forward"))
    assert moe == MOE_LAYERS[name]

    ours, our_tokens, report = _logits_tokens_report(model, prompt, step)
    with monkeypatch.context() as m:
        m.setattr(FusedMoEMixin, "_mps_ext_add_norm_call", lambda self, x, residual, norm: None)
        theirs, their_tokens, their_report = _logits_tokens_report(model, prompt, step)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    assert torch.equal(our_tokens, their_tokens)
    # Calls: the prefill and decode forwards, then generate's prefill and 3 decodes (the prompt's 6 rows
    # take the kernel too: at most 8).
    calls = moe * 6
    fused = "add_rms_norm_moe_layer"
    assert ran(report, fused, "moe") == calls and not ran(their_report, fused, "moe")
    assert ran(their_report, "moe_layer", "moe") - ran(report, "moe_layer", "moe") == calls
    assert ran(their_report, "add_rms_norm") - ran(report, "add_rms_norm") == calls
    assert total_dispatches(their_report) - total_dispatches(report) == calls
