"""Every step of an FP8 model's life, on transformers 5's own model code
(tiny random configs from its config classes, no downloads): quantize_fp8 of
each mixture-of-experts layout and what it reports, dtype casts, state_dict,
deepcopy, torch.compile, and the CPU path (torch's own ops unless the
executor is asked for). The reference is always the stock transformers
model run by torch on the CPU, with the weights the fp8 model stores."""

import copy
import re
import warnings

import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn

import transformers

import mps_ext  # noqa: E402
from mps_ext import FP8Experts, FP8Linear  # noqa: E402
import mps_ext_executor as cpu_metal

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
T = transformers
BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)
LINEAR_ATTENTION = dict(linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                        linear_num_value_heads=4, head_dim=16, layer_types=["linear_attention", "full_attention"])
# The MoE models a Mac user runs, one per experts layout of transformers 5.23
# (grep gate_up_proj in transformers/models/*/modeling_*.py): 8 experts, 2 per
# token, hidden 64, both layers MoE unless the model keeps dense ones.
MOE = {
    "qwen3_moe": (T.Qwen3MoeConfig, T.Qwen3MoeForCausalLM,
                  dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16)),
    "qwen3_next": (T.Qwen3NextConfig, T.Qwen3NextForCausalLM,  # shared expert with a sigmoid gate
                   dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                        shared_expert_intermediate_size=32, **LINEAR_ATTENTION)),
    "qwen3_5_moe": (T.Qwen3_5MoeTextConfig, T.Qwen3_5MoeForCausalLM,
                    dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                         shared_expert_intermediate_size=32, **LINEAR_ATTENTION)),
    "lfm2_moe": (T.Lfm2MoeConfig, T.Lfm2MoeForCausalLM,  # act_fn is F.silu itself
                 dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, num_dense_layers=1,
                      layer_types=["conv", "full_attention"])),
    "mixtral": (T.MixtralConfig, T.MixtralForCausalLM, dict(num_local_experts=8, num_experts_per_tok=2, head_dim=16)),
    "olmoe": (T.OlmoeConfig, T.OlmoeForCausalLM, dict(num_experts=8, num_experts_per_tok=2, eos_token_id=1)),
    "deepseek_v3": (T.DeepseekV3Config, T.DeepseekV3ForCausalLM,  # shared experts, a dense first layer
                    dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                         first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=None, kv_lora_rank=16,
                         qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, num_key_value_heads=4)),
    "aria": (T.AriaTextConfig, T.AriaTextForCausalLM,  # banks stored transposed, [E, H, 2I] and [E, I, H]
             dict(moe_num_experts=8, moe_topk=2, moe_num_shared_experts=1, head_dim=16, intermediate_size=32)),
}
# What FP8Experts cannot run, and the reason quantize_fp8 must give.
LEFT = {
    "gpt_oss": (T.GptOssConfig, T.GptOssForCausalLM, dict(num_local_experts=8, num_experts_per_tok=2, head_dim=16),
                r"expert biases \(gate_up_proj_bias, down_proj_bias\)"),
    "gemma4": (T.Gemma4TextConfig, T.Gemma4ForCausalLM,
               dict(enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=32, head_dim=16,
                    layer_types=["sliding_attention", "full_attention"], hidden_size_per_layer_input=0,
                    vocab_size_per_layer_input=128),
               r"act_fn GELUTanh\) is not SiLU\(gate\) \* up"),
    "llama4": (T.Llama4TextConfig, T.Llama4ForCausalLM,
               dict(num_local_experts=8, num_experts_per_tok=1, head_dim=16, intermediate_size_mlp=64,
                    moe_layers=[0, 1]),
               r"forward\(hidden_states: torch.Tensor\) -> torch.Tensor does not take \(hidden_states, top_k_index"),
}


