"""transformers 5 language models, tiny random configs (no download):
prefill, one decode step with the KV cache, and greedy generate(), in fp32
and bf16, against stock torch and float64 (model_compare.py). MoE blocks use
transformers' "grouped_mm" experts (integrations/moe.py: torch's
F.grouped_mm over the fused 3-D expert weights, which is aten::_grouped_mm)."""

import copy

import pytest
import torch

import mps_ext
from mps_ext_executor import run_model
from model_compare import RELEASE

import transformers

PROMPT, NEW_TOKENS = 6, 3
COMMON = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=64, tie_word_embeddings=False)
MOE = dict(experts_implementation="grouped_mm", num_experts_per_tok=2)


def run_llm(model, ids, step):
    """Prefill logits, the logits of decoding `step` with the prefill's KV
    cache, and greedy generate()'s tokens and logits."""
    with torch.no_grad():
        prefill = model(ids, use_cache=True)
        decode = model(step, past_key_values=prefill.past_key_values, use_cache=True).logits
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
    return prefill.logits, decode, out.sequences[:, PROMPT:], torch.stack(out.logits)


def check_llm(figures, model, dtype, families):
    torch.manual_seed(0)
    ids = torch.randint(1, model.config.vocab_size, (1, PROMPT))
    ref_model = copy.deepcopy(model).double()
    if getattr(model.config, "_experts_implementation", None) == "grouped_mm":
        # torch's _grouped_mm takes no float64: the reference runs each
        # expert as its own matmul (transformers' "eager" experts).
        ref_model.set_experts_implementation("eager")
    step = ref_model(ids).logits[:, -1:].argmax(-1)  # the same next token for all three runs
    ref = run_llm(ref_model, ids, step)
    model = model.to(dtype)
    stock = run_llm(model, ids, step)
    with run_model(RELEASE) as report:
        ours = run_llm(model, ids, step)
    figures.ran(report, families)
    for what, i in (("prefill", 0), ("decode", 1)):
        figures.no_worse(what, ours[i], stock[i], ref[i], dtype)
    # Greedy tokens: where stock picks float64's tokens, ours must too
    # (with a near tie in the random model, stock itself may not).
    if torch.equal(stock[2], ref[2]):
        assert torch.equal(ours[2], ref[2]), (ours[2], ref[2])
        figures.no_worse("generate", ours[3], stock[3], ref[3], dtype)
    return report


def without_head_dim():
    """COMMON for configs that derive the head size themselves."""
    return {k: v for k, v in COMMON.items() if k != "head_dim"}


def tiny(config_cls, model_cls, **kwargs):
    torch.manual_seed(0)
    return model_cls(config_cls(**kwargs)).eval()


DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_qwen3_moe(figures, dtype):
    model = tiny(transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, **COMMON, **MOE,
                 intermediate_size=128, moe_intermediate_size=32, num_experts=8, norm_topk_prob=True)
    report = check_llm(figures, model, dtype, {"linear", "grouped_mm", "softmax"})
    # Every layer's two grouped products (gate+up, down) in each forward ran ours.
    assert report.families["grouped_mm"].left_to_torch == {}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_llama(figures, dtype):
    model = tiny(transformers.LlamaConfig, transformers.LlamaForCausalLM, **COMMON, intermediate_size=128)
    check_llm(figures, model, dtype, {"linear"})


def test_deepseek_v3(figures):
    """Shared experts beside the routed ones, a sigmoid router with group
    top-k and a correction bias, multi-head latent attention, the first
    layer dense."""
    model = tiny(transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM,
                 **{**without_head_dim(), "num_hidden_layers": 3, "num_key_value_heads": 4}, **MOE,
                 intermediate_size=128, moe_intermediate_size=32,
                 n_routed_experts=8, n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1,
                 kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
    check_llm(figures, model, torch.float32, {"linear", "grouped_mm"})


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_qwen3_next(figures, dtype):
    """A shared expert scaled by a sigmoid gate; gated delta-net linear
    attention in the first layer (its torch implementation: a causal
    depthwise conv1d after a left pad, and a triangular solve per chunk)."""
    model = tiny(transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM, **COMMON, **MOE,
                 intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=8,
                 layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4,
                 linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4)
    check_llm(figures, model, dtype, {"linear", "grouped_mm", "softmax", "pad", "linalg"})


def test_lfm2_moe(figures):
    """Short convolutions and attention layers, a sigmoid router with an
    expert bias, the first layer dense."""
    model = tiny(transformers.Lfm2MoeConfig, transformers.Lfm2MoeForCausalLM,
                 **without_head_dim(), **MOE,
                 intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_dense_layers=1,
                 layer_types=["conv", "full_attention"])
    check_llm(figures, model, torch.float32, {"linear", "grouped_mm"})


def test_qwen3_dense_with_eager_attention(figures):
    """transformers' eager attention: the attention weights' softmax in
    fp32 over rows the causal mask fills with -inf (ours), for a bf16 model
    whose products are bf16."""
    model = tiny(transformers.Qwen3Config, transformers.Qwen3ForCausalLM, **COMMON, intermediate_size=128,
                 attn_implementation="eager")
    report = check_llm(figures, model, torch.bfloat16, {"linear", "softmax"})
    # One per layer and forward: the prefill, the decode step, and generate()'s NEW_TOKENS forwards.
    assert report.families["softmax"].ops["aten::_softmax"].ran == (2 + NEW_TOKENS) * COMMON["num_hidden_layers"]


def test_qwen3_moe_under_the_policy_of_torch_2_15():
    """On torch 2.15 torch's own _grouped_mm and softmax forward run on a
    Mac (mps_ext/_policy.py); F.linear, whose decode rows torch's aten::linear
    does not send to its GEMV, stays mps_ext's."""
    model = tiny(transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, **COMMON, **MOE,
                 intermediate_size=128, moe_intermediate_size=32, num_experts=8, norm_topk_prob=True)
    ids = torch.randint(1, model.config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits
        with run_model("2.15") as report:
            got = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert report.ran_kernels() == {"linear"}
    assert report.families["grouped_mm"].ran == 0 and report.families["softmax"].ran == 0
    assert all(why.startswith(mps_ext.POLICY_PREFIX)
               for fam in ("grouped_mm", "softmax") for why in report.left_to_torch(fam))
    assert sum(report.left_to_torch("grouped_mm").values()) == 2 * COMMON["num_hidden_layers"]
