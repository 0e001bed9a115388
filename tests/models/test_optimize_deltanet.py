"""mps_ext.optimize on transformers 5's Qwen3.5-MoE (tiny random config with
a Gated DeltaNet layer and a full-attention layer): the linear-attention
layer's decode on torch.ops.mps_ext.linear_attention_decode, against stock
torch and float64; generate; host calls and dispatches per layer before
and after; torch.compile; what it leaves and why."""

import copy

import pytest
import torch

import transformers

import mps_ext
import mps_ext_executor
from mps_ext_executor import run_model
from mps_ext.passes.linear_attention import FusedDecodeMixin
from model_compare import RELEASE
from test_optimize import (decode_counts, generate_is_unchanged_by_optimize, ids, make,
                           optimized_against_stock_and_float64, prefill_and_decode)


def deltanet_layers(model):
    return [m for m in model.modules() if hasattr(m, "A_log") and hasattr(m, "conv1d")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_optimized_decode_matches_stock_and_float64(figures, dtype):
    model, prompt, step, ref, stock = optimized_against_stock_and_float64("qwen3_5_moe", dtype)
    summary = model.optimize_summary
    assert (
        list(summary["linear_attention"].converted) == ["model.layers.0.linear_attn"]
        and not summary["linear_attention"].left
    )
    assert "linear_attention_decode" in str(summary)
    assert all(isinstance(m, FusedDecodeMixin) for m in deltanet_layers(model))
    with run_model(RELEASE) as report:
        ours = prefill_and_decode(model, prompt, step)
    figures.families = report.ran_kernels()
    # one layer, the decode step
    assert report.families["linear_attention"].ops["mps_ext::linear_attention_decode"].ran == 1
    for what, i in (("prefill", 0), ("decode", 1)):
        figures.no_worse(what, ours[i], stock[i], ref[i], dtype)


def test_generate_gives_stock_tokens():
    """Greedy decoding of several tokens (each step reads the states the
    previous one wrote in place) gives the stock model's tokens."""
    generate_is_unchanged_by_optimize(make("qwen3_5_moe"), "linear_attention_decode", 4)  # 4 decode steps


def test_generate_after_a_prompt_longer_than_a_chunk_gives_stock_tokens():
    """A 70-token prompt (two chunks of the delta rule) prefilled on linear_attention_chunk, then decode on
    linear_attention_decode from the state it left: the stock model's tokens."""
    generate_is_unchanged_by_optimize(make("qwen3_5_moe"), "linear_attention_chunk", 1, tokens=4, prompt=70)


def per_deltanet_layer(model):
    """(host calls, executor dispatches) of the linear-attention layer in one decode step."""
    ((_, calls, dispatches),) = decode_counts(model, deltanet_layers(model)[:1])
    return calls, dispatches


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_host_calls_and_dispatches_per_layer(monkeypatch, dtype):
    # The layer's own calls, its input norm apart (mps_ext.passes.decoder would run the in_proj GEMV
    # with it, rms_norm_linear, outside the layer counted here: test_optimize_decoder.py tests that).
    from mps_ext.passes import decoder
    monkeypatch.setattr(decoder, "norm_into_projection", lambda x, norm, mixer: norm(x))
    model = make("qwen3_5_moe", dtype)
    before = per_deltanet_layer(model)
    mps_ext.optimize(model)
    after = per_deltanet_layer(model)
    print(f"\nQwen3.5-MoE Gated DeltaNet layer {dtype}, per decoded token (host calls, dispatches): before {before}, "
          f"after {after}")
    # in_proj_qkv, _z, _b, _a as one GEMV (mps_ext/passes/projections.py), linear_attention_decode, out_proj.
    assert after == (3, 3)
    assert before[0] >= 16 * after[0]  # transformers' torch code: 49 aten calls in float32


def test_left_with_the_reason():
    """Qwen3-Next's interleaved projections are left, said so; its MoE blocks are still converted."""
    config = transformers.Qwen3NextConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                          num_key_value_heads=1, head_dim=16, linear_num_key_heads=2,
                                          linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                                          num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                          shared_expert_intermediate_size=16,
                                          layer_types=["linear_attention", "full_attention"])
    model = transformers.Qwen3NextForCausalLM(config).eval()
    prompt = torch.randint(1, 64, (1, 6), generator=torch.Generator().manual_seed(1))
    want = model(prompt).logits
    mps_ext.optimize(model)
    left = model.optimize_summary["linear_attention"].left
    assert list(left) == ["model.layers.0.linear_attn"] and "in_proj_qkvz" in left["model.layers.0.linear_attn"]
    assert model.optimize_summary["moe"].converted
    # Its two input projections are one GEMV all the same (mps_ext/passes/projections.py), read by its own forward.
    assert "model.layers.0.linear_attn.in_proj_qkvz_ba" in model.optimize_summary["projections"].converted
    torch.testing.assert_close(model(prompt).logits, want)


def test_idempotent_casts_and_state_dict():
    model = make("qwen3_5_moe")
    keys = set(model.state_dict())
    mps_ext.optimize(model)
    la = deltanet_layers(model)[0]
    la_keys = {k for k in model.state_dict() if ".linear_attn." in k}
    # The layer's own keys stay, its fused input projections' too (saved under the members' names).
    assert la_keys == {k for k in keys if ".linear_attn." in k}
    mps_ext.optimize(model)
    assert model.optimize_summary["linear_attention"].already == ["model.layers.0.linear_attn"]
    assert not model.optimize_summary["linear_attention"].converted
    clone = copy.deepcopy(model).to(torch.bfloat16)
    assert isinstance(deltanet_layers(clone)[0], FusedDecodeMixin) and deltanet_layers(clone)[0].A_log.dtype == \
        torch.bfloat16
    assert type(la).__name__ == "FusedQwen3_5MoeGatedDeltaNet"


def test_op_without_states_is_an_error():
    with pytest.raises(RuntimeError, match="the layer's cache after a prefill"):
        torch.ops.mps_ext.linear_attention_decode(torch.zeros(1, 8), torch.zeros(1, 2), torch.zeros(1, 1),
                                                  torch.zeros(1, 1), None, None, torch.zeros(8, 4), torch.zeros(1),
                                                  torch.zeros(1), torch.zeros(2), 1, 1e-6)


# ----------------------------------------------------------- torch.compile --
class _Inspector:
    """A torch.compile backend (aot_autograd: aten graphs) that records mps_ext's ops, also those functionalised
    (auto_functionalized wraps an op that writes its inputs); runs the graphs eagerly."""

    def __init__(self):
        from torch._dynamo.backends.common import aot_autograd
        self.ops = set()
        self.backend = aot_autograd(fw_compiler=self.inspect)

    def inspect(self, gm, example_inputs):
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            for target in (node.target, *node.args[:1]):
                if getattr(target, "namespace", None) == "mps_ext":
                    self.ops.add(target.name().split("::")[1])
        return gm.forward


@mps_ext_executor.request()  # traced inside request(): the kernels' path, the one a Mac takes
def test_compiled_optimized_model():
    model = mps_ext.optimize(make("qwen3_5_moe", torch.bfloat16))
    prompt, step = ids(), ids(1, seed=2)
    want = prefill_and_decode(model, prompt, step)
    torch._dynamo.reset()
    inspector = _Inspector()
    got = prefill_and_decode(torch.compile(model, backend=inspector.backend), prompt, step)
    assert "linear_attention_decode" in inspector.ops
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
