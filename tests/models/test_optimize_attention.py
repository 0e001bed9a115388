"""mps_ext.optimize's attention layers (mps_ext/passes/attention.py) on
transformers 5's tiny qwen3_moe, qwen3_5_moe (gated q_proj, partial rotary)
and lfm2_moe: q_norm, k_norm and the rotary embedding are one
torch.ops.mps_ext.qk_norm_rope call; decode logits against the same model
optimized without it (bit for bit) and within the model tests' bound of
float64, float and fp8, prefill, torch.compile; host calls and dispatches
per attention layer in the census; what it leaves and why."""

import copy

import pytest
import torch

import mps_ext
import mps_ext_executor
from mps_ext.passes import attention as fused_attention
from mps_ext_executor import run_model
from mps_ext.passes.attention import FusedQKNormRopeMixin
from model_compare import RELEASE, without_passes
from test_optimize import (PROMPT, ids, make, optimized_against_stock_and_float64, prefill_and_decode,
                           quantized_against_stock_and_float64, rel_err)

# Per model, its attention layers (the tiny configs of test_optimize.py) and their class.
ATTENTION = {"qwen3_moe": (["model.layers.0.self_attn", "model.layers.1.self_attn"], "Qwen3MoeAttention"),
             "qwen3_5_moe": (["model.layers.1.self_attn"], "Qwen3_5MoeAttention"),
             "lfm2_moe": (["model.layers.1.self_attn"], "Lfm2MoeAttention")}
# Qwen3.6-35B-A3B's head: 256, of which 64 rotate (partial_rotary_factor 0.25). A lane of
# qk_norm_rope then holds the elements rms_norm's would (its rotated pairs' halves, then the
# passed elements, 32 apart), so the sum of squares is in rms_norm's order; with the tiny
# config's 16 (4 rotate) it is not (test_a_rotary_size_off_the_lanes_sums_in_another_order).
HEAD = {"qwen3_5_moe": dict(head_dim=256)}


def attention_layers(model):
    return [n for n, m in model.named_modules() if isinstance(m, FusedQKNormRopeMixin)]


def without_swap(monkeypatch, model):
    """mps_ext.optimize(model) with everything but the attention swap."""
    with monkeypatch.context() as m:
        without_passes(m, "attention")
        return mps_ext.optimize(model)


def qk_calls(report) -> int:
    """The calls of qk_norm_rope and of qk_norm_rope_append (the same with
    the KV cache append, where the layer has a DynamicCache) that ran."""
    ops = report.families["norm"].ops
    return sum(ops[op].ran for op in ("mps_ext::qk_norm_rope", "mps_ext::qk_norm_rope_append") if op in ops)


# ----------------------------------------------------------- results --
@pytest.mark.parametrize("kind", ["float32", "bfloat16", "fp8"])
@pytest.mark.parametrize("name", list(ATTENTION))
def test_swapped_attention_matches_the_model_without_it(figures, monkeypatch, name, kind):
    """Decode logits bit-identical to the optimized model without the swap
    (the op rounds where the norms and apply_rotary_pos_emb round), prefill
    too; against float64 within the model tests' bound."""
    layers, cls = ATTENTION[name]
    if kind == "fp8":
        model, prompt, step, ref, stock = quantized_against_stock_and_float64(name, **HEAD.get(name, {}))
        apart = without_swap(monkeypatch, copy.deepcopy(model))
        mps_ext.optimize(model)
        dtype = torch.bfloat16
    else:
        dtype = getattr(torch, kind)
        model, prompt, step, ref, stock = optimized_against_stock_and_float64(name, dtype, **HEAD.get(name, {}))
        apart = without_swap(monkeypatch, make(name, dtype, **HEAD.get(name, {})))
    s = model.optimize_summary
    assert attention_layers(model) == layers and list(s["attention"].converted) == layers and not s["attention"].left
    assert all(what.startswith(f"{cls} -> ") for what in s["attention"].converted.values())
    assert not attention_layers(apart) and "attention" not in apart.optimize_summary.sections
    # The model's attention function at decode too (kv_decode_attention sums in another order: its own tests,
    # test_decode_attention_generates_the_stock_tokens), to see qk_norm_rope's bits.
    monkeypatch.setattr(fused_attention, "_KERNELS", fused_attention._KERNELS._replace(attend=None))
    if kind == "float32" and name == "qwen3_5_moe":
        # The output gate's sigmoid in float32 is not torch's CPU one in the last bit (its exp:
        # test_gate_and_cache_append_change_no_bit): the model's gate line here, to see qk_norm_rope's bits.
        monkeypatch.setattr(fused_attention, "_KERNELS", fused_attention._KERNELS._replace(
            gate=fused_attention.sigmoid_gate_reference, attend=None, gate_out=None))
    with run_model(RELEASE) as report:
        ours = prefill_and_decode(model, prompt, step)
    with run_model(RELEASE) as theirs_report:
        theirs = prefill_and_decode(apart, prompt, step)
    figures.families = report.ran_kernels()
    # One call per attention layer and forward (prefill, decode); none without the swap.
    assert qk_calls(report) == 2 * len(layers)
    assert not qk_calls(theirs_report)
    assert torch.equal(ours[1], theirs[1])
    assert torch.equal(ours[0], theirs[0])
    for what, i in (("prefill", 0), ("decode", 1)):
        figures.no_worse(what, ours[i], stock[i], ref[i], dtype)