def make(spec, dtype=torch.float32, seed=0, **overrides):
    config_class, model_class, extra = spec[:3]
    torch.manual_seed(seed)
    return model_class(config_class(**{**BASE, **extra, **overrides})).to(dtype).eval()


def tokens(n, seed=1):
    return torch.randint(0, BASE["vocab_size"], (1, n), generator=torch.Generator().manual_seed(seed))


def expert_modules(model):
    """Qualified names of the modules holding 3-D expert banks (transformers' layout)."""
    return [n for n, m in model.named_modules() if isinstance(getattr(m, "gate_up_proj", None), nn.Parameter)]


def dequantized64(q, scale, granularity="row"):
    """float64 weight an fp8 tensor and its scales stand for (the test's own
    reading of the recipes in mps_ext/fp8.py's docstring)."""
    w = q.double()
    if granularity == "block":
        return w * scale.double().repeat_interleave(128, 0).repeat_interleave(128, 1)[: w.shape[0], : w.shape[1]]
    return w * (scale.double()[..., None] if q.dim() == 3 else scale.double().reshape(-1, 1)
                if granularity == "row" else scale.double())


def oracle_of(quantized, original):
    """The stock float32 model `original` with the weights `quantized` stores
    (fp8 times scales) put back in the model's own layout: what the fp8
    model must compute, through transformers' code and torch's CPU ops."""
    oracle = copy.deepcopy(original).float()
    for name, mod in quantized.named_modules():
        if isinstance(mod, FP8Linear):
            # A new parameter, not .data: an LM head tied to the embedding keeps the embedding's
            # weights in the fp8 model (FP8Linear replaced the head, not the shared parameter).
            oracle.get_submodule(name).weight = nn.Parameter(
                dequantized64(mod.weight, mod.weight_scale, mod.granularity).float(), requires_grad=False)
        elif isinstance(mod, FP8Experts):
            target = oracle.get_submodule(name)
            gate_up, down = (dequantized64(mod.gate_up_proj, mod.gate_up_scale).float(),
                             dequantized64(mod.down_proj, mod.down_scale).float())
            if target.is_transposed:
                gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
            target.gate_up_proj.data, target.down_proj.data = gate_up.contiguous(), down.contiguous()
    return oracle


