"""load_fp8 / quantize_fp8 of a bf16 safetensors checkpoint (issue 32,
point 5): the checkpoint is quantized as transformers reads it, one
parameter at a time, so the peak is the fp8 model plus about one shard,
never the bf16 model; and the result is quantize_fp8(from_pretrained(...))
bit for bit.

The checkpoints are transformers' own Qwen3 and Qwen3-MoE with tiny random
configs, written by save_pretrained in several shards (the MoE's expert
banks saved per expert, experts.N.gate_proj.weight, as on the Hub, and
merged back into gate_up_proj by transformers' loader). Peaks are torch's
CPU allocator as its profiler records it (test_fp8_memory.live_bytes):
everything measured is allocated inside the profiled region."""

import json
import os

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from mps_ext import FP8Linear, quantize_fp8
from mps_ext.checkpoint import load_fp8
from test_fp8_memory import live_bytes, nbytes  # noqa: E402  (tests/models is on sys.path under pytest)

# Bytes allowed beyond the fp8 model and the largest shard: the allocator's
# small blocks. The loader reads one tensor at a time into memory of its
# own size (mps_ext.checkpoint._LazyTensor), so what it holds beyond the fp8
# model is one parameter's conversion (measured below a shard here).
SLACK = 64 << 10


def dense():
    config = transformers.Qwen3Config(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                      tie_word_embeddings=False)
    return transformers.Qwen3ForCausalLM(config)


def moe():
    config = transformers.Qwen3MoeConfig(vocab_size=128, hidden_size=128, intermediate_size=256,
                                         moe_intermediate_size=128, num_experts=16, num_experts_per_tok=2,
                                         num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=32)
    return transformers.Qwen3MoeForCausalLM(config)


# (make, max_shard_size): shards of about a quarter of the bf16 model (an
# MoE shard holds about two layers' banks: transformers merges a layer's
# per-expert tensors into one bank before it is quantized).
CHECKPOINTS = {"qwen3": (dense, "1200KB"), "qwen3_moe": (moe, "3200KB")}


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def checkpoint(request, tmp_path_factory):
    make, shard = CHECKPOINTS[request.param]
    torch.manual_seed(0)
    model = make().to(torch.bfloat16)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path, max_shard_size=shard)
    shards = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    assert len(shards) >= 4, shards
    return str(path), shards