def test_a_rotary_size_off_the_lanes_sums_in_another_order(monkeypatch):
    """The tiny Qwen3.5 head (16, of which 4 rotate): qk_norm_rope's lanes
    hold other elements than rms_norm's, so the norms' sums of squares are
    in another order; float32 logits within a few units in the last place
    of the model without the swap, not bit for bit."""
    model = mps_ext.optimize(make("qwen3_5_moe"))
    apart = without_swap(monkeypatch, make("qwen3_5_moe"))
    assert model.optimize_summary["attention"].converted["model.layers.1.self_attn"].endswith("rotary 4, output gate)")
    prompt, step = ids(), ids(1, seed=2)
    with run_model(RELEASE) as report:
        ours = prefill_and_decode(model, prompt, step)
        theirs = prefill_and_decode(apart, prompt, step)
    assert qk_calls(report) == 2
    for o, t in zip(ours, theirs):
        assert rel_err(o, t) <= 1e-6


def test_cpu_tensors_without_the_executor_run_the_models_steps(monkeypatch):
    """Outside the model runner (CPU tensors): torch's ops, in the model's
    order, so the logits are the unswapped model's bit for bit."""
    model = mps_ext.optimize(make("qwen3_5_moe", torch.bfloat16))
    apart = without_swap(monkeypatch, make("qwen3_5_moe", torch.bfloat16))
    prompt, step = ids(), ids(1, seed=2)
    assert attention_layers(model)
    for g, w in zip(prefill_and_decode(model, prompt, step), prefill_and_decode(apart, prompt, step)):
        assert torch.equal(g, w)


# ----------------------------------------------------------- host calls and dispatches --
# (layer kind, the norm and rotary calls qk_norm_rope stands for, the calls
# sigmoid_gate and the cache append save: DynamicCache's 2 torch.cat become
# none, the append being in qk_norm_rope's call (qk_norm_rope_append);
# Qwen3.6's output gate, a copy of the strided gate, sigmoid and mul, and
# o_proj's linear: 1 sigmoid_gate_linear; compiled, that Inductor kernel
# of the gate is the call saved)
CENSUS = {"Qwen3-30B-A3B": ("full_attention+moe", 12, 2, 0),
          # partial rotary: a cat more for q and for k
          "Qwen3.6-35B-A3B": ("full_attention+moe", 14, 2 + 3, 1),
          "LFM2.5-8B-A1B": ("full_attention+moe", 12, 2, 0)}


@pytest.mark.parametrize("model_name", list(CENSUS))
def test_an_attention_layer_loses_its_norm_and_rope_calls(monkeypatch, model_name):
    """benchmarks/census.py, one decode token after 8 of context, torch
    2.15's policy: an attention layer's 2 norms and the rotary embedding's
    10 (partial rotary: 12) ops and the cache's 2 torch.cat become one call
    of one dispatch (qk_norm_rope_append), eager, and Qwen3.6's output gate
    (3 calls) and its o_proj one sigmoid_gate_linear; compiled, the count
    does not change (the layer leaves them to Inductor, which fuses them
    with their neighbours) but for Qwen3.6's gate: the kernel Inductor
    generated for it is in o_proj's dispatch (sigmoid_gate_linear runs
    compiled too)."""
    from benchmarks import census
    spec = census.MODELS[model_name]
    kind, calls, saved, compiled_saved = CENSUS[model_name]
    tiny = census.tiny_model(spec)

    def counts(transform):
        layer = census.per_kind(census.trace_step(tiny, tokens=1, context=8, torch_release="2.15",
                                                  transform=transform), tiny.config)[kind]
        assert any(c.op == "_scaled_dot_product_flash_attention_for_cpu" or "attention" in c.op for c in layer)
        return {mode: census.count(layer, "2.15", mode, True) for mode in census.MODES}

    with monkeypatch.context() as m:
        without_passes(m, "attention")
        before = counts(mps_ext.optimize)
    after = counts(mps_ext.optimize)
    print(f"\n{model_name} {kind}, per layer: host calls {before['eager'].host:g} -> {after['eager'].host:g}, "
          f"dispatches {before['eager'].dispatches:g} -> {after['eager'].dispatches:g}")
    assert before["eager"].host - after["eager"].host == calls - 1 + saved
    assert before["eager"].dispatches - after["eager"].dispatches == calls - 1 + saved
    assert (after["compile"].host, after["compile"].dispatches) == (before["compile"].host - compiled_saved,
                                                                     before["compile"].dispatches - compiled_saved)


