"""Training through quantize_fp8's modules (issue 30, point 4, the fp8
side): gradients flow to the inputs of FP8Linear and FP8Experts on every
path (torch's CPU ops; the kernels, here on the CPU Metal executor, as on a
Mac), the fp8 weights are frozen, and what quantize_fp8 does not convert
keeps its requires_grad. The oracle is the stock transformers model with the
de-quantised fp8 weights, differentiated by torch."""

import contextlib
import copy

import pytest
import torch

from mps_ext import FP8Experts, FP8Linear
import mps_ext_executor
from mps_ext.fp8 import FROZEN, quantize_fp8

from test_fp8_flows import MOE, dequantized64, experts_of, make, oracle_of, rel, tokens  # noqa: E402

PATHS = {"torch's CPU ops": contextlib.nullcontext, "kernels (executor)": mps_ext_executor.request}


@pytest.mark.parametrize("path", PATHS)
def test_whole_model_gradients_are_the_dequantized_models(path):
    original = make(MOE["qwen3_moe"], torch.float32, attention_bias=True)
    model = quantize_fp8(copy.deepcopy(original))
    oracle = oracle_of(model, original)
    assert FROZEN in str(model.fp8_summary)
    # requires_grad: kept where nothing was converted, and on the biases.
    assert {n: p.requires_grad for n, p in model.named_parameters()} == \
        {n: p.requires_grad for n, p in original.named_parameters() if n in dict(model.named_parameters())}
    biases = [n for n, m in model.named_modules() if isinstance(m, FP8Linear) and m.bias is not None]
    assert biases and all(model.get_submodule(n).bias.requires_grad for n in biases)
    assert not any(b.requires_grad for b in model.buffers())  # fp8 weights and scales: frozen

    ids = tokens(9)
    with PATHS[path]():
        model(ids, labels=ids).loss.backward()
    oracle(ids, labels=ids).loss.backward()
    embed, want = model.model.embed_tokens.weight.grad, oracle.model.embed_tokens.weight.grad
    assert embed is not None and rel(embed, want) < 0.02, rel(embed, want)
    for n in biases:  # an FP8Linear's bias gets its gradient
        got, want = model.get_submodule(n).bias.grad, oracle.get_submodule(n).bias.grad
        assert got is not None and rel(got, want) < 0.02, (n, rel(got, want))
    router = "model.layers.0.mlp.gate.weight"  # its gradient goes through FP8Experts' top_k_weights
    assert rel(dict(model.named_parameters())[router].grad, dict(oracle.named_parameters())[router].grad) < 0.03


@pytest.mark.parametrize("path", PATHS)
def test_fp8_linear_input_gradient_is_grad_times_the_dequantized_weight(path):
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 40).bfloat16()
    fp8 = FP8Linear.from_linear(linear, "block")
    x = torch.randn(5, 48).bfloat16().requires_grad_()
    g = torch.randn(5, 40).bfloat16()
    with PATHS[path]():
        fp8(x).backward(g)
    w = dequantized64(fp8.weight, fp8.weight_scale, "block")
    assert rel(x.grad, g.double() @ w) < 0.01  # bf16 rounding of the float32 product
    assert torch.equal(fp8.bias.grad, g.float().sum(0).bfloat16())
    assert fp8.weight.grad is None and not fp8.weight.requires_grad


@pytest.mark.parametrize("path", PATHS)
def test_fp8_experts_gradients_of_hidden_states_and_routing_weights(path):
    experts = experts_of("qwen3_moe.modeling_qwen3_moe", "Qwen3MoeExperts", "Qwen3MoeConfig", num_experts=8,
                         moe_intermediate_size=32)
    fp8 = FP8Experts.from_experts(experts)
    experts.config._experts_implementation = "eager"  # transformers' own per-expert loop
    oracle = copy.deepcopy(experts)
    oracle.gate_up_proj.data = dequantized64(fp8.gate_up_proj, fp8.gate_up_scale).float()
    oracle.down_proj.data = dequantized64(fp8.down_proj, fp8.down_scale).float()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 64, generator=gen)
    ids = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(6)])
    w = torch.rand(6, 2, generator=gen)
    g = torch.randn(6, 64, generator=gen)
    grads = {}
    for name, module, context in (("fp8", fp8, PATHS[path]), ("oracle", oracle, contextlib.nullcontext)):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        with context():
            module(xi, ids, wi).backward(g)
        grads[name] = xi.grad, wi.grad
    assert rel(grads["fp8"][0], grads["oracle"][0]) < 0.02
    assert rel(grads["fp8"][1], grads["oracle"][1]) < 0.02
