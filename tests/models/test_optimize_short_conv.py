"""mps_ext.optimize on transformers 5's LFM2 and LFM2-MoE (tiny random
configs with conv and attention layers): each conv layer's decode step on
torch.ops.mps_ext.short_conv_decode. The op gives transformers' numbers bit
for bit with its convolution in the op's arithmetic (tests/ops/
test_short_conv.py; tests/short_conv_oracle.py: torch's CPU convolution's
where oneDNN runs it with fused multiply-adds, not on every CPU), so greedy
decoding over several steps gives the same logits, bit for bit, as the
optimized model without the swap whose decode steps convolve so, and leaves
the same conv states; prefill untouched; host calls and dispatches per
layer; torch.compile; what it leaves and why."""

import copy

import pytest
import torch
import torch.nn.functional as F

import transformers

import mps_ext
import mps_ext_executor
from mps_ext_executor import run_model
from mps_ext.passes.short_conv import FusedShortConvMixin
from model_compare import RELEASE, without_passes
from short_conv_oracle import conv1d_of_the_contract
from test_optimize import COMMON, decode_counts, generate_is_unchanged_by_optimize, ids, make

T = transformers
# The dense LFM2 with the conv's bias (conv_bias: in_proj, conv and out_proj); LFM2-MoE as test_optimize's.
LFM2 = dict(vocab_size=COMMON["vocab_size"], hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64,
            layer_types=["conv", "full_attention", "conv"], conv_bias=True, tie_word_embeddings=False)
STEPS = 4


def make_any(name, dtype=torch.float32, **overrides):
    if name == "lfm2":
        torch.manual_seed(0)
        return T.Lfm2ForCausalLM(T.Lfm2Config(**{**LFM2, **overrides})).to(dtype).eval()
    return make(name, dtype, **overrides)


def conv_layers(model):
    return [m for m in model.modules() if isinstance(getattr(m, "conv", None), torch.nn.Conv1d)]


def without_swap(monkeypatch, model):
    """mps_ext.optimize(model) with everything but the short-conv swap."""
    with monkeypatch.context() as m:
        without_passes(m, "short_conv")
        return mps_ext.optimize(model)


