"""mps_ext.optimize on transformers 5's own MoE models (tiny random configs):
results against stock torch and float64, host calls and dispatches per MoE
layer per decoded token before and after, fp8, what it leaves and why,
idempotence, casts, state_dict, torch.compile, bad input."""

import collections
import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import transformers

import mps_ext
from mps_ext import FP8Experts
import mps_ext_executor
from mps_ext_executor import run_model
from mps_ext.passes.moe import FusedMoEMixin
from mps_ext.passes.norm import FusedRMSNorm
from model_compare import RELEASE

T = transformers
COMMON = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=64, tie_word_embeddings=False, intermediate_size=128,
              num_experts_per_tok=2, experts_implementation="grouped_mm")
LINEAR_ATTENTION = dict(layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4,
                        linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                        linear_num_value_heads=4)
MODELS = {
    "qwen3_moe": (T.Qwen3MoeConfig, T.Qwen3MoeForCausalLM,
                  dict(moe_intermediate_size=32, num_experts=8, norm_topk_prob=True)),
    # A shared expert of the experts' size (Qwen3.5/3.6-MoE): fused as expert 8.
    "qwen3_5_moe": (T.Qwen3_5MoeTextConfig, T.Qwen3_5MoeForCausalLM,
                    dict(moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=8,
                         **LINEAR_ATTENTION)),
    "olmoe": (T.OlmoeConfig, T.OlmoeForCausalLM, dict(num_experts=8, intermediate_size=32, eos_token_id=1)),
    "mixtral": (T.MixtralConfig, T.MixtralForCausalLM, dict(num_local_experts=8, intermediate_size=32)),
    # A sigmoid router with an expert bias; short convolutions; the first layer dense.
    "lfm2_moe": (T.Lfm2MoeConfig, T.Lfm2MoeForCausalLM,
                 dict(moe_intermediate_size=32, num_experts=8, num_dense_layers=1, num_hidden_layers=3,
                      layer_types=["conv", "full_attention", "conv"])),
}
PROMPT = 6


@pytest.fixture(autouse=True)
def _moe_blocks_make_their_own_call(monkeypatch):
    """This file counts each MoE block's own moe_layer call and the decoder
    layers' add_rms_norm. The decoder pass's add + norm in the router's
    dispatch (add_rms_norm_moe_layer, which the layer calls on the block's
    behalf: tests/models/test_optimize_decoder.py and
    tests/ops/test_add_rms_norm_moe_layer.py test it) folds both into one
    call, so it is off here."""
    monkeypatch.setattr(FusedMoEMixin, "_mps_ext_add_norm_call", lambda self, x, residual, norm: None)


def make(name, dtype=torch.float32, **overrides):
    config_class, model_class, extra = MODELS[name]
    torch.manual_seed(0)
    return model_class(config_class(**{**COMMON, **extra, **overrides})).to(dtype).eval()


def ids(n=PROMPT, seed=1):
    return torch.randint(1, COMMON["vocab_size"], (1, n), generator=torch.Generator().manual_seed(seed))


def prefill_and_decode(model, prompt, step):
    with torch.no_grad():
        out = model(prompt, use_cache=True)
        return out.logits, model(step, past_key_values=out.past_key_values, use_cache=True).logits


def generate_is_unchanged_by_optimize(model, op, runs, tokens=5, prompt=PROMPT):
    """Greedy generate() of `tokens` after a prompt of `prompt` tokens gives
    the same tokens after mps_ext.optimize(model) (each step reading the
    states the one before wrote in place), with mps_ext's own `op` run
    `runs` times (counted in its family, the one that lists it)."""
    prompt = ids(prompt)
    with torch.no_grad():
        want = model.generate(prompt, max_new_tokens=tokens, do_sample=False)
    mps_ext.optimize(model)
    with torch.no_grad(), run_model(RELEASE) as report:
        got = model.generate(prompt, max_new_tokens=tokens, do_sample=False)
    family = next(f for f in mps_ext.families() if f"mps_ext::{op}" in mps_ext._C.family_own_ops(f))
    assert report.families[family].ops[f"mps_ext::{op}"].ran == runs
    assert torch.equal(got, want)


def reference(model):
    """The unoptimized model in float64, each expert its own matmul (torch's
    _grouped_mm takes no float64)."""
    ref = copy.deepcopy(model).double()
    if any(hasattr(m, "experts") for m in ref.modules()):  # a dense model has no implementation to set
        ref.set_experts_implementation("eager")
    return ref