def rel(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def logits(model, ids, **kw):
    with torch.no_grad():
        return model(ids, **kw).logits


def quantize(model, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a converted model leaves no expert bank behind
        return mps_ext.quantize_fp8(model, **kw)


def ran():
    return {fam: s["ran"] for fam, s in mps_ext.stats().items() if s["ran"]}


# --------------------------------------------------- 1, 2: conversion and summary --
def fp8_bytes(module):
    """Bytes of a converted nn.Linear / expert-bank module as the recipe
    stores it: a byte per weight, an fp32 scale per output row, the bias."""
    if isinstance(module, nn.Linear):
        n, k = module.weight.shape
        return n * k + 4 * n + (module.bias.nbytes if module.bias is not None else 0)
    return module.gate_up_proj.numel() + module.down_proj.numel() + 4 * (
        module.gate_up_proj.shape[0] * (module.gate_up_proj.shape[1 if not module.is_transposed else 2]
                                        + module.down_proj.shape[1 if not module.is_transposed else 2]))


@pytest.mark.parametrize("name", MOE)
def test_quantize_fp8_converts_the_moe_blocks_of_transformers_models(name):
    original = make(MOE[name], torch.bfloat16)
    banks = expert_modules(original)
    assert banks
    before = {n: (fp8_bytes(m), sum(t.nbytes for t in m.parameters()))
              for n, m in original.named_modules() if isinstance(m, nn.Linear) or n in banks}
    model = quantize(copy.deepcopy(original))
    summary = model.fp8_summary
    fp8_experts = [n for n, m in model.named_modules() if isinstance(m, FP8Experts)]
    assert fp8_experts == banks == summary.converted["FP8Experts"]
    linears = [n for n, m in model.named_modules() if isinstance(m, FP8Linear)]
    assert linears == summary.converted["FP8Linear"] and linears
    assert not expert_modules(model)  # no bf16 bank left
    # Left: the LM head only (routers are not nn.Linear in these models, or are named gate / router).
    assert set(summary.left) == {n for n, m in original.named_modules() if isinstance(m, nn.Linear)} - set(linears)
    assert "lm_head" in summary.left and all("excluded by the filter" in why for why in summary.left.values())
    # Bytes: every parameter and buffer, before and after, as the recipe says.
    assert summary.bytes_before == sum(t.nbytes for t in [*original.parameters(), *original.buffers()])
    converted = set(linears) | set(banks)
    assert summary.bytes_after == summary.bytes_before - sum(b for n, (_, b) in before.items() if n in converted) + \
        sum(f for n, (f, _) in before.items() if n in converted)
    assert summary.bytes_after == sum(t.nbytes for t in [*model.parameters(), *model.buffers()])
    assert f"{len(banks)} FP8Experts" in str(summary) and f"{summary.bytes_after:,} bytes" in str(summary)
    # What it computes: the stock model with the stored fp8 weights, to bf16
    # rounding (FP8Experts keeps activations in bf16, as its kernels do).
    ids = tokens(6)
    oracle = logits(oracle_of(model, original), ids)
    assert rel(logits(model, ids), oracle) < 0.02
    assert rel(logits(model, ids), logits(original, ids)) < 0.08  # and the bf16 model, to fp8 rounding


@pytest.mark.parametrize("name", LEFT)
def test_quantize_fp8_says_which_expert_banks_it_left_and_why(name):
    config_class, model_class, extra, reason = LEFT[name]
    model = make(LEFT[name], torch.bfloat16)
    banks = expert_modules(model)
    ids = tokens(5)
    with pytest.warns(UserWarning, match="quantize_fp8 left expert banks in their dtype"):
        mps_ext.quantize_fp8(model)
    assert expert_modules(model) == banks and not any(isinstance(m, FP8Experts) for m in model.modules())
    for bank in banks:
        assert re.search(reason, model.fp8_summary.left[bank]), model.fp8_summary.left[bank]
    assert model.fp8_summary.converted["FP8Linear"]  # the rest of the model is converted
    assert torch.isfinite(logits(model, ids)).all()


# Experts modules of transformers 5 on their own (real classes, tiny configs):
# the gate is checked by value, and the layout flags are read.
def experts_of(module_path, class_name, config_class, **config):
    import importlib

    cls = getattr(importlib.import_module(f"transformers.models.{module_path}"), class_name)
    torch.manual_seed(0)
    experts = cls(getattr(T, config_class)(hidden_size=64, **config))
    for p in experts.parameters():
        nn.init.normal_(p, std=0.1)
    return experts


EXPERTS = {
    # SiLU computed in float32 (BeamExperts._apply_gate): SiLU by value.
    "beam": (("beam.modeling_beam", "BeamExperts", "BeamConfig", dict(num_experts=4, moe_intermediate_size=16)), None),
    # SiLU with gate and up clamped at swiglu_limit.
    "glm5_next": (("glm5_next.modeling_glm5_next", "Glm5NextTextExperts", "Glm5NextTextConfig",
                   dict(num_local_experts=4, moe_intermediate_size=16, swiglu_limit=7.0)),
                  r"Glm5NextTextExperts._apply_gate\) is not SiLU\(gate\) \* up"),
    # No gate: up_proj and relu^2.
    "nemotron_h": (("nemotron_h.modeling_nemotron_h", "NemotronHExperts", "NemotronHConfig",
                    dict(n_routed_experts=4, moe_intermediate_size=16)), r"no 3-D gate_up_proj"),
}


@pytest.mark.parametrize("name", EXPERTS)
def test_experts_gate_is_checked_by_value(name):
    args, reason = EXPERTS[name]
    experts = experts_of(*args[:3], **args[3])
    why = FP8Experts.why_not_convertible(experts)
    if reason is None:
        assert why is None and FP8Experts.convertible(experts)
        fp8 = FP8Experts.from_experts(experts)
        x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
        ids = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0], [0, 2]])
        w = torch.rand(5, 2, generator=torch.Generator().manual_seed(1))
        experts.config._experts_implementation = "eager"  # transformers' own per-expert loop
        oracle = copy.deepcopy(experts)
        oracle.gate_up_proj.data = dequantized64(fp8.gate_up_proj, fp8.gate_up_scale).float()
        oracle.down_proj.data = dequantized64(fp8.down_proj, fp8.down_scale).float()
        with torch.no_grad():
            assert rel(fp8(x, ids, w), oracle(x, ids, w)) < 0.01
    else:
        assert why is not None and re.search(reason, why), why
        with pytest.raises(ValueError, match=re.escape(why)):
            FP8Experts.from_experts(experts)