def greedy(model, prompt, steps=STEPS, decode_conv1d=None):
    """Prefill, then `steps` greedy decode steps with the cache: (logits of
    each call, the cache). decode_conv1d: F.conv1d in the decode steps."""
    with torch.no_grad():
        out = model(prompt, use_cache=True)
        logits, cache = [out.logits], out.past_key_values
        for _ in range(steps):
            with pytest.MonkeyPatch.context() as m:
                if decode_conv1d is not None:
                    m.setattr(F, "conv1d", decode_conv1d)
                out = model(logits[-1][:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
            logits.append(out.logits)
    return logits, cache


@pytest.mark.torch_cpu_oracle  # the model's own forward on torch's CPU ops (float32's conv1d failed at SSE4.1)
@pytest.mark.parametrize("kind", ["float32", "bfloat16", "fp8"])
@pytest.mark.parametrize("name", ["lfm2", "lfm2_moe"])
def test_greedy_decode_matches_the_model_without_the_swap(monkeypatch, name, kind):
    if kind == "fp8":
        model = mps_ext.quantize_fp8(make_any(name, torch.bfloat16))
    else:
        model = make_any(name, getattr(torch, kind))
    apart = without_swap(monkeypatch, copy.deepcopy(model))
    mps_ext.optimize(model)
    layers = conv_layers(model)
    assert len(layers) == 2 and all(isinstance(m, FusedShortConvMixin) for m in layers)
    assert not any(isinstance(m, FusedShortConvMixin) for m in apart.modules())
    assert list(model.optimize_summary["short_conv"].converted) == ["model.layers.0.conv", "model.layers.2.conv"]
    prompt = ids()
    with run_model(RELEASE):
        want, theirs = greedy(apart, prompt, decode_conv1d=conv1d_of_the_contract)
    with run_model(RELEASE) as report:
        with torch.no_grad():
            prefill = model(prompt, use_cache=True).logits
        # prefill: the layer's own forward (no short_conv op has run, so the report has no such family yet)
        assert "short_conv" not in report.families or \
            "mps_ext::short_conv_decode" not in report.families["short_conv"].ops
        got, ours = greedy(model, prompt)
    # one call per conv layer per decode step
    assert report.families["short_conv"].ops["mps_ext::short_conv_decode"].ran == 2 * STEPS
    assert torch.equal(prefill, want[0])
    for step, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), (step, float((g.double() - w.double()).abs().max()))
    for i in (0, 2):
        assert torch.equal(ours.get_conv_state(i), theirs.get_conv_state(i))


def test_generate_gives_the_unoptimized_tokens():
    generate_is_unchanged_by_optimize(make_any("lfm2_moe", torch.bfloat16), "short_conv_decode",
                                      2 * 4)  # 2 layers, 4 decode steps


@pytest.mark.parametrize("name", ["lfm2", "lfm2_moe"])
def test_host_calls_and_dispatches_per_conv_layer(name):
    model = make_any(name, torch.bfloat16)
    before = [(c, d) for _, c, d in decode_counts(model, conv_layers(model)[:1])]
    mps_ext.optimize(model)
    after = [(c, d) for _, c, d in decode_counts(model, conv_layers(model)[:1])]
    ops = decode_counts.ops
    print(f"\n{name} conv layer bf16, per decoded token (host calls, dispatches): before {before}, after {after}")
    # short_conv_decode, out_proj; in_proj's product comes with the decoder layer's input norm, one
    # rms_norm_linear dispatch of the layer's (test_optimize_decoder.py)
    assert after == [(2, 2)]
    assert ops.get("mps_ext::short_conv_decode") == 1
    # Before: the two GEMVs are the executor's dispatches; the mul, cat, copy_, conv1d and mul between are
    # torch's (host calls here, a dispatch each on MPS).
    assert before == [(7, 2)]


def test_summary_idempotent_and_state_dict():
    model = make_any("lfm2_moe")
    keys = {k for k in model.state_dict() if ".conv." in k}
    mps_ext.optimize(model)
    summary = model.optimize_summary
    assert "short_conv_decode" in str(summary) and "model.layers.0.conv" in str(summary)
    assert not summary["short_conv"].left
    assert {k for k in model.state_dict() if ".conv." in k} == keys  # the conv layers' own, as they were
    assert type(conv_layers(model)[0]).__name__ == "FusedLfm2MoeShortConv"
    mps_ext.optimize(model)
    assert model.optimize_summary["short_conv"].already == ["model.layers.0.conv", "model.layers.2.conv"]
    assert not model.optimize_summary["short_conv"].converted
    clone = copy.deepcopy(model).to(torch.bfloat16)
    assert isinstance(conv_layers(clone)[0], FusedShortConvMixin) and conv_layers(clone)[0].conv.weight.dtype == \
        torch.bfloat16


def test_layers_it_cannot_run_are_left_with_the_reason():
    """A window past the kernel's 4 taps; a forward that does something else (the probe)."""
    model = make_any("lfm2", conv_L_cache=5)
    mps_ext.optimize(model)
    left = model.optimize_summary["short_conv"].left
    assert list(left) == ["model.layers.0.conv", "model.layers.2.conv"] and "at most 4" in left["model.layers.0.conv"]

    class Gated(T.models.lfm2.modeling_lfm2.Lfm2ShortConv):
        def forward(self, hidden_states, past_key_values=None, attention_mask=None, **kwargs):
            return torch.tanh(super().forward(hidden_states, past_key_values, attention_mask, **kwargs))

    model = make_any("lfm2")
    layer = model.model.layers[0].conv
    layer.__class__ = Gated
    prompt = ids()
    want = model(prompt).logits
    mps_ext.optimize(model)
    assert type(layer) is Gated
    assert "differs" in model.optimize_summary["short_conv"].left["model.layers.0.conv"]
    assert list(model.optimize_summary["short_conv"].converted) == ["model.layers.2.conv"]
    torch.testing.assert_close(model(prompt).logits, want)


def test_dtype_the_kernel_does_not_take_is_an_error():
    model = make_any("lfm2").double()
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        mps_ext.optimize(model)


# ----------------------------------------------------------- torch.compile --
@mps_ext_executor.request()  # traced inside request(): the kernels' path, the one a Mac takes
def test_compiled_optimized_model():
    """Compiled, the decode step is the op in the graph, and gives eager's logits bit for bit."""
    from test_optimize_deltanet import _Inspector
    model = mps_ext.optimize(make_any("lfm2", torch.bfloat16))
    prompt = ids()
    want, _ = greedy(model, prompt, 2)
    torch._dynamo.reset()
    inspector = _Inspector()
    got, _ = greedy(torch.compile(model, backend=inspector.backend), prompt, 2)
    assert "short_conv_decode" in inspector.ops
    for g, w in zip(got, want):
        assert torch.equal(g, w)