def optimized_against_stock_and_float64(name, dtype, **overrides):
    """The tiny `name` model (config `overrides`) three ways: (model,
    prompt, step, ref, stock): `ref` the float64 reference's (prefill,
    decode) logits, `stock` the model's in `dtype` on torch's ops, `model`
    that model after mps_ext.optimize; the decoded token is the reference's."""
    model = make(name, **overrides)
    prompt = ids()
    ref_model = reference(model)
    step = ref_model(prompt).logits[:, -1:].argmax(-1)
    ref = prefill_and_decode(ref_model, prompt, step)
    model = model.to(dtype)
    stock = prefill_and_decode(model, prompt, step)
    mps_ext.optimize(model)
    return model, prompt, step, ref, stock



def quantized_against_stock_and_float64(name, **overrides):
    """The tiny `name` model (config `overrides`) in bf16 after
    quantize_fp8, not yet optimized: (model, prompt, step, ref, stock) as
    optimized_against_stock_and_float64 gives them, `ref` from the float64
    model holding the fp8 weights."""
    from test_fp8_flows import oracle_of
    original = make(name, torch.bfloat16, **overrides)
    model = mps_ext.quantize_fp8(copy.deepcopy(original))
    ref_model = reference(oracle_of(model, original))
    prompt = ids()
    step = ref_model(prompt).logits[:, -1:].argmax(-1)
    return model, prompt, step, prefill_and_decode(ref_model, prompt, step), prefill_and_decode(model, prompt, step)


def layer_calls(report) -> int:
    """Whole MoE layers run from one call: moe_layer, or, with the decoder
    layer's residual add and post-attention norm in its router's dispatch,
    add_rms_norm_moe_layer (mps_ext.passes.decoder)."""
    ops = report.families["moe"].ops
    return sum(ops[op].ran for op in ("mps_ext::moe_layer", "mps_ext::add_rms_norm_moe_layer") if op in ops)


def blocks(model):
    return [n for n, m in model.named_modules() if isinstance(m, FusedMoEMixin)]


def kernel(block):
    """What moe_layer reads for an optimized MoE block (mps_ext.passes.moe._Kernel)."""
    return block._mps_ext_moe


def rel_err(x, ref):
    return float((x.double() - ref.double()).abs().max() / ref.double().abs().max())


# ----------------------------------------------------------- results --
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_5_moe"])
def test_optimized_model_matches_stock_and_float64(figures, name, dtype):
    model, prompt, step, ref, stock = optimized_against_stock_and_float64(name, dtype)
    assert len(blocks(model)) == 2 and not model.optimize_summary["moe"].left
    # CPU tensors outside the runner: torch's own ops, the stock model's math.
    for s, o in zip(stock, prefill_and_decode(model, prompt, step)):
        assert rel_err(o, s) <= (1e-5 if dtype == torch.float32 else 2e-2)
    with run_model(RELEASE) as report:
        ours = prefill_and_decode(model, prompt, step)
    figures.families = report.ran_kernels()
    assert layer_calls(report) == 2 * 2  # 2 layers, prefill and decode
    for what, i in (("prefill", 0), ("decode", 1)):
        figures.no_worse(what, ours[i], stock[i], ref[i], dtype)


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_5_moe"])
def test_optimized_fp8_model_matches_the_quantized_one(figures, name):
    """quantize_fp8, then optimize: the kernels' decode against the
    quantized model on torch's CPU ops (the kernels' math), both against
    the float64 model holding the fp8 weights."""
    model, prompt, step, ref, stock = quantized_against_stock_and_float64(name)
    mps_ext.optimize(model)
    assert all(isinstance(model.get_submodule(n).experts, FP8Experts) for n in blocks(model)) and blocks(model)
    with run_model(RELEASE) as report:
        ours = prefill_and_decode(model, prompt, step)
    figures.families = report.ran_kernels()
    assert layer_calls(report) == 4
    for what, i in (("prefill", 0), ("decode", 1)):
        figures.no_worse(what, ours[i], stock[i], ref[i], torch.bfloat16)


@pytest.mark.parametrize("name,renormalised", [("olmoe", False), ("mixtral", True)])
def test_other_softmax_top_k_blocks(name, renormalised):
    """OLMoE keeps the top-k softmax weights as they are, Mixtral
    renormalises them: read off the router's output, not its class."""
    model = make(name)
    prompt, step = ids(), ids(1, seed=2)
    want = prefill_and_decode(model, prompt, step)
    mps_ext.optimize(model)
    assert len(model.optimize_summary["moe"].converted) == 2 and not model.optimize_summary["moe"].left
    assert all(kernel(model.get_submodule(n)).renormalize == renormalised for n in blocks(model))
    with run_model(RELEASE) as report:
        got = prefill_and_decode(model, prompt, step)
    assert layer_calls(report) == 4
    for g, w in zip(got, want):
        assert rel_err(g, w) < 1e-5