def test_interleaved_gate_and_up_rows_are_read_as_such():
    # GPT-OSS stores gate and up rows interleaved and transposed
    # (is_concatenated=False, is_transposed=True); without its biases and
    # with a plain SiLU gate it is a layout FP8Experts runs: the rows must
    # come out gate first, then up.
    experts = experts_of("gpt_oss.modeling_gpt_oss", "GptOssExperts", "GptOssConfig", num_local_experts=4)
    del experts.gate_up_proj_bias, experts.down_proj_bias
    experts.has_bias = False
    experts._apply_gate = lambda gate_up: nn.functional.silu(gate_up[..., ::2]) * gate_up[..., 1::2]
    fp8 = FP8Experts.from_experts(experts)
    gate_up = experts.gate_up_proj.detach().transpose(1, 2)  # [E, 2I, H], rows g0 u0 g1 u1 ...
    want = torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], 1)
    got = dequantized64(fp8.gate_up_proj, fp8.gate_up_scale)
    assert ((got - want.double()).abs() <= want.double().abs().amax(-1, keepdim=True) / 16).all()
    assert torch.allclose(dequantized64(fp8.down_proj, fp8.down_scale).float(),
                          experts.down_proj.detach().transpose(1, 2), rtol=0.07, atol=0.02)


# --------------------------------------------------------- 3: casts, state_dict --
CASTS = {
    "to(bfloat16)": (lambda m: m.to(torch.bfloat16), torch.bfloat16),
    "half()": (lambda m: m.half(), torch.float16),
    "bfloat16()": (lambda m: m.bfloat16(), torch.bfloat16),
    "float()": (lambda m: m.float(), torch.float32),
    "to(cpu, float16)": (lambda m: m.to("cpu", torch.float16), torch.float16),
    "to(dtype=float32)": (lambda m: m.to(dtype=torch.float32), torch.float32),
}


def storage_dtypes(model):
    return {n: b.dtype for n, b in model.named_buffers() if b.dtype in FP8 or n.endswith("_scale")}


@pytest.mark.parametrize("cast", CASTS)
def test_quantized_model_survives_dtype_casts(cast):
    fn, dtype = CASTS[cast]
    original = make(MOE["qwen3_moe"], torch.bfloat16, attention_bias=True)  # FP8Linears with a bias
    model = quantize(copy.deepcopy(original))
    stored = storage_dtypes(model)
    assert set(stored.values()) == {torch.float8_e4m3fn, torch.float32}
    assert fn(model) is model
    assert storage_dtypes(model) == stored  # fp8 weights and fp32 scales as they were
    assert {m.bias.dtype for m in model.modules() if isinstance(m, FP8Linear) and m.bias is not None} == {dtype}
    assert model.model.embed_tokens.weight.dtype == dtype
    ids = tokens(6)
    got = logits(model, ids)
    assert got.dtype == dtype
    assert rel(got, logits(oracle_of(model, original), ids)) < 0.03


