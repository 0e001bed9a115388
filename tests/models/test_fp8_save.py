"""save_pretrained after quantize_fp8 (issue 30, point 3, the fp8 side): the
checkpoint is transformers' fine-grained FP8 format (float8_e4m3fn weights,
`weight_scale_inv`, config.json's quantization_config) and reloads to the
same logits through mps_ext.load_fp8 (the fp8 bytes and scales as saved) and
through transformers' own from_pretrained (which, without CUDA, de-quantizes
to bf16: the same logits to bf16 rounding). What the format cannot hold is
refused before anything is written."""

import json

import pytest
import safetensors.torch as safetensors_torch
import torch
import transformers

import mps_ext
from mps_ext import FP8Linear
from mps_ext.checkpoint import load_fp8

from test_fp8_checkpoint import dense_config, moe_config  # noqa: E402


def whole_blocks_config():
    """Every Linear's dimensions multiples of 128 (whole 128 x 128 blocks)."""
    return transformers.Qwen3Config(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=4, head_dim=32,
                                    max_position_embeddings=64, tie_word_embeddings=False)


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.double()


def rel(got, want):
    return ((got - want).norm() / want.norm()).item()


def quantized(config, granularity, optimize_first=False):
    torch.manual_seed(0)
    # bf16 from the start, as from_pretrained makes it (a .to(bfloat16) would round RoPE's inv_freq too)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.05)
    if optimize_first:
        mps_ext.optimize(model)
    return mps_ext.quantize_fp8(model, granularity=granularity)


IDS = torch.tensor([[3, 17, 42, 5, 77, 9, 60, 1]])


@pytest.mark.parametrize("granularity", ["block", "tensor"])
def test_save_pretrained_writes_the_fine_grained_fp8_format_and_reloads(granularity, tmp_path):
    model = quantized(whole_blocks_config() if granularity == "block" else dense_config(), granularity)
    want = logits(model, IDS)
    model.save_pretrained(tmp_path)

    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "fp8"
    assert qc["weight_block_size"] == ([128, 128] if granularity == "block" else None)
    assert qc["modules_to_not_convert"] == ["lm_head"]
    saved = safetensors_torch.load_file(str(tmp_path / "model.safetensors"))
    linears = {n: m for n, m in model.named_modules() if isinstance(m, FP8Linear)}
    assert linears and not [k for k in saved if k.endswith(".weight_scale")]
    for name, m in linears.items():  # the bytes and scales, unchanged
        assert saved[name + ".weight"].dtype == torch.float8_e4m3fn
        assert torch.equal(saved[name + ".weight"].view(torch.uint8), m.weight.view(torch.uint8))
        assert torch.equal(saved[name + ".weight_scale_inv"], m.weight_scale)

    ours = load_fp8(tmp_path, device="cpu", dtype=torch.bfloat16)
    assert {n for n, m in ours.named_modules() if isinstance(m, FP8Linear)} == set(linears)
    assert torch.equal(logits(ours, IDS), want)

    stock = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert not any(p.dtype == torch.float8_e4m3fn for p in stock.parameters())  # de-quantized on load
    assert rel(logits(stock, IDS), want) < 0.02  # bf16 weights and products against float32 sums

    # What load_fp8 gives saves the same way.
    ours.save_pretrained(tmp_path / "again")
    assert torch.equal(logits(load_fp8(tmp_path / "again", device="cpu", dtype=torch.bfloat16), IDS), want)


@pytest.mark.parametrize("granularity", ["block", "tensor"])
@pytest.mark.parametrize("order", ["optimize, quantize_fp8", "quantize_fp8, optimize"])
def test_an_optimized_model_saves_under_the_stock_names(order, granularity, tmp_path):
    """optimize fuses q/k/v and gate/up into one layer each; the checkpoint
    still holds each projection under its own name, in the format's shapes
    (a fused layer's tensor-scaled members each save their one scale), so
    transformers reloads it, and load_fp8 then optimize gives the model's
    logits bit for bit. Quantized before optimize: the very checkpoint of
    the model never optimized."""
    config = whole_blocks_config() if granularity == "block" else dense_config()
    if order.startswith("optimize"):
        model = quantized(config, granularity, optimize_first=True)
    else:
        model = mps_ext.optimize(quantized(config, granularity))
    assert model.optimize_summary["projections"].converted
    want = logits(model, IDS)
    model.save_pretrained(tmp_path / "optimized")
    plain = quantized(config, granularity)
    plain.save_pretrained(tmp_path / "plain")
    saved, stock_names = (
        safetensors_torch.load_file(str(tmp_path / d / "model.safetensors")) for d in ("optimized", "plain")
    )
    assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in stock_names.items()}
    qc, plain_qc = (json.loads((tmp_path / d / "config.json").read_text())["quantization_config"]
                    for d in ("optimized", "plain"))
    assert qc == plain_qc
    if order.startswith("quantize"):
        assert all(
            torch.equal(
                saved[k].view(torch.uint8) if saved[k].dtype == torch.float8_e4m3fn else saved[k],
                stock_names[k].view(torch.uint8) if saved[k].dtype == torch.float8_e4m3fn else stock_names[k],
            )
            for k in saved
        )
    ours = mps_ext.optimize(load_fp8(tmp_path / "optimized", device="cpu", dtype=torch.bfloat16))
    assert torch.equal(logits(ours, IDS), want)
    stock = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "optimized", dtype=torch.bfloat16)
    assert rel(logits(stock, IDS), want) < 0.02


@pytest.mark.parametrize(
    "case, match",
    [
        ("row", r"one fp8 scale per output row .* quantize_fp8\(model, granularity='block'\)"),
        (
            "ragged blocks",
            r"self_attn\.k_proj, .* and 7 more have a dimension that is not a multiple of 128.*granularity='tensor'",
        ),
        ("experts", r"model\.layers\.0\.mlp\.experts are FP8Experts, which hold one scale per expert output row"),
    ],
)
def test_save_pretrained_refuses_what_the_format_cannot_hold(case, match, tmp_path):
    config, granularity = {"row": (whole_blocks_config(), "row"), "ragged blocks": (dense_config(), "block"),
                           "experts": (moe_config(), "block")}[case]
    model = quantized(config, granularity)
    with pytest.raises(ValueError, match=match):
        model.save_pretrained(tmp_path)
    assert not (tmp_path / "model.safetensors").exists() and not (tmp_path / "config.json").exists()