@pytest.mark.parametrize("kind", ["bfloat16", "fp8"])
def test_prefill_past_the_fused_limit_takes_the_grouped_path(monkeypatch, kind):
    """Past moe_layer's token slots (1024; 4 here) the block's own forward
    runs: the routing is torch's and the experts the grouped products,
    _grouped_mm (bf16) or FP8Experts' fp8 prefill op; the decode step stays
    one moe_layer call per layer."""
    import mps_ext.passes.moe as fused_moe
    model = make("qwen3_5_moe", torch.bfloat16)
    if kind == "fp8":
        mps_ext.quantize_fp8(model)
    prompt, step = ids(), ids(1, seed=2)
    want = prefill_and_decode(model, prompt, step)
    mps_ext.optimize(model)
    monkeypatch.setattr(fused_moe, "MAX_SLOTS", 4)
    monkeypatch.setattr(FP8Experts, "DECODE_ROWS", 4)
    with run_model(RELEASE) as report:
        got = prefill_and_decode(model, prompt, step)
    moe, ops = report.families["moe"].ops, report.families["grouped_mm"].ops
    assert layer_calls(report) == 2  # the decode step's two layers
    grouped = "aten::_grouped_mm" if kind == "bfloat16" else "mps_ext::fp8_grouped_linear"
    assert ops[grouped].ran == 2 * 2  # gate/up and down, 2 layers
    # bf16: transformers' grouped_mm experts sum the slots with torch's ops; FP8Experts with moe_combine.
    assert moe.get("mps_ext::moe_combine", None) is None if kind == "bfloat16" else moe["mps_ext::moe_combine"].ran == 2
    for g, w in zip(got, want):
        assert rel_err(g, w) < 3e-2


@pytest.mark.parametrize("kind", ["float32", "fp8"])
def test_lfm2_moe_sigmoid_router_with_expert_bias(figures, kind):
    """LFM2-MoE (the LFM2.5-8B-A1B layout): its router's sigmoid scores,
    biased selection, renormalisation (+1e-6) and scaling run in moe_route.
    float32 activations (fp8: quantize_fp8 of the float32 model): in
    bfloat16 equal scores are common, whose order torch.topk leaves open."""
    model = make("lfm2_moe", routed_scaling_factor=1.5)
    for m in model.modules():
        if hasattr(m, "expert_bias"):  # trained models have one; the config's init is zero
            m.expert_bias.copy_(torch.randn(8, generator=torch.Generator().manual_seed(4)) * 0.05)
    prompt = ids()
    if kind == "fp8":
        original = model
        from test_fp8_flows import oracle_of
        model = mps_ext.quantize_fp8(copy.deepcopy(original))
        ref_model = reference(oracle_of(model, original))
    else:
        ref_model = reference(model)
    step = ref_model(prompt).logits[:, -1:].argmax(-1)
    ref = prefill_and_decode(ref_model, prompt, step)
    stock = prefill_and_decode(model, prompt, step)
    before = per_moe_layer(model)
    mps_ext.optimize(model)
    assert set(model.optimize_summary["moe"].converted.values()) == {
        f"Lfm2MoeSparseMoeBlock -> moe_layer: 8 {'fp8' if kind == 'fp8' else 'float32'} experts, top-2, "
        f"renormalised, no shared expert; sigmoid with expert bias, x1.5 router"}
    with run_model(RELEASE) as report:
        ours = prefill_and_decode(model, prompt, step)
    figures.families = report.ran_kernels()
    for what, i in (("prefill", 0), ("decode", 1)):
        figures.no_worse(what, ours[i], stock[i], ref[i], torch.float32 if kind == "float32" else torch.bfloat16)
    after = per_moe_layer(model)
    print(f"\nlfm2_moe {kind}: per MoE layer per token, (host calls, dispatches) before {before[0]}, after {after[0]}")
    assert after == [(1, 3)] * 2 and all(b[0] >= 10 for b in before)



def test_lfm2_moe_bfloat16_expert_bias_is_cast_once():
    """A bfloat16 LFM2-MoE (its expert_bias buffer cast with the model):
    moe_route reads the bias in float32, cast once and kept, not cast at
    every call (a dispatch a MoE layer and token); an in-place change of
    the buffer (a load_state_dict, a training step's update) is seen at the
    next call, and so is a new buffer."""
    model = make("lfm2_moe", torch.bfloat16)
    stock = copy.deepcopy(model)
    mps_ext.optimize(model)
    per_moe_layer(model)  # the first decode after optimize may cast
    assert per_moe_layer(model) == [(1, 3)] * 2, per_moe_layer.ops
    block, stock_block = first_block(model), stock.get_submodule(blocks(model)[0])
    x, _ = hidden_and_residual(1, torch.bfloat16)
    with torch.no_grad():
        for forced in ([0, 1], [5, 6], [2, 7]):
            # A bias large enough to decide the selection alone: a stale one would pick other experts.
            bias = torch.full((8,), -10.0)
            bias[forced] = 10.0
            if forced == [2, 7]:  # a new buffer in place of the old
                block.expert_bias = bias.to(torch.bfloat16)
            else:
                block.expert_bias.copy_(bias)
            stock_block.expert_bias.copy_(bias)
            out, calls, _ = block_call(block, x)
            assert calls == 2  # moe_layer and the cast of the changed bias
            assert block_call(block, x)[1:] == (1, 3)  # kept
            want = stock_block(x)
            assert torch.allclose(out.float(), want.float(), rtol=2e-2, atol=2e-2 * want.float().abs().max()), forced