def test_device_moves_apply_and_casts_do_not():
    # .to("mps", torch.bfloat16) on a Mac: the meta device stands for MPS here.
    model = quantize(make(MOE["qwen3_moe"], torch.bfloat16, attention_bias=True))
    stored = storage_dtypes(model)
    model.to("meta", torch.float16)
    assert {b.device.type for b in model.buffers()} | {p.device.type for p in model.parameters()} == {"meta"}
    assert storage_dtypes(model) == stored
    assert {p.dtype for p in model.parameters()} == {torch.float16}
    model.to_empty(device="cpu")  # and back, as a fresh model is materialised
    assert storage_dtypes(model) == stored and {b.device.type for b in model.buffers()} == {"cpu"}


def fp8_bits(sd):
    return {k: (v.view(torch.uint8) if v.dtype in FP8 else v) for k, v in sd.items()}


def test_quantized_model_state_dict_round_trip_and_deepcopy():
    model = quantize(make(MOE["qwen3_moe"], torch.bfloat16))
    sd = model.state_dict()
    fresh = quantize(make(MOE["qwen3_moe"], torch.bfloat16, seed=7))  # other weights, same structure
    ids = tokens(6)
    assert not torch.equal(logits(fresh, ids), logits(model, ids))
    fresh.load_state_dict(sd)
    assert torch.equal(logits(fresh, ids), logits(model, ids))
    back = fresh.state_dict()
    assert {k: v.dtype for k, v in back.items()} == {k: v.dtype for k, v in sd.items()}
    assert all(torch.equal(a, b) for a, b in zip(fp8_bits(back).values(), fp8_bits(sd).values()))
    twin = copy.deepcopy(model)
    assert storage_dtypes(twin) == storage_dtypes(model)
    assert torch.equal(logits(twin, ids), logits(model, ids))
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(twin.buffers(), model.buffers()))


# ----------------------------------------------------------- 4: torch.compile --
class Float8Inspector:
    """A torch.compile backend (aot_autograd, so the graphs are aten's) that
    fails on any op but mps_ext's own taking or giving a float8 tensor:
    inductor's Metal code generator has no float8 type (torch 2.9-2.15), so
    such an op would fail to compile on a Mac. CPU inductor has one, which
    is why compiling on CPU does not show it. Runs the graphs eagerly."""

    def __init__(self):
        from torch._dynamo.backends.common import aot_autograd

        self.mps_ext_ops = set()
        self.backend = aot_autograd(fw_compiler=self.inspect)

    def inspect(self, gm, example_inputs):
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            if getattr(node.target, "namespace", None) == "mps_ext":
                self.mps_ext_ops.add(node.target.name().split("::")[1])
                continue
            values = pytree.tree_leaves([node.meta.get("val")] + [a.meta.get("val") for a in node.all_input_nodes])
            fp8 = [v.dtype for v in values if isinstance(v, torch.Tensor) and v.dtype in FP8]
            assert not fp8, f"{node.format_node()} takes or gives {fp8[0]}: inductor cannot lower it on MPS"
        return gm.forward


def prefill_and_decode(model, ids):
    with torch.no_grad():
        out = model(ids[:, :-1], use_cache=True)
        step = model(ids[:, -1:], past_key_values=out.past_key_values, use_cache=True)
    return out.logits, step.logits


@cpu_metal.request()  # traced inside request(): the kernels' path, the one a Mac takes
def test_compiled_quantized_model_hands_inductor_no_float8_op(monkeypatch):
    # FP8Experts' prefill path past DECODE_ROWS routed rows, at 10 tokens x 2.
    monkeypatch.setattr(FP8Experts, "DECODE_ROWS", 8)
    model = quantize(make(MOE["qwen3_moe"], torch.bfloat16))
    ids = tokens(11)
    want = prefill_and_decode(model, ids)
    torch._dynamo.reset()
    inspector = Float8Inspector()
    compiled = torch.compile(model, backend=inspector.backend)
    got = prefill_and_decode(compiled, ids)
    assert {"fp8_linear", "moe_experts", "moe_combine", "fp8_grouped_linear"} <= inspector.mps_ext_ops
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