def fp8_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, to compare fp8 values bit for bit."""
    return tensor.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensor


def assert_same_model(got, want):
    assert type(got) is type(want)
    sg, sw = dict(got.named_buffers()) | dict(got.named_parameters()), \
        dict(want.named_buffers()) | dict(want.named_parameters())
    assert sg.keys() == sw.keys()
    for name in sw:  # weights, scales, biases, norms, the rotary inv_freq (computed, not in the checkpoint)
        g, w = sg[name], sw[name]
        assert (g.dtype, g.shape, g.requires_grad) == (w.dtype, w.shape, w.requires_grad), name
        assert torch.equal(fp8_bytes(g), fp8_bytes(w)), name
    assert got.fp8_summary == want.fp8_summary
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(got(ids).logits, want(ids).logits)


@pytest.mark.parametrize("checkpoint, options", [
    ("qwen3", dict()), ("qwen3", dict(granularity="block")),
    ("qwen3_moe", dict()), ("qwen3_moe", dict(granularity="tensor", filter=lambda name, m: ".mlp." in name)),
    ("qwen3", dict(granularity="block", lm_head=True)), ("qwen3_moe", dict(lm_head=True)),
], indirect=["checkpoint"], ids=["qwen3-row", "qwen3-block", "qwen3_moe-row", "qwen3_moe-tensor-mlp-only",
                                 "qwen3-block-lm_head", "qwen3_moe-row-lm_head"])
def test_a_bf16_checkpoint_loads_as_quantize_fp8_of_from_pretrained(checkpoint, options):
    path, _ = checkpoint
    want = quantize_fp8(transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16), **options)
    got = load_fp8(path, "cpu", dtype=torch.bfloat16, **options)
    assert any(got.fp8_summary.converted.values())  # something was converted, and the same
    if "moe" in path:
        assert len(got.fp8_summary.converted["FP8Experts"]) == 8
    # The LM head, with its logit error measured from the bf16 tensor as it is read (compared below).
    assert isinstance(got.lm_head, FP8Linear) == options.get("lm_head", False)
    assert (got.fp8_summary.head_error is not None) == options.get("lm_head", False)
    assert_same_model(got, want)
    assert getattr(got.config, "quantization_config", None) is None  # the config says bf16, as quantize_fp8's
    if not options:  # quantize_fp8 takes the path too: the same loader
        assert_same_model(quantize_fp8(path, dtype=torch.bfloat16), want)


def test_peak_is_the_fp8_model_plus_one_shard_not_the_bf16_model(checkpoint, monkeypatch):
    path, shards = checkpoint
    largest_shard = max(os.path.getsize(os.path.join(path, f)) for f in shards)
    # transformers' threads load the old way's tensors; their allocations must be seen by the profiler
    # (its memory events are per thread): one thread, what is held is the same.
    monkeypatch.setenv("HF_DEACTIVATE_ASYNC_LOAD", "1")

    loaded = []  # the loader makes everything inside live_bytes's step
    _, start, peak, end = live_bytes(lambda: None, lambda _: loaded.append(load_fp8(path, "cpu")))
    model = loaded.pop()
    fp8_model = nbytes([*model.parameters(), *model.buffers()])
    bound = fp8_model + largest_shard + SLACK

    old = []
    _, _, old_peak, _ = live_bytes(lambda: None, lambda _: old.append(
        transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)))
    bf16_model = nbytes([*old[0].parameters(), *old[0].buffers()])
    print(f"\n{os.path.basename(path)}: {len(shards)} shards, largest {largest_shard:,} B; fp8 model {fp8_model:,} B; "
          f"load_fp8 peak {peak:,} B = {peak / fp8_model:.2f}x the fp8 model (bound {bound / fp8_model:.2f}x); "
          f"from_pretrained's peak {old_peak:,} B = {old_peak / fp8_model:.2f}x (its bf16 model {bf16_model:,} B)")
    assert peak <= bound
    assert start == 0 and end == fp8_model  # everything allocated is the model, and nothing else stays
    # The old way: quantize_fp8 of from_pretrained's model, which holds the bf16 model whole first.
    assert bf16_model > bound and old_peak > bound


# ------------------------------------------------------------------ bad input --
def test_a_directory_without_safetensors_is_refused(tmp_path):
    dense().config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no safetensors checkpoint"):
        load_fp8(str(tmp_path), "cpu")


def _copy_with(src, dst, change):
    """The checkpoint at src written to dst with change(state dict) applied
    to the shard holding layer 1's q_proj (the index rewritten to match)."""
    with open(os.path.join(src, "model.safetensors.index.json")) as f:
        index = json.load(f)
    for name in os.listdir(src):
        if not name.endswith(".safetensors"):
            with open(os.path.join(src, name), "rb") as f, open(os.path.join(dst, name), "wb") as g:
                g.write(f.read())
    for shard in sorted(set(index["weight_map"].values())):
        state = load_file(os.path.join(src, shard))
        if "model.layers.1.self_attn.q_proj.weight" in state:
            change(state)
        save_file(state, os.path.join(dst, shard), metadata={"format": "pt"})
        for key in list(index["weight_map"]):
            if index["weight_map"][key] == shard and key not in state:
                del index["weight_map"][key]
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)


Q = "model.layers.1.self_attn.q_proj.weight"


@pytest.mark.parametrize("change, error", [
    (lambda s: s.pop(Q), f"lacks 2 tensor.*{Q}, {Q}_scale"),  # the weight, and so its scale
    (lambda s: s.update({Q: s[Q][:-1].contiguous()}), rf"{Q} is \[255, 256\] in the checkpoint.*wants \[256, 256\]"),
    (lambda s: s.update({Q: s[Q].to(torch.float8_e4m3fn)}), f"{Q} in model-.* is F8_E4M3"),
    (lambda s: s.update({Q: s[Q].to(torch.int8)}), f"{Q} in model-.* is I8"),
], ids=["missing", "shape", "fp8-without-config", "int8"])
def test_bad_checkpoints_are_refused_naming_the_tensor(tmp_path_factory, change, error):
    src = tmp_path_factory.mktemp("good")
    torch.manual_seed(0)
    dense().to(torch.bfloat16).save_pretrained(src, max_shard_size="1200KB")
    dst = tmp_path_factory.mktemp("bad")
    _copy_with(str(src), str(dst), change)
    with pytest.raises(ValueError, match=error):
        load_fp8(str(dst), "cpu")


def test_options_of_a_bf16_load_are_refused_for_an_fp8_checkpoint_and_checked(tmp_path):
    model = dense().to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="granularity must be one of"):
        load_fp8(str(tmp_path), "cpu", granularity="column")
    quantize_fp8(model, granularity="block").save_pretrained(tmp_path / "fp8")
    with pytest.raises(ValueError, match="is an fp8 checkpoint"):
        load_fp8(str(tmp_path / "fp8"), "cpu", granularity="row")
    with pytest.raises(TypeError, match="takes no"):
        quantize_fp8(dense(), dtype=torch.bfloat16)
    assert isinstance(load_fp8(str(tmp_path / "fp8"), "cpu").model.layers[0].mlp.up_proj, FP8Linear)