# ----------------------------------------------------------- host calls and dispatches --
class _Calls(TorchDispatchMode):
    """Counts the aten and mps_ext ops that reach the backend (views, which
    encode no GPU work, left out): what eager PyTorch encodes one by one."""

    def __init__(self):
        super().__init__()
        self.calls, self.ops = 0, collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.calls += 1
            self.ops[func.name()] += 1
        return func(*args, **(kwargs or {}))


def decode_counts(model, modules, release=RELEASE):
    """(module, host calls, executor dispatches) of each call of `modules`
    in one decode step after a prefill, in call order, under the model
    runner with torch `release`'s policy; decode_counts.ops: the ops of the
    last call."""
    with torch.no_grad():
        cache = model(ids(), use_cache=True).past_key_values
    counts, start = [], {}
    with torch.no_grad(), run_model(release) as report:
        calls = _Calls()

        def dispatches():
            return sum(f.dispatches for f in report.families.values()) + report.other_dispatches

        def pre(mod, args):
            start[id(mod)] = (calls.calls, dispatches())
            calls.ops.clear()

        def post(mod, args, out):
            c, d = start.pop(id(mod))
            counts.append((mod, calls.calls - c, dispatches() - d))
            decode_counts.ops = dict(calls.ops)

        hooks = [h for m in modules for h in (m.register_forward_pre_hook(pre), m.register_forward_hook(post))]
        try:
            with calls:
                model(ids(1, seed=2), past_key_values=cache, use_cache=True)
        finally:
            for h in hooks:
                h.remove()
    return counts


def per_moe_layer(model, release=RELEASE):
    """(host calls, executor dispatches) of each MoE block in one decode step."""
    moe = [m for m in model.modules() if hasattr(m, "experts") and hasattr(m, "gate")]
    counts = [(c, d) for _, c, d in decode_counts(model, moe, release)]
    per_moe_layer.ops = decode_counts.ops
    assert len(counts) == len(moe) == 2
    return counts


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "fp8"])
@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_5_moe"])
def test_one_host_call_per_moe_layer_at_decode(name, kind):
    model = make(name, torch.float32 if kind == "float32" else torch.bfloat16)
    if kind == "fp8":
        mps_ext.quantize_fp8(model)
    before = per_moe_layer(model)
    print(f"\n{name} {kind} before: {per_moe_layer.ops}")
    mps_ext.optimize(model)
    after = per_moe_layer(model)
    print(f"\n{name} {kind}: per MoE layer per token, (host calls, dispatches) before {before[0]}, after {after[0]}")
    # moe_layer: router GEMV, moe_route, gate/up, down with the combine; the shared expert is expert 8.
    assert after == [(1, 3)] * 2
    assert all(b[0] >= 10 * a[0] for b, a in zip(before, after))


@pytest.mark.parametrize("release", ["2.9", "2.15"])
def test_every_release_takes_the_fused_layer(release):
    """On torch 2.15 torch's own _grouped_mm runs stock models on a Mac; the
    fused layer is mps_ext's own op, so an optimized model takes it on every
    release."""
    model = mps_ext.optimize(make("qwen3_moe", torch.bfloat16))
    assert per_moe_layer(model, release) == [(1, 3)] * 2


# ----------------------------------------------------------- the residual --
def block_call(block, x, residual=None):
    """(output, host calls, executor dispatches) of one optimized MoE block's call under
    the model runner."""
    with torch.no_grad(), run_model(RELEASE) as report:
        def dispatches():
            return sum(f.dispatches for f in report.families.values()) + report.other_dispatches
        before = dispatches()
        with _Calls() as calls:
            out = block(x) if residual is None else block(x, residual=residual)
        return out, calls.calls, dispatches() - before


def first_block(model):
    return model.get_submodule(blocks(model)[0])


def hidden_and_residual(tokens, dtype):
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(1, tokens, COMMON["hidden_size"], generator=g).to(dtype)
    return x, (torch.randn(x.shape, generator=g) * 4).to(dtype)


@pytest.mark.parametrize("tokens", [1, 5, 9])
@pytest.mark.parametrize("name,kind", [("qwen3_moe", "float32"), ("qwen3_moe", "float16"), ("qwen3_moe", "fp8"),
                                       ("qwen3_5_moe", "bfloat16"), ("qwen3_5_moe", "fp8")])