# ----------------------------------------------------------- torch.compile --
@mps_ext_executor.request()  # traced inside request(): the kernels' path, the one a Mac takes
@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_5_moe"])
def test_compiled_swapped_model(name):
    """One graph for the whole model (fullgraph), the uncompiled model's
    logits; the graph holds no qk_norm_rope (Inductor fuses the norms and
    the rotation with their neighbours)."""
    from test_fp8_flows import Float8Inspector
    model = mps_ext.optimize(make(name, torch.bfloat16))
    assert attention_layers(model)
    prompt, step = ids(), ids(1, seed=2)
    want = prefill_and_decode(model, prompt, step)
    torch._dynamo.reset()
    inspector = Float8Inspector()
    got = prefill_and_decode(torch.compile(model, backend=inspector.backend, fullgraph=True), prompt, step)
    assert "qk_norm_rope" not in inspector.mps_ext_ops
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


# ----------------------------------------------------------- what it changes and leaves --
def test_state_dict_module_tree_and_a_second_optimize(monkeypatch):
    """The swap keeps parameters, state dict keys and children; a second
    optimize says the layers are already converted; a deepcopy and a cast
    keep the fused forward."""
    model = make("qwen3_5_moe")
    without = without_swap(monkeypatch, copy.deepcopy(model))
    mps_ext.optimize(model)
    assert set(model.state_dict()) == set(without.state_dict())
    attn = model.model.layers[1].self_attn
    assert [n for n, _ in attn.named_children()] == [n for n, _ in without.model.layers[1].self_attn.named_children()]
    assert type(attn).__name__ == "FusedQwen3_5MoeAttention" and type(attn).__mro__[2].__name__ == "Qwen3_5MoeAttention"
    mps_ext.optimize(model)
    assert model.optimize_summary["attention"].already == ["model.layers.1.self_attn"]
    assert not model.optimize_summary["attention"].converted
    clone = copy.deepcopy(model).to(torch.bfloat16)
    assert attention_layers(clone) == ["model.layers.1.self_attn"]
    prompt, step = ids(), ids(1, seed=2)
    with run_model(RELEASE) as report:
        prefill_and_decode(clone, prompt, step)
    assert qk_calls(report) == 2


def _interleaved_rope(q, k, cos, sin, unsqueeze_dim=1):
    """An interleaved rotary embedding (pairs of neighbours rotate, as
    Cohere's and GLM's): not what qk_norm_rope computes."""
    from transformers.models.cohere.modeling_cohere import rotate_half
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def test_an_attention_whose_rope_is_not_rotate_half_is_left(monkeypatch):
    """Qwen3-MoE's attention with an interleaved rotary embedding in its
    modeling module: the probe finds it, the layer is left with the reason
    and the model computes what it did."""
    from transformers.models.qwen3_moe import modeling_qwen3_moe
    monkeypatch.setattr(modeling_qwen3_moe, "apply_rotary_pos_emb", _interleaved_rope)
    model = make("qwen3_moe")
    prompt, step = ids(), ids(1, seed=2)
    want = prefill_and_decode(model, prompt, step)
    mps_ext.optimize(model)
    s = model.optimize_summary
    assert not s["attention"].converted and not attention_layers(model)
    assert set(s["attention"].left) == set(ATTENTION["qwen3_moe"][0])
    assert all(why.startswith("its output differs on a probe (rotary size 16, relative error")
               and why.endswith("its rotary embedding is not rotate_half's, or its forward does something else")
               for why in s["attention"].left.values()), s["attention"].left
    assert "0 attention layers" in str(s) and "2 left" in str(s)
    assert not hasattr(model.model.layers[0].self_attn, "_mps_ext_attention")
    with run_model(RELEASE) as report:
        got = prefill_and_decode(model, prompt, step)
    assert not qk_calls(report)
    for g, w in zip(got, want):
        assert rel_err(g, w) < 1e-5


