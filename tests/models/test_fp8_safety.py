"""quantize_fp8 converts only what an fp8 module can stand for (issue 30,
point 7): each case is a real module that broke when converted, and must now
be left, with its reason in fp8_summary, while the rest of the model is
converted and the model still computes what it did (to fp8 rounding of what
was converted)."""

import copy
import re

import torch
from torch import nn

import transformers

import mps_ext
from mps_ext import FP8Linear

from test_fp8_flows import oracle_of, rel  # noqa: E402  (tests/models is on sys.path under pytest)


def converted(model):
    return {n for n, m in model.named_modules() if isinstance(m, FP8Linear)}


class Block(nn.Module):
    """A projection, then PyTorch's own multi-head attention."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 32)
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)

    def forward(self, x):
        h = self.proj(x)
        return self.attn(h, h, h, need_weights=False)[0]


def test_multihead_attention_out_proj_is_left():
    # nn.MultiheadAttention hands out_proj.weight to F.multi_head_attention_forward
    # itself (out_proj is never called): converting it fed float8 to a matmul.
    torch.manual_seed(0)
    original = Block().eval()
    model = mps_ext.quantize_fp8(copy.deepcopy(original))
    assert converted(model) == {"proj"}
    assert re.fullmatch(
        r"MultiheadAttention\.forward reads out_proj\.weight .*", model.fp8_summary.left["attn.out_proj"]
    )
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        got = model(x)
        want = oracle_of(model, original)(x)
    assert rel(got, want) < 1e-5  # the same math: only proj is fp8, and the oracle holds its fp8 weight


def t5_config():
    return transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                 feed_forward_proj="relu")


def test_t5_keeps_wo_in_float32_as_transformers_does():
    # T5 (the text encoder of Flux and SD3) lists wo in _keep_in_fp32_modules,
    # and its DenseReluDense casts the activations to wo.weight.dtype:
    # converting wo cast them to float8.
    torch.manual_seed(0)
    original = transformers.T5EncoderModel(t5_config()).to(torch.bfloat16).eval()
    model = mps_ext.quantize_fp8(copy.deepcopy(original))
    wo = [n for n, _ in original.named_modules() if n.endswith(".wo")]
    assert len(wo) == 2 and not converted(model) & set(wo)
    for name in wo:
        assert model.fp8_summary.left[name].startswith("the model keeps it in float32 (_keep_in_fp32_modules has 'wo')")
    assert {n.rsplit(".", 1)[1] for n in converted(model)} == {"q", "k", "v", "o", "wi"}
    ids = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = model(ids).last_hidden_state
        want = oracle_of(model, original)(ids).last_hidden_state
    assert got.dtype == torch.bfloat16 and rel(got, want) < 0.02


def test_a_module_whose_weight_its_owner_reads_is_left():
    # The same DenseReluDense outside a model that lists wo: its forward
    # reads self.wo.weight, which is the rule's own evidence.
    from transformers.models.t5.modeling_t5 import T5DenseActDense

    torch.manual_seed(0)
    original = T5DenseActDense(t5_config()).to(torch.bfloat16).eval()
    model = mps_ext.quantize_fp8(copy.deepcopy(original))
    assert converted(model) == {"wi"}
    assert model.fp8_summary.left["wo"].startswith("T5DenseActDense.forward reads wo.weight")
    x = torch.randn(3, 32).bfloat16()
    with torch.no_grad():
        assert rel(model(x), oracle_of(model, original)(x.float())) < 0.02


class KeepsDownProjInFloat32(transformers.Qwen3ForCausalLM):
    """A transformers model class that keeps its MLPs' down_proj in float32,
    as DeepSeek-V3.2 does its indexer's weights_proj."""

    _keep_in_fp32_modules_strict = ["mlp.down_proj"]


def qwen3_config():
    return transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                    max_position_embeddings=32)


def test_keep_in_fp32_modules_strict_is_respected():
    torch.manual_seed(0)
    model = mps_ext.quantize_fp8(KeepsDownProjInFloat32(qwen3_config()))
    down = {f"model.layers.{i}.mlp.down_proj" for i in range(2)}
    assert not converted(model) & down and {f"model.layers.{i}.mlp.up_proj" for i in range(2)} <= converted(model)
    for name in down:
        assert "(_keep_in_fp32_modules_strict has 'mlp.down_proj')" in model.fp8_summary.left[name]


class Doubled(nn.Linear):
    """An nn.Linear subclass whose forward is not nn.Linear's."""

    def forward(self, x):
        return 2 * super().forward(x)


def test_a_linear_subclass_is_left():
    torch.manual_seed(0)
    original = nn.Sequential(nn.Linear(16, 16), Doubled(16, 16)).eval()
    model = mps_ext.quantize_fp8(copy.deepcopy(original))
    assert converted(model) == {"0"}
    assert re.match(r"a subclass of nn\.Linear \(test_fp8_safety\.Doubled\)", model.fp8_summary.left["1"])
    x = torch.randn(4, 16)
    with torch.no_grad():
        assert rel(model(x), oracle_of(model, original)(x)) < 1e-5


def test_peft_lora_layers_are_left_and_their_adapters_train():
    # PEFT's LoRA layer casts its input to lora_A.weight.dtype and merges
    # into base_layer.weight: converting either broke the model. LoRA on an
    # fp8 model (the rest converted) is what a Mac user trains.
    import peft  # pinned in the test extra: missing is an error, not a skip
    torch.manual_seed(0)
    base = transformers.Qwen3ForCausalLM(qwen3_config()).eval()
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    nn.init.normal_(model.base_model.model.model.layers[0].self_attn.q_proj.lora_B["default"].weight, std=0.1)
    mps_ext.quantize_fp8(model)
    left = model.fp8_summary.left
    lora = [n for n in left if re.search(r"\.(q_proj|v_proj)(\.|$)", n)]
    assert lora and all(re.match(r"part of a PEFT adapter layer \(.*\.(q|v)_proj: Linear\)", left[n]) for n in lora)
    assert not [n for n in converted(model) if re.search(r"(q|v)_proj", n)]
    assert any(n.endswith("k_proj") for n in converted(model))
    ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(1))
    loss = model(ids, labels=ids).loss
    loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if "lora_" in n]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)