def test_residual_is_added_inside_the_moe_layer(name, kind, tokens):
    """block(x, residual=r): `r + block(x)` bit for bit, in the
    moe_layer call (no host call or dispatch of its own: (1, 3); past 8
    tokens the router's matmul runs mps_ext's prefill tile in 16-bit and
    torch's CPU matmul in float32, not an executor dispatch), and on torch's
    CPU ops."""
    model = make(name, torch.float32 if kind == "float32" else torch.float16 if kind == "float16" else torch.bfloat16)
    if kind == "fp8":
        mps_ext.quantize_fp8(model)
    block = first_block(mps_ext.optimize(model))
    x, residual = hidden_and_residual(tokens, model.dtype)
    moe_out, *plain = block_call(block, x)
    out, *counts = block_call(block, x, residual)
    assert torch.equal(out, residual + moe_out)
    assert counts == plain == [1, 3 if tokens <= 8 or kind != "float32" else 2]
    with torch.no_grad():  # torch's CPU ops (outside the runner)
        assert torch.equal(block(x, residual=residual), residual + block(x))


@pytest.mark.parametrize("kind", ["bfloat16", "fp8"])
def test_residual_on_the_grouped_path(monkeypatch, kind):
    """Past moe_layer's token slots (4 here) the block's own forward runs
    (transformers' grouped experts, or FP8Experts' grouped products); torch
    adds the residual to its output."""
    import mps_ext.passes.moe as fused_moe
    model = make("qwen3_5_moe", torch.bfloat16)
    if kind == "fp8":
        mps_ext.quantize_fp8(model)
    block = first_block(mps_ext.optimize(model))
    monkeypatch.setattr(fused_moe, "MAX_SLOTS", 4)
    monkeypatch.setattr(FP8Experts, "DECODE_ROWS", 4)
    x, residual = hidden_and_residual(5, torch.bfloat16)
    moe_out, plain_calls, _ = block_call(block, x)
    out, calls, _ = block_call(block, x, residual)
    assert torch.equal(out, residual + moe_out) and calls == plain_calls + 1


@pytest.mark.parametrize("kind", ["bfloat16", "fp8"])
def test_residual_is_added_after_a_shared_expert_run_apart(kind):
    """A shared expert run apart (Qwen2-MoE's, 4x the experts' size): the
    residual comes last, `residual + (moe + shared)` as the model adds it,
    which here gives other bits than adding it inside moe_layer would."""
    torch.manual_seed(0)
    model = T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(**COMMON, moe_intermediate_size=32, num_experts=8,
                                                   shared_expert_intermediate_size=128)).to(torch.bfloat16).eval()
    if kind == "fp8":
        mps_ext.quantize_fp8(model)
    block = first_block(mps_ext.optimize(model))
    k = kernel(block)
    assert k.shared_apart and not k.fused_shared
    x, residual = hidden_and_residual(4, torch.bfloat16)
    out, calls, dispatched = block_call(block, x, residual)
    with torch.no_grad(), run_model(RELEASE):
        moe = torch.ops.mps_ext.moe_layer(x[0], k.router, k.gate_up, k.gate_up_scale, k.down, k.down_scale, k.top_k,
                                          k.renormalize, False)
        shared = torch.sigmoid(block.shared_expert_gate(x[0])) * block.shared_expert(x[0])
    assert torch.equal(out[0], residual[0] + (moe + shared))
    assert not torch.equal(out[0], (residual[0] + moe) + shared)
    _, plain_calls, plain_dispatched = block_call(block, x)
    assert calls == plain_calls + 1 and dispatched == plain_dispatched  # torch's add, on the CPU here
    with torch.no_grad():
        assert torch.equal(block(x, residual=residual), residual + block(x))


# ----------------------------------------------------------- what it changes --
def test_idempotent_and_says_what_it_did():
    model = make("qwen3_5_moe", torch.bfloat16)
    assert mps_ext.optimize(model) is model
    s = model.optimize_summary["moe"]
    assert list(s.converted) == ["model.layers.0.mlp", "model.layers.1.mlp"] and not s.left and not s.already
    assert all(v == "Qwen3_5MoeSparseMoeBlock -> moe_layer: 8 bfloat16 experts, top-2, renormalised, shared expert "
               "fused as expert 8" for v in s.converted.values())
    assert "2 MoE blocks on torch.ops.mps_ext.moe_layer" in str(model.optimize_summary)
    fused = [model.get_submodule(n) for n in blocks(model)]
    mps_ext.optimize(model)
    s = model.optimize_summary["moe"]
    assert not s.converted and s.already == ["model.layers.0.mlp", "model.layers.1.mlp"] and not s.left
    assert [model.get_submodule(n) for n in blocks(model)] == fused
    assert model.optimize_summary.bytes_after == model.optimize_summary.bytes_before