@cpu_metal.request()
def test_inductor_on_cpu_runs_a_quantized_moe_layer(monkeypatch):
    # One graph (a C++ compile of inductor's costs tens of seconds here): an
    # FP8Linear and the MoE block, router and FP8Experts' prefill path.
    # The decode ops go through inductor in tests/ops/test_torch_compile.py.
    monkeypatch.setattr(FP8Experts, "DECODE_ROWS", 8)
    layer = quantize(make(MOE["qwen3_moe"], torch.bfloat16, num_hidden_layers=1)).model.layers[0]
    h = torch.randn(1, 10, 64, generator=torch.Generator().manual_seed(0)).bfloat16()

    def block(h):
        return layer.mlp(layer.self_attn.o_proj(h))

    with torch.no_grad():
        want = block(h)
        torch._dynamo.reset()
        mps_ext.reset_stats()
        got = torch.compile(block, backend="inductor", fullgraph=True)(h)
    assert ran() == {"scaled_mm": 1, "grouped_mm": 2, "moe": 1}  # fp8_linear; two prefill products; moe_combine
    assert rel(got, want) < 0.01  # inductor fuses the bf16 elementwise ops around them its own way


# ------------------------------------------------ 5: CPU tensors, torch's ops --
def test_cpu_tensors_take_torchs_ops_unless_the_executor_is_asked_for():
    original = make(MOE["qwen3_moe"], torch.bfloat16)
    model = quantize(copy.deepcopy(original))
    ids = tokens(6)
    mps_ext.reset_stats()
    with cpu_metal.record() as rec:
        cpu = logits(model, ids)
    assert rec.dispatches == [] and ran() == {}
    with cpu_metal.request():
        kernels = logits(model, ids)
    assert ran()["scaled_mm"] == len(model.fp8_summary.converted["FP8Linear"])
    # Three ops a bank: two products (grouped_mm's, or moe_experts) and moe_combine.
    assert ran().get("grouped_mm", 0) + ran().get("moe", 0) == 3 * len(model.fp8_summary.converted["FP8Experts"])
    oracle = logits(oracle_of(model, original), ids)
    assert rel(cpu, oracle) < 0.02 and rel(kernels, oracle) < 0.02
    assert rel(cpu, kernels) < 0.01  # the same math, to float rounding


@pytest.mark.parametrize("rows", [6, 1200])
def test_fp8_experts_cpu_path_is_the_kernels_math(rows):
    experts = experts_of("qwen3_moe.modeling_qwen3_moe", "Qwen3MoeExperts", "Qwen3MoeConfig", num_experts=8,
                         moe_intermediate_size=32)
    fp8 = FP8Experts.from_experts(experts)
    gen = torch.Generator().manual_seed(0)
    tokens_ = rows // 2
    x = torch.randn(tokens_, 64, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(tokens_)])
    w = torch.softmax(torch.randn(tokens_, 2, generator=gen), -1).bfloat16()
    cpu = fp8(x, ids, w)
    with cpu_metal.request():
        kernels = fp8(x, ids, w)
    # Decode rows: the same math. Prefill (past 1024 rows) the kernels
    # quantise the activations to e4m3 as well; the CPU path keeps bf16.
    assert rel(cpu, kernels) < (0.01 if rows <= FP8Experts.DECODE_ROWS else 0.06)
    bad = ids.clone()
    bad[0, 0] = 8
    with pytest.raises(ValueError, match="top_k_index must hold experts 0 to 7, got [0-7] to 8"):
        fp8(x, bad, w)