def test_attentions_it_does_not_know_are_left_with_the_reason():
    """Llama-like attention without q/k norms (Mixtral), norms that are not
    RMSNorms, a child it does not know."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeAttention
    mixtral = mps_ext.optimize(make("mixtral"))
    assert mixtral.optimize_summary["attention"].left == {
        f"model.layers.{i}.self_attn": "no per-head q and k norms (q_norm, k_norm or q_layernorm, k_layernorm): no "
                                       "norm to fuse with its rotary" for i in (0, 1)}
    config = make("qwen3_moe").config
    layernorm = Qwen3MoeAttention(config, 0)
    layernorm.q_norm, layernorm.k_norm = torch.nn.LayerNorm(16), torch.nn.LayerNorm(16)
    extra = Qwen3MoeAttention(config, 0)
    extra.v_norm = torch.nn.LayerNorm(16)
    holder = mps_ext.optimize(torch.nn.ModuleDict({"layernorm": layernorm, "extra": extra}))
    assert holder.optimize_summary["attention"].left == {
        "layernorm": "its q and k norms (LayerNorm, LayerNorm) are not RMSNorms optimize fuses",
        "extra": "it holds v_norm beside its projections and q/k norms (optimize knows no such attention)"}
    assert not attention_layers(holder)


@pytest.mark.parametrize("name", ["qwen3", "lfm2"])
def test_dense_qwen3_and_lfm2(monkeypatch, name):
    """Plain Qwen3 (its sliding-window attribute passed on) and LFM2: the
    same attention, converted; decode logits bit-identical to the model
    optimized without the swap."""
    from test_optimize import COMMON, T
    common = {k: v for k, v in COMMON.items() if k not in ("num_experts_per_tok", "experts_implementation")}

    def build():
        torch.manual_seed(0)
        if name == "qwen3":
            return T.Qwen3ForCausalLM(T.Qwen3Config(**common)).eval()
        return T.Lfm2ForCausalLM(T.Lfm2Config(**common, layer_types=["conv", "full_attention"])).eval()

    model, apart = mps_ext.optimize(build()), without_swap(monkeypatch, build())
    layers = [f"model.layers.{i}.self_attn" for i in ((0, 1) if name == "qwen3" else (1,))]
    assert attention_layers(model) == layers and not model.optimize_summary["attention"].left
    prompt, step = ids(), ids(1, seed=2)
    with run_model(RELEASE) as report:
        ours = prefill_and_decode(model, prompt, step)
        theirs = prefill_and_decode(apart, prompt, step)
    assert qk_calls(report) == 2 * len(layers)
    for o, t in zip(ours, theirs):
        assert torch.equal(o, t)


# ----------------------------------------------------------- output gate and KV cache (issue 19) --
# The forward's pieces without the two changes: the model's gate line and DynamicCache.update (the same
# decode attention as _KERNELS: both caches hold the same rows).
_APART = fused_attention._Ops(fused_attention.qk_norm_rope, fused_attention.sigmoid_gate_reference,
                              fused_attention._release_update, attend=fused_attention.decode_attention)
GROWTH = 4  # positions a cache buffer grows by in these tests (KV_STEP), so that a short decode crosses two


def greedy(model, prompt, steps, cache=None):
    """Greedy decode of `steps` tokens after `prompt` on `cache` (a new
    DynamicCache of the model's config, as generate makes): the last
    position's logits of each forward, stacked, and the cache."""
    from transformers import DynamicCache
    cache = DynamicCache(config=model.config) if cache is None else cache
    logits = []
    with torch.no_grad():
        out = model(prompt, past_key_values=cache, use_cache=True)
        for _ in range(steps):
            logits.append(out.logits[:, -1])
            out = model(out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
        logits.append(out.logits[:, -1])
    return torch.stack(logits), cache


def ran(report, op):
    """How many calls of mps_ext's `op` ran their kernels (counted in its
    family, the one that lists it: kv_cache, attention_gate)."""
    family = report.families.get(next(f for f in mps_ext.families() if op in mps_ext._C.family_own_ops(f)))
    return family.ops[op].ran if family is not None and op in family.ops else 0


def cache_contents(cache):
    return [(layer.keys, layer.values) for layer in cache.layers if type(layer).__name__ == "DynamicLayer"]


def gated_and_cached(monkeypatch, name, kind):
    """(model, dtype): the tiny `name` model optimized, in float32, bfloat16
    or bf16 with fp8 weights."""
    monkeypatch.setattr(fused_attention, "KV_STEP", GROWTH)
    if kind == "fp8":
        model = quantized_against_stock_and_float64(name, **HEAD.get(name, {}))[0]
        return mps_ext.optimize(model), torch.bfloat16
    dtype = getattr(torch, kind)
    return mps_ext.optimize(make(name, dtype, **HEAD.get(name, {}))), dtype


def decode_twice(model, name):
    """test_gate_and_cache_append_change_no_bit's decode: 10 greedy tokens,
    crop(-3) where the cache crops (Qwen3-MoE's), 4 more after 3 tokens of
    a second prompt; (the first logits, the second, the cache's length
    after the first, the cache)."""
    first, cache = greedy(model, ids(), 10)
    length = cache.get_seq_length()
    if name == "qwen3_moe":
        cache.crop(-3)
    second, cache = greedy(model, first.argmax(-1)[-3:].T, 4, cache)
    return first, second, length, cache


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "fp8"])
@pytest.mark.parametrize("name", list(ATTENTION))
def test_gate_and_cache_append_change_no_bit(monkeypatch, name, kind):
    """Greedy decode over 10 tokens (the cache buffers grow twice, by
    GROWTH positions), then 3 tokens of a second prompt and 4 more on the
    same cache, after crop(-3) where the cache crops (Qwen3-MoE's; the
    hybrid caches of Qwen3.5-MoE and LFM2-MoE crop only after
    activate_past_recording):
    the logits of the optimized model with sigmoid_gate (at a decode step
    in o_proj's GEMV, sigmoid_gate_linear, but with fp8 weights) and the
    cache append (qk_norm_rope_append) equal
    those of the same model with the model's gate line and
    DynamicCache.update, bit for bit (float32 with an output gate: within
    float32's rounding, the exp of sigmoid being the C library's, not
    torch's SLEEF one); the caches hold the same keys and values, as
    transformers sees them, the layers' own DynamicLayer (views of buffers
    with room to grow); one qk_norm_rope_append per attention layer and
    forward, one sigmoid_gate per gated layer and prefill (and decode step,
    with fp8 weights) and one sigmoid_gate_linear per gated layer and
    decode step (none with fp8 weights), no torch.cat."""
    layers = ATTENTION[name][0]
    model, dtype = gated_and_cached(monkeypatch, name, kind)
    assert attention_layers(model) == layers
    gated = name == "qwen3_5_moe"
    crops = name == "qwen3_moe"

    def run():
        return decode_twice(model, name)

    with run_model(RELEASE) as report:
        ours, ours2, ours_len, cache = run()
    with run_model(RELEASE) as theirs_report, monkeypatch.context() as m:
        m.setattr(fused_attention, "_KERNELS", _APART)
        theirs, theirs2, theirs_len, stock_cache = run()
    forwards = 11 + 5
    # every append in the norm and rotary dispatch (qk_norm_rope_append), none on its own (kv_append)
    assert ran(report, "mps_ext::qk_norm_rope_append") == forwards * len(layers)
    assert not ran(report, "mps_ext::kv_append")
    # (fp8: o_proj an FP8Linear, on sigmoid_gate; ungated models have no gate and LFM2 no o_proj)
    in_gemv = gates_in_gemv(model, dtype) * gated if kind != "fp8" and gated else 0
    assert ran(report, "mps_ext::sigmoid_gate") == forwards * gated - in_gemv
    assert ran(report, "mps_ext::sigmoid_gate_linear") == in_gemv
    assert not ran(theirs_report, "mps_ext::sigmoid_gate_linear")
    assert not ran(theirs_report, "mps_ext::kv_append") and not ran(theirs_report, "mps_ext::sigmoid_gate")
    assert not ran(theirs_report, "mps_ext::qk_norm_rope_append")
    assert ours_len == theirs_len == PROMPT + 10
    if gated and dtype == torch.float32:
        assert rel_err(ours, theirs) <= 1e-6 and rel_err(ours2, theirs2) <= 1e-6
    else:
        assert torch.equal(ours, theirs) and torch.equal(ours2, theirs2)
    assert cache.get_seq_length() == stock_cache.get_seq_length() == PROMPT + 10 - 3 * crops + 3 + 4
    for (k, v), (sk, sv) in zip(cache_contents(cache), cache_contents(stock_cache), strict=True):
        assert k.shape == sk.shape and v.shape == sv.shape and k.dtype == sk.dtype
        if not (gated and dtype == torch.float32):
            assert torch.equal(k, sk) and torch.equal(v, sv)
        # a view of a buffer grown by GROWTH positions
        assert k.untyped_storage().nbytes() == k[0, 0, 0].nbytes * k.shape[0] * k.shape[1] * (
            -(-k.shape[2] // GROWTH) * GROWTH
        )


def fused_and_unfused(monkeypatch, model, name, unfused_ops, ops):
    """(fused, unfused): the model run with _KERNELS, then with
    `unfused_ops`, each (decode_twice's first and second logits, the
    cache's keys and values, greedy generate's 6 tokens, {op: calls of
    mps_ext's `op` that ran in decode_twice} for `ops`)."""
    runs = []
    for kernels in (fused_attention._KERNELS, unfused_ops):
        with monkeypatch.context() as m:
            m.setattr(fused_attention, "_KERNELS", kernels)
            with run_model(RELEASE) as report:
                first, second, _, cache = decode_twice(model, name)
            with run_model(RELEASE):
                tokens = model.generate(ids(), max_new_tokens=6, do_sample=False)
        runs.append((first, second, cache_contents(cache), tokens, {op: ran(report, f"mps_ext::{op}") for op in ops}))
    return runs


# The kernels' path before the cache append joined the norm and rotary
# dispatch: qk_norm_rope, then kv_append.
_UNFUSED = fused_attention._KERNELS._replace(qk_append=None)


@pytest.mark.parametrize("kind", ["float32", "float16", "bfloat16", "fp8"])
@pytest.mark.parametrize("name", list(ATTENTION))
def test_cache_append_in_the_rope_dispatch_changes_no_bit(monkeypatch, name, kind):
    """qk_norm_rope_append against the two dispatches it replaces
    (qk_norm_rope, then kv_append), on the executor, whole models: the
    logits of decode_twice (the cache buffers growing twice, a crop, a
    second prompt), the caches' keys and values, and greedy generate's
    tokens, bit for bit; one qk_norm_rope_append per attention layer and
    forward and no qk_norm_rope or kv_append, against one of each."""
    layers = ATTENTION[name][0]
    if kind == "float16":
        monkeypatch.setattr(fused_attention, "KV_STEP", GROWTH)
        model = mps_ext.optimize(make(name, torch.float16, **HEAD.get(name, {})))
    else:
        model = gated_and_cached(monkeypatch, name, kind)[0]
    fused, unfused = fused_and_unfused(monkeypatch, model, name, _UNFUSED,
                                       ("qk_norm_rope_append", "qk_norm_rope", "kv_append"))
    assert torch.equal(fused[0], unfused[0]) and torch.equal(fused[1], unfused[1])
    for (k, v), (uk, uv) in zip(fused[2], unfused[2], strict=True):
        assert torch.equal(k, uk) and torch.equal(v, uv)
    assert torch.equal(fused[3], unfused[3])
    calls = (11 + 5) * len(layers)  # decode_twice's forwards, one append per attention layer
    assert fused[4] == {"qk_norm_rope_append": calls, "qk_norm_rope": 0, "kv_append": 0}
    assert unfused[4] == {"qk_norm_rope_append": 0, "qk_norm_rope": calls, "kv_append": calls}


def gates_in_gemv(model, dtype) -> int:
    """Of decode_twice's forwards (a prompt of PROMPT tokens, 10 decode
    steps, a prompt of 3, 4 steps), those whose rows of a gated layer's
    attention output the GEMV stages (sigmoid_gate_linear: at most 8 rows
    of at most 8 KB; attention.sigmoid_gate_linear's bounds)."""
    k = next(m.o_proj.in_features for m in model.modules() if isinstance(m, FusedQKNormRopeMixin))
    size = torch.empty((), dtype=dtype).element_size()
    return sum(rows <= 8 and rows * k * size <= 8192 for rows in [PROMPT] + [1] * 10 + [3] + [1] * 4)


# The kernels' path before the output gate joined o_proj's GEMV: sigmoid_gate, then o_proj's linear.
_GATE_APART = fused_attention._KERNELS._replace(gate_out=None)


@pytest.mark.parametrize("kind", ["float32", "float16", "bfloat16", "fp8"])
def test_gate_in_the_output_gemv_changes_no_bit(monkeypatch, kind):
    """sigmoid_gate_linear against the two dispatches it replaces
    (sigmoid_gate, then o_proj's GEMV), on the executor, the whole tiny
    Qwen3.5-MoE: the logits of decode_twice (two prompts, 14 decode steps)
    and greedy generate's tokens, bit for bit; one sigmoid_gate_linear per
    gated layer and forward of rows the GEMV stages (gates_in_gemv: the
    decode steps, and in 16-bit types the 3-token prompt) and a
    sigmoid_gate for the others, against a sigmoid_gate every forward. With fp8 weights
    o_proj is an FP8Linear, which the op does not take: the same calls
    both ways."""
    name = "qwen3_5_moe"
    gated = ATTENTION[name][0]
    layers = len(gated)
    if kind == "float16":
        model = mps_ext.optimize(make(name, torch.float16, **HEAD.get(name, {})))
    else:
        model = gated_and_cached(monkeypatch, name, kind)[0]
    fused, unfused = fused_and_unfused(monkeypatch, model, name, _GATE_APART, ("sigmoid_gate_linear", "sigmoid_gate"))
    assert torch.equal(fused[0], unfused[0]) and torch.equal(fused[1], unfused[1])
    assert torch.equal(fused[3], unfused[3])
    forwards = 11 + 5
    in_gemv = 0 if kind == "fp8" else gates_in_gemv(model, dtype=next(model.parameters()).dtype) * layers
    assert fused[4] == {"sigmoid_gate_linear": in_gemv, "sigmoid_gate": forwards * layers - in_gemv}
    assert unfused[4] == {"sigmoid_gate_linear": 0, "sigmoid_gate": forwards * layers}


def test_no_cat_clone_sigmoid_or_mul_left(monkeypatch):
    """The aten calls of a gated attention layer's decode step (Qwen3.6's,
    in the census's trace): one qk_norm_rope_append (the cache append in
    the norm and rotary call) and one sigmoid_gate_linear (the output gate
    in o_proj's GEMV), no kv_append, sigmoid_gate, clone, cat, sigmoid or
    mul; without the changes, all of them."""
    from benchmarks import census
    tiny = census.tiny_model(census.MODELS["Qwen3.6-35B-A3B"])

    def ops(model):
        return [c.op for c in census.per_kind(census.trace_step(model, tokens=1, context=8, torch_release="2.15",
                                                                transform=mps_ext.optimize),
                                              tiny.config)["full_attention+moe"] if c.kind != "view"]

    ours = ops(tiny)
    with monkeypatch.context() as m:
        m.setattr(fused_attention, "_KERNELS", _APART)
        theirs = ops(tiny)
    assert ours.count("qk_norm_rope_append") == 1 and ours.count("sigmoid_gate_linear") == 1
    left = {"kv_append", "qk_norm_rope", "sigmoid_gate", "clone", "cat", "sigmoid", "mul", "copy_"} & set(ours)
    assert not left, ours
    assert theirs.count("cat") == 2 and {"clone", "sigmoid", "mul"} <= set(theirs), theirs


@mps_ext_executor.request()  # traced inside request(): the kernels' path, the one a Mac takes
def test_compiled_gate_and_cache(monkeypatch):
    """Compiled (fullgraph): the model's own gate line and cache update in
    the graph (no sigmoid_gate, no kv_append or qk_norm_rope_append) but at
    a decode step the gate in o_proj's GEMV (sigmoid_gate_linear, as
    eager: the decode attention and o_proj around it are mps_ext's), the
    eager model's logits."""
    from test_fp8_flows import Float8Inspector
    monkeypatch.setattr(fused_attention, "KV_STEP", GROWTH)
    model = mps_ext.optimize(make("qwen3_5_moe", torch.bfloat16))
    prompt = ids()
    want, _ = greedy(model, prompt, 5)
    torch._dynamo.reset()
    inspector = Float8Inspector()
    got, _ = greedy(torch.compile(model, backend=inspector.backend, fullgraph=True), prompt, 5)
    assert not {"sigmoid_gate", "kv_append", "qk_norm_rope_append"} & set(inspector.mps_ext_ops)
    assert "sigmoid_gate_linear" in inspector.mps_ext_ops
    torch.testing.assert_close(got, want)


def test_other_caches_keep_their_update():
    """A sliding-window layer, a cache of another class and a layer
    Cache.update has yet to add keep transformers' own update (torch.cat);
    a plain DynamicLayer takes kv_append."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer
    k, v = torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16)

    class Mine(DynamicCache):
        pass

    with run_model(RELEASE) as report:
        sliding = DynamicCache()
        sliding.layers.append(DynamicSlidingWindowLayer(sliding_window=8))
        fused_attention.cache_update(sliding, k, v, 0)
        lazy = DynamicCache()
        fused_attention.cache_update(lazy, k, v, 0)  # adds its layer: the original update
        assert type(lazy.layers[0]) is DynamicLayer and lazy.layers[0].keys.untyped_storage().nbytes() == k.nbytes
        other = Mine()
        other.layers.append(DynamicLayer())
        fused_attention.cache_update(other, k, v, 0)
        assert not ran(report, "mps_ext::kv_append")
        keys, values = fused_attention.cache_update(lazy, k, v, 0)
        assert ran(report, "mps_ext::kv_append") == 1
    assert torch.equal(keys, torch.cat([k, k], -2)) and torch.equal(values, torch.cat([v, v], -2))
    assert lazy.layers[0].keys is keys and lazy.get_seq_length() == 6


# ----------------------------------------------------------- decode attention (issue 32, point 6) --
# Per model, heads kv_decode_attention takes (head_dim 64, 128 or 256) in the tiny configs: gqa 8, 4 and 4.
DECODE_HEADS = {"qwen3_moe": dict(head_dim=128, num_attention_heads=8, num_key_value_heads=1),
                "qwen3_5_moe": dict(head_dim=256, num_attention_heads=8, num_key_value_heads=2),
                "lfm2_moe": dict(head_dim=64, num_attention_heads=4, num_key_value_heads=1)}


@pytest.mark.parametrize("prompt", [PROMPT, 140], ids=["one-block", "two-blocks"])
@pytest.mark.parametrize("name", list(ATTENTION))
def test_decode_attention_generates_the_stock_tokens(name, prompt):
    """Whole optimized models (float32) on the executor: greedy generate
    gives the stock model's tokens, and the decode steps' logits are within
    float32 rounding of the stock model's (1e-5 relative: the attention's
    sums in another order); every decode step of every attention layer is
    one kv_decode_attention call (one dispatch at 7 to 10 keys, two past
    128: 141 to 144 keys), the prefill none. Planted: the op's scale
    replaced by 1.0 fails the logits (relative error about 1e-1); the pass's
    `attention_mask is not None` check dropped fails the padded batch
    below."""
    layers = ATTENTION[name][0]
    overrides = dict(DECODE_HEADS[name], max_position_embeddings=512)
    stock = make(name, torch.float32, **overrides)
    model = mps_ext.optimize(make(name, torch.float32, **overrides))
    assert attention_layers(model) == layers
    new = 4
    with run_model(RELEASE) as report:
        tokens = model.generate(ids(prompt), max_new_tokens=new, do_sample=False)
        logits, _ = greedy(model, ids(prompt), new)
    want = stock.generate(ids(prompt), max_new_tokens=new, do_sample=False)
    want_logits, _ = greedy(stock, ids(prompt), new)
    assert torch.equal(tokens, want)
    assert rel_err(logits, want_logits) <= 1e-5
    # generate's and greedy's decode forwards (new - 1 and new), one call per attention layer each
    assert ran(report, "mps_ext::kv_decode_attention") == (2 * new - 1) * len(layers)
    kernels = report.families["kv_cache"].kernels
    merges = sum(n for k, n in kernels.items() if k.startswith("kv_decode_merge_"))
    assert merges == (0 if prompt + 2 * new <= 128 else (2 * new - 1) * len(layers))


def test_decode_attention_leaves_a_padded_batch_to_the_model():
    """A batch with left padding has a mask at decode: the model's
    attention function runs (no kv_decode_attention call), and the tokens
    are the stock model's."""
    overrides = dict(DECODE_HEADS["qwen3_moe"], max_position_embeddings=512)
    stock = make("qwen3_moe", torch.float32, **overrides)
    model = mps_ext.optimize(make("qwen3_moe", torch.float32, **overrides))
    prompt = torch.cat([ids(), ids(seed=2)])
    mask = torch.ones_like(prompt)
    mask[1, :2] = 0
    with run_model(RELEASE) as report:
        tokens = model.generate(prompt, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert torch.equal(tokens, stock.generate(prompt, attention_mask=mask, max_new_tokens=3, do_sample=False))
    assert not ran(report, "mps_ext::kv_decode_attention")
