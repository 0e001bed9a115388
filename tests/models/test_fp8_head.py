"""quantize_fp8(model, lm_head=True): the LM head in fp8 as an option (off
by default), its logit error against the original head measured as it is
converted and reported in fp8_summary.head_error. At decode the head is a
large share of a token's bytes (Qwen3.6-35B-A3B's bf16 head is 1 GB, as
much as all the routed experts a token reads).

The oracles: the stock float32 model with the stored fp8 weights put back
(test_fp8_flows.oracle_of), and the head error recomputed here in float64
from the definition HeadError gives."""

import copy

import pytest
import torch
import transformers
from torch import nn

from mps_ext import FP8Linear, fp8, quantize_fp8
from mps_ext.checkpoint import load_fp8
from test_fp8_flows import dequantized64, oracle_of, rel  # noqa: E402  (tests/models is on sys.path under pytest)


def qwen3(tied: bool) -> nn.Module:
    config = transformers.Qwen3Config(vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      max_position_embeddings=64, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.05)
    return model


def head_error64(weight, q, scale, granularity):
    """HeadError's definition in float64: the same HEAD_PROBES N(0, 1)
    states (seed 0), logits of the weight and of its fp8 (q, scale)."""
    probes = torch.randn(fp8.HEAD_PROBES, weight.shape[1], generator=torch.Generator().manual_seed(0)).double()
    ref, got = probes @ weight.double().T, probes @ dequantized64(q, scale, granularity).T
    return ((got - ref).norm() / ref.norm()).item(), (got - ref).abs().max().item(), \
        ref.square().mean().sqrt().item(), (ref.argmax(-1) == got.argmax(-1)).double().mean().item()


@pytest.mark.parametrize("granularity", fp8.GRANULARITIES)
@pytest.mark.parametrize("slab_bytes", [None, 4 * 128 * 96], ids=["one-slab", "128-row-slabs"])
def test_head_error_is_its_float64_definition(granularity, slab_bytes, monkeypatch):
    # 700 rows: a ragged last 128-row block, and (with small slabs) 6 slabs whose argmax must carry over.
    if slab_bytes:
        monkeypatch.setattr(fp8, "TEMP_BYTES", slab_bytes)
    weight = torch.randn(700, 96, generator=torch.Generator().manual_seed(3)).mul(0.05).to(torch.bfloat16)
    weight[611, :] *= 4  # one row whose logits often win, so the argmax crosses slabs
    q, scale = fp8.quantize_weight(weight, granularity)
    got = fp8.head_error(weight, q, scale, granularity)
    rms_relative, max_abs, logit_rms, top1 = head_error64(weight, q, scale, granularity)
    assert got.rms_relative == pytest.approx(rms_relative, rel=1e-4)
    assert got.max_abs == pytest.approx(max_abs, rel=1e-4)
    assert got.logit_rms == pytest.approx(logit_rms, rel=1e-5)
    assert got.top1_agreement == top1
    assert 0.005 < got.rms_relative < 0.05  # e4m3's 3 mantissa bits: a few percent, not zero


@pytest.mark.parametrize("granularity", ["row", "block"])
def test_lm_head_true_converts_the_head_and_reports_its_error(granularity):
    original = qwen3(tied=False)
    model = quantize_fp8(copy.deepcopy(original), granularity=granularity, lm_head=True)
    summary = model.fp8_summary
    assert isinstance(model.lm_head, FP8Linear) and "lm_head" in summary.converted["FP8Linear"]
    assert "lm_head" not in summary.left
    head = model.lm_head
    assert summary.head_error == fp8.head_error(original.lm_head.weight, head.weight, head.weight_scale, granularity)
    assert str(summary.head_error) in str(summary)
    # The head's bytes: one per weight and its scales, where the bf16 head had two per weight.
    default = quantize_fp8(copy.deepcopy(original), granularity=granularity)
    saved = original.lm_head.weight.nbytes - head.weight.nbytes - head.weight_scale.nbytes
    assert default.fp8_summary.bytes_after - summary.bytes_after == saved > 0
    # What it computes: the stock model with the stored fp8 weights (the head's among them).
    ids = torch.randint(0, 320, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = model(ids).logits, oracle_of(model, original)(ids).logits
    assert rel(got, want) < 0.02


def test_the_default_leaves_the_head_and_reports_no_error():
    model = quantize_fp8(qwen3(tied=False))
    assert isinstance(model.lm_head, nn.Linear) and "lm_head" in model.fp8_summary.left
    assert model.fp8_summary.head_error is None and "LM head in fp8" not in str(model.fp8_summary)


def test_a_tied_head_gets_its_own_fp8_copy_and_save_refuses_it(tmp_path):
    original = qwen3(tied=True)
    model = quantize_fp8(copy.deepcopy(original), granularity="tensor", lm_head=True)
    assert isinstance(model.lm_head, FP8Linear)
    embedding = model.get_input_embeddings().weight
    assert embedding.dtype == torch.bfloat16 and torch.equal(embedding, original.get_input_embeddings().weight)
    # A checkpoint stores a tied pair once; transformers would tie the bf16 embedding to the head again.
    with pytest.raises(ValueError, match="tied to the input embedding"):
        model.save_pretrained(tmp_path)


def test_a_model_without_an_lm_head_is_refused():
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    with pytest.raises(ValueError, match="no nn.Linear LM head"):
        quantize_fp8(model, lm_head=True)
    assert isinstance(quantize_fp8(model)[0], FP8Linear)  # without the option, as before


def test_load_fp8_of_an_fp8_checkpoint_refuses_lm_head(tmp_path):
    quantize_fp8(qwen3(tied=False), granularity="tensor").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="lm_head choose how a bf16 checkpoint is quantized"):
        load_fp8(str(tmp_path), "cpu", lm_head=True)
    assert isinstance(load_fp8(str(tmp_path), "cpu").model.layers[0].mlp.up_proj, FP8Linear)