def test_blocks_it_does_not_know_are_left_with_the_reason():
    """DeepSeek-V3's router is a grouped sigmoid beside shared_experts;
    Qwen2-MoE's shared expert is 4x the experts' size, so it runs apart, as
    the model ran it."""
    ds = T.DeepseekV3ForCausalLM(T.DeepseekV3Config(
        **{**{k: v for k, v in COMMON.items() if k != "head_dim"}, "num_key_value_heads": 4},
        moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, n_group=2, topk_group=1,
        first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16)).eval()
    mps_ext.optimize(ds)
    assert ds.optimize_summary["moe"].left == {
        "model.layers.1.mlp": "it holds shared_experts beside its router and experts (optimize knows no such block)"}
    torch.manual_seed(0)
    qwen2 = T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(**COMMON, moe_intermediate_size=32, num_experts=8,
                                                   shared_expert_intermediate_size=128)).eval()
    prompt = ids()
    want = prefill_and_decode(qwen2, prompt, ids(1, seed=2))
    mps_ext.optimize(qwen2)
    assert set(qwen2.optimize_summary["moe"].converted.values()) == {
        "Qwen2MoeSparseMoeBlock -> moe_layer: 8 float32 experts, top-2, shared expert run apart (its shared "
        "expert's size 128 is not the experts' 32)"}
    for g, w in zip(prefill_and_decode(qwen2, prompt, ids(1, seed=2)), want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    with run_model(RELEASE):
        got = prefill_and_decode(qwen2, prompt, ids(1, seed=2))
    for g, w in zip(got, want):
        assert rel_err(g, w) < 1e-4


@pytest.mark.parametrize("name", ["gpt_oss", "llama4"])
def test_experts_the_kernels_cannot_run_are_left_with_the_reason(name):
    """GPT-OSS's experts have biases, Llama 4's take pre-grouped tokens:
    the reason quantize_fp8 gives for the same banks."""
    import re
    from test_fp8_flows import LEFT, make as make_left
    model = mps_ext.optimize(make_left(LEFT[name], torch.bfloat16))
    s = model.optimize_summary["moe"]
    assert not s.converted and s.left and all(re.search(LEFT[name][3], why) for why in s.left.values()), s


def test_block_scaled_shared_expert_runs_apart():
    """quantize_fp8(granularity="block"): the shared expert's 128x128 block
    scales are not the banks' one scale per row, so it cannot be expert E;
    it runs apart, as the quantized model ran it."""
    # float32 activations: in bfloat16 this prompt has an exact tie at the top-2 boundary, whose order
    # torch.topk leaves open (moe_route takes the lower expert).
    model = mps_ext.quantize_fp8(make("qwen3_5_moe"), granularity="block")
    prompt, step = ids(), ids(1, seed=2)
    want = prefill_and_decode(model, prompt, step)
    mps_ext.optimize(model)
    assert set(model.optimize_summary["moe"].converted.values()) == {
        "Qwen3_5MoeSparseMoeBlock -> moe_layer: 8 fp8 experts, top-2, renormalised, shared expert run apart (the "
        "expert banks are fp8 and the shared expert is not fp8 with a scale per row)"}
    with run_model(RELEASE) as report:
        got = prefill_and_decode(model, prompt, step)
    assert layer_calls(report) == 4
    for g, w in zip(got, want):
        assert rel_err(g, w) < 3e-2


def test_bad_input():
    with pytest.raises(TypeError, match="takes a torch.nn.Module \\(a loaded model\\), got str"):
        mps_ext.optimize("Qwen/Qwen3-30B-A3B")
    model = make("qwen3_moe").double()
    with pytest.raises(ValueError, match="optimize runs float32, float16 or bfloat16 models .*torch.float64 banks"):
        mps_ext.optimize(model)
    assert not blocks(model)  # nothing replaced before the error


def test_casts_devices_and_state_dict_round_trip():
    model = mps_ext.optimize(make("qwen3_5_moe"))
    prompt, step = ids(), ids(1, seed=2)
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    assert all(kernel(bf16.get_submodule(n)).gate_up.dtype == torch.bfloat16 for n in blocks(bf16))
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    stock = mps_ext.optimize(make("qwen3_5_moe", torch.bfloat16))  # bf16 before optimize
    for g, w in zip(prefill_and_decode(bf16, prompt, step), prefill_and_decode(stock, prompt, step)):
        torch.testing.assert_close(g, w)
    other = mps_ext.optimize(make("qwen3_5_moe"))
    for p in other.parameters():
        p.data.zero_()
    other.load_state_dict(model.state_dict())
    for g, w in zip(prefill_and_decode(other, prompt, step), prefill_and_decode(model, prompt, step)):
        assert torch.equal(g, w)
    # fp8: casts keep the fp8 banks (FP8Experts), the router follows the model's dtype.
    q = mps_ext.optimize(mps_ext.quantize_fp8(make("qwen3_5_moe", torch.bfloat16))).float()
    other = mps_ext.optimize(mps_ext.quantize_fp8(make("qwen3_5_moe", torch.bfloat16))).float()
    for t in other.state_dict().values():  # every persistent tensor (not the rotary tables)
        t.zero_()
    other.load_state_dict(q.state_dict())
    for g, w in zip(prefill_and_decode(other, prompt, step), prefill_and_decode(q, prompt, step)):
        assert torch.equal(g, w)
    fused = q.get_submodule(blocks(q)[0])
    assert kernel(fused).router.dtype == torch.float32 and fused.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    with run_model(RELEASE) as report:
        prefill_and_decode(q, prompt, step)
    assert layer_calls(report) == 4


def test_quantize_fp8_after_optimize():
    """The other order: quantize_fp8 takes the optimized blocks back, converts
    their experts and shared expert, and the blocks are optimized again (the
    shared expert fp8 expert 8 of the banks); the router stays as it is."""
    model = mps_ext.optimize(make("qwen3_5_moe", torch.bfloat16))
    prompt, step = ids(), ids(1, seed=2)
    want = prefill_and_decode(model, prompt, step)
    mps_ext.quantize_fp8(model)
    assert model.fp8_summary.converted["FP8Experts"] == [n + ".experts" for n in blocks(model)]
    fused = model.get_submodule(blocks(model)[0])
    assert isinstance(fused.experts, FP8Experts) and kernel(fused).gate_up.shape[0] == 9
    assert kernel(fused).gate_up.dtype == torch.float8_e4m3fn and kernel(fused).fused_shared
    with run_model(RELEASE) as report:
        got = prefill_and_decode(model, prompt, step)
    assert layer_calls(report) == 4
    for g, w in zip(got, want):
        assert rel_err(g, w) < 0.1  # fp8 weights


# ----------------------------------------------------------- torch.compile --
@mps_ext_executor.request()  # traced inside request(): the kernels' path, the one a Mac takes
@pytest.mark.parametrize("kind", ["bfloat16", "fp8"])
def test_compiled_optimized_model(kind):
    from test_fp8_flows import Float8Inspector
    model = make("qwen3_moe", torch.bfloat16)
    if kind == "fp8":
        mps_ext.quantize_fp8(model)
    mps_ext.optimize(model)
    prompt, step = ids(), ids(1, seed=2)
    want = prefill_and_decode(model, prompt, step)
    torch._dynamo.reset()
    inspector = Float8Inspector()  # also: no float8 tensor op reaches the compiler
    got = prefill_and_decode(torch.compile(model, backend=inspector.backend), prompt, step)
    assert "moe_layer" in inspector.mps_ext_ops
    # FusedRMSNorm leaves its norms to Inductor, which fuses them with the residual adds.
    assert "rms_norm" not in inspector.mps_ext_ops and norms(model)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


# ----------------------------------------------------------- RMSNorms --
# Per decoder layer, the RMSNorm modules transformers 5.23 gives each model:
# input and post-attention norms, and the attention's q and k norms (LFM2:
# operator_norm, ffn_norm, q_layernorm, k_layernorm); the final norm.
NORMS = {"qwen3_moe": ("weight", 2 * 4 + 1), "lfm2_moe": ("weight", 3 * 2 + 2 + 1),
         # the linear-attention layer's gated norm (two inputs) is not one of them
         "qwen3_5_moe": ("zero_centred", 2 * 2 + 2 + 1)}


def norms(model):
    return [n for n, m in model.named_modules() if isinstance(m, FusedRMSNorm)]


@pytest.mark.parametrize("name", list(NORMS))
def test_rms_norms_become_one_dispatch_and_generate_the_same(name):
    """Every RMSNorm of the three model families becomes a FusedRMSNorm of
    its variant (read off a probe), and generate's greedy tokens, float32
    and bfloat16, are the unoptimized model's."""
    variant, count = NORMS[name]
    for dtype in (torch.float32, torch.bfloat16):
        model = make(name, dtype)
        prompt = ids()
        with torch.no_grad():
            want = model.generate(prompt, max_new_tokens=4, do_sample=False)
        mps_ext.optimize(model)
        assert len(norms(model)) == count, norms(model)
        assert {model.get_submodule(n).variant for n in norms(model)} == {variant}
        assert len(model.optimize_summary["norms"].converted) == count and f"{count} RMSNorms" in str(
            model.optimize_summary
        )
        with torch.no_grad(), run_model(RELEASE) as report:
            got = model.generate(prompt, max_new_tokens=4, do_sample=False)
        assert torch.equal(got, want), (got, want)
        # One call per norm and step: 4 steps (prefill, 3 decodes); an attention layer's q and k
        # norms are one qk_norm_rope call with its rotary embedding (mps_ext/passes/attention.py), a
        # decoder layer's post-attention norm one add_rms_norm call with the residual add before it
        # (mps_ext/passes/decoder.py).
        attention, layers = (
            len(model.optimize_summary["attention"].converted),
            len(model.optimize_summary["decoder_layers"].converted),
        )
        # (qk_norm_rope_append: the same with the KV cache append in its dispatch)
        qk = report.families["norm"].ops
        assert attention and sum(qk[op].ran for op in ("mps_ext::qk_norm_rope", "mps_ext::qk_norm_rope_append")
                                 if op in qk) == attention * 4
        assert layers and report.families["norm"].ops["mps_ext::add_rms_norm"].ran == layers * 4
        # (an input norm whose layer runs it in its mixer's projection GEMV: rms_norm_linear, the linear
        # family's; tests/models/test_optimize_decoder.py)
        in_gemv = report.families["linear"].ops.get("mps_ext::rms_norm_linear")
        assert report.families["norm"].ops["mps_ext::rms_norm"].ran + (in_gemv.ran if in_gemv else 0) \
            == (count - 2 * attention - layers) * 4


class _LayerCalls(TorchDispatchMode):
    """The non-view ops run while `inside` is set."""

    def __init__(self):
        super().__init__()
        self.ops, self.inside = collections.Counter(), False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.inside and not func.is_view:
            self.ops[func.name()] += 1
        return func(*args, **(kwargs or {}))


def decode_layer_ops(model, layer):
    """The non-view ops decoder layer `layer` runs in one decode step, under
    the model runner."""
    with torch.no_grad():
        cache = model(ids(), use_cache=True).past_key_values
    step = ids(1, seed=2)
    calls = _LayerCalls()
    mod = model.model.layers[layer]
    hooks = [mod.register_forward_pre_hook(lambda m, a: setattr(calls, "inside", True)),
             mod.register_forward_hook(lambda m, a, o: setattr(calls, "inside", False))]
    try:
        with torch.no_grad(), run_model(RELEASE), calls:
            model(step, past_key_values=cache, use_cache=True)
    finally:
        for h in hooks:
            h.remove()
    return calls.ops


def test_a_decoder_layers_norms_are_one_call_each():
    """Qwen3-MoE's attention layer at decode: its four norms (input,
    post-attention, q and k) were rsqrt, pow, mean, ... each; now the input
    norm is in the q/k/v GEMV's one mps_ext::rms_norm_linear call (the
    decoder layer's, with the projection), the post-attention norm in
    one add_rms_norm call with the residual add before it, the q and k
    norms in the attention's one qk_norm_rope call (qk_norm_rope_append, with
    the KV cache append), and no rsqrt is left."""
    model = make("qwen3_moe", torch.bfloat16)
    before = decode_layer_ops(model, 0)
    assert before["aten::rsqrt"] == 4 and "mps_ext::rms_norm" not in before
    mps_ext.optimize(model)
    after = decode_layer_ops(model, 0)
    assert after["mps_ext::rms_norm_linear"] == 1 and "mps_ext::rms_norm" not in after
    assert after["mps_ext::add_rms_norm"] == 1
    assert after["mps_ext::qk_norm_rope_append"] == 1
    assert "mps_ext::qk_norm_rope" not in after and "mps_ext::kv_append" not in after
    assert "aten::rsqrt" not in after and "aten::pow" not in after
    print(f"\nqwen3_moe bf16 decoder layer, host calls per decode token: {sum(before.values())} -> "
          f"{sum(after.values())}")
    assert sum(before.values()) - sum(after.values()) >= 4 * 5


def test_norms_it_does_not_know_are_left():
    """A LayerNorm without bias (it subtracts the mean), Qwen3.5's gated
    norm (two inputs) and an RMSNorm whose weight is another dtype than its
    input at run time (the module's own math runs) are left or fall back."""
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeRMSNormGated
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm
    holder = torch.nn.ModuleDict({"ln": torch.nn.LayerNorm(16, bias=False), "gated": Qwen3_5MoeRMSNormGated(16),
                                  "rms": Qwen3MoeRMSNorm(16)})
    mps_ext.optimize(holder)
    assert isinstance(holder["ln"], torch.nn.LayerNorm) and isinstance(holder["gated"], Qwen3_5MoeRMSNormGated)
    assert isinstance(holder["rms"], FusedRMSNorm) and list(holder.optimize_summary["norms"].converted) == ["rms"]
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    with torch.no_grad(), run_model(RELEASE) as report:
        got = holder["rms"](x)  # float32 weight, bfloat16 input: promoted to float32, as the module does
    assert got.dtype == torch.float32 and "norm" not in report.ran_kernels()
    torch.testing.assert_close(got, Qwen3MoeRMSNorm(16)(x), rtol=0, atol=0)
    # autograd: torch's ops, which have a derivative
    x = torch.randn(3, 16, requires_grad=True)
    holder["rms"](x).sum().backward()
    assert x.grad is not None
