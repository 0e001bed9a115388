"""torch.ops.mps_ext.linear_attention_decode (Gated DeltaNet decode,
csrc/ops/linear_attention.cpp) on the executor: against an independent
float64 recurrence written from the model's equations, and against
transformers' own Qwen3.5-MoE layer (its torch code, real cache) in float32,
float16 and bfloat16; every kernel variant; bad input.

Tolerances. float32: the kernel and transformers differ only in summation
order and in exp/rsqrt of the two libraries, a few float32 ulps through
the normalisations: 1e-5 of the output's largest magnitude (states: of
theirs). float16/bfloat16: both round the same intermediates to the dtype
(convolution, SiLU, beta, the recurrence's output, the norm); a float32
difference can move one of them across a rounding boundary, so the
outputs may differ by a couple of the dtype's ulps (bfloat16: 2^-8
relative): 2e-2 (bf16) and 4e-3 (fp16), and against float64 the kernel
must be no worse than transformers' own torch code (1.5x plus one ulp).
"""


import pytest
import torch
import torch.nn.functional as F

import transformers

import mps_ext  # noqa: F401  (registers the ops)
import mps_ext_executor as cpu_metal
from mps_ext.passes import LinearAttentionPass, run_pass
from mps_ext.passes.linear_attention import FusedDecodeMixin
from mps_ext.passes.linear_attention import gated_delta_step as reference
from decode_steps import linear_attention as call, linear_attention_inputs as inputs

ULP = {torch.float32: 2.0 ** -23, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}
TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}


def rel_err(x, ref):
    return float((x.double() - ref.double()).abs().max() / ref.double().abs().max())




# (batch, k_heads, v_heads, dk, dv, conv_k): Qwen3.6's 2 value heads per key head at tiny sizes; one value head
# per key head; dk past one thread's 8 rows (a state column over 16 threads) with more value channels than the
# 64 columns a 1024-thread threadgroup takes at once (three passes, the last partial), as Qwen3.6's 128 x 2 x 128.
SHAPES = [(2, 2, 4, 16, 16, 4), (1, 3, 3, 32, 8, 2), (1, 1, 2, 128, 80, 4)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}_hk{}_hv{}_dk{}_dv{}_k{}".format(*s))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_matches_float64_recurrence(shape, dtype):
    batch, k_heads, v_heads, dk, dv, conv_k = shape
    d = inputs(batch, k_heads, v_heads, dk, dv, conv_k, dtype)
    want, want_window, want_state = reference(**d, k_heads=k_heads, eps=1e-6)
    with cpu_metal.record() as rec:
        out = call(d, k_heads)
    assert [r.kernel for r in rec.dispatches] == ["linear_attention_decode_" + {
        torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}[dtype]]
    assert out.dtype == dtype and out.shape == (batch, v_heads * dv)
    # The window is moved, not computed: exact.
    assert torch.equal(d["conv_state"], want_window.to(dtype))
    # fp32: a few ulps through the norms; fp16/bf16: the intermediates rounded to the dtype (as the model does).
    tol = {torch.float32: 2e-5, torch.float16: 4 * ULP[torch.float16], torch.bfloat16: 4 * ULP[torch.bfloat16]}[dtype]
    assert rel_err(out, want) <= tol
    assert rel_err(d["recurrent_state"], want_state) <= (1e-5 if dtype == torch.float32 else 2 * ULP[dtype])


# ----------------------------------------------------------- the gates' softplus --
ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]
THRESHOLD = 20.0  # F.softplus's default, the kernel's LA_SOFTPLUS_THRESHOLD
EPS = 2.0 ** -23  # float32's unit in the last place at 1 (an ulp at x is at most EPS * |x|)
# Relative error the kernel's softplus (kernels_metal/activations.h) may have, from the precision of
# Metal's precise exp and log. With the C library's (within an ulp): exp's half ulp, which softplus
# passes on at most (d log1p(e) / log1p(e) <= de / e), log's half ulp and the multiply and divide
# of log1p_accurate (Goldberg's theorem 4: 5 eps for a correctly rounded log): 4 eps. At Metal's
# 4 ulp for exp and log (MSL 4, Table 8.1): 4 + 4 + 3.
SOFTPLUS_REL = {0: 4 * EPS, 1: 11 * EPS}
_SOFTPLUS_KERNEL = """
kernel void softplus_of(device float* out [[buffer(0)]], device const float* x [[buffer(1)]],
                        uint i [[thread_position_in_grid]]) {
  out[2 * i] = softplus(x[i], 20.0f);
  out[2 * i + 1] = x[i] > 20.0f ? x[i] : metal::precise::log(1.0f + metal::precise::exp(x[i]));  // as it was
}
"""


def softplus_on_executor(x, perturb=0):
    """activations.h's softplus (and the formula it replaced) on the executor, in MathMode(perturb=perturb)."""
    from tools.embed_shaders import flatten
    with cpu_metal.math_mode(perturb=perturb):
        lib = cpu_metal.compile_library(flatten(ROOT / "kernels_metal" / "activations.h") + _SOFTPLUS_KERNEL)
    out = torch.zeros(2 * len(x))
    lib.dispatch("softplus_of", [out, x], threads=len(x), threads_per_threadgroup=64)
    return out[0::2], out[1::2]


@pytest.mark.parametrize("perturb", [0, 1])
def test_softplus_is_torchs_to_a_few_ulps(perturb):
    """The gates' softplus as torch computes it (log1p(exp(x)) below the
    threshold, x above), against float64 from x = -30 to past the threshold:
    within SOFTPLUS_REL, also with exp and log as far off as Metal allows
    (perturb=1). log(1 + exp(x)), the kernel's formula before, is 3% off at
    x = -15 and 0 below x = -17 (1 + exp(x) rounds to 1)."""
    x = torch.cat([torch.linspace(-30, THRESHOLD, 4001), torch.tensor([-17.5, -15.0, -9.0, 0.0, 25.0])])
    got, old = softplus_on_executor(x, perturb)
    want = F.softplus(x.double())
    rel = ((got.double() - want) / want).abs()
    assert float(rel.max()) <= SOFTPLUS_REL[perturb], float(rel.max() / EPS)
    assert torch.equal(got[x > THRESHOLD], x[x > THRESHOLD])
    old_rel = ((old.double() - want) / want).abs()
    assert float(old_rel[x == -15.0].min()) > 0.02 and bool((old[x < -17.5] == 0).all())


@pytest.mark.parametrize("perturb", [0, 1])
def test_gates_follow_softplus_over_its_range(perturb):
    """The decode's decay, exp(-exp(A_log) * softplus(a + dt_bias)), with
    a + dt_bias from -30 to past the threshold, one value head each, and
    beta = sigmoid(-200) = 0, so that the new state is the old times the
    decay (one rounding): every state element within its error bound of
    float64's. The decay's relative error: exp(A_log) 4 ulp, the product
    half an ulp and softplus SOFTPLUS_REL[1], all times A * softplus (the
    exponent's size), plus the outer exp's 4 ulp and the state product's
    half: (4.5 eps + SOFTPLUS_REL[1]) A sp + 4.5 eps, with exp and log as
    far off as Metal allows too (perturb=1). The kernel before, with
    log(1 + exp(x)), was up to 10 ulps off below x = -17 at A = 16."""
    k_heads, ratio, dk, dv = 2, 26, 16, 8
    v_heads = k_heads * ratio
    d = inputs(1, k_heads, v_heads, dk, dv, 4, torch.float32)
    gate = torch.linspace(-30, THRESHOLD + 2, v_heads)
    d["dt_bias"] = torch.linspace(-1, 1, v_heads)
    d["a"] = (gate - d["dt_bias"])[None]
    # A = 16 (the largest Qwen3-Next's initialisation draws) where the softplus is small; less where it is
    # large, so that the decay, exp(-A sp), stays a normal float.
    d["A_log"] = torch.clamp(4.0 / F.softplus(gate.double()), max=16.0).log().float()
    d["b"] = torch.full((1, v_heads), -200.0)
    before = d["recurrent_state"].clone()
    with cpu_metal.math_mode(perturb=perturb):
        call(d, k_heads)
    A = d["A_log"].double().exp()
    sp = F.softplus(d["a"][0].double() + d["dt_bias"].double())
    want = before.double() * torch.exp(-A * sp)[None, :, None, None]
    bound = ((4.5 * EPS + SOFTPLUS_REL[1]) * A * sp + 4.5 * EPS)[None, :, None, None] * want.abs()
    err = (d["recurrent_state"].double() - want).abs()
    assert bool((err <= bound).all()), float((err / bound).max())


# ----------------------------------------------------------- transformers' own layer --
CONFIG = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, layer_types=["linear_attention"],
              num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
              num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)


def layer_and_cache(dtype, prompt=5, batch=2, seed=0):
    """transformers' Qwen3_5MoeGatedDeltaNet (random weights, its A_log and
    dt_bias as the model initialises them) and a DynamicCache after a
    prefill of `prompt` tokens through it (its chunked torch path)."""
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeGatedDeltaNet
    config = transformers.Qwen3_5MoeTextConfig(**CONFIG)
    torch.manual_seed(seed)
    layer = Qwen3_5MoeGatedDeltaNet(config, 0).to(dtype).eval()
    with torch.no_grad():  # the norm's weight is ones at init: make it count
        layer.norm.weight.copy_(1 + 0.1 * torch.randn(layer.norm.weight.shape))
    cache = transformers.DynamicCache(config=config)
    x = torch.randn(batch, prompt, config.hidden_size).to(dtype)
    with torch.no_grad():
        layer(x, cache_params=cache)
    return layer, cache, config


def clone_cache(cache):
    import copy
    return copy.deepcopy(cache)


@torch.no_grad()
def float64_layer_step(layer, cache, step):
    """The layer's decode step in float64 from `reference`: the projections
    of its own weights, its cache's states."""
    w = {n: getattr(layer, n).weight.double() for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
                                                          "out_proj")}
    x = step[:, 0].double()
    st = cache.layers[0]
    out, _, _ = reference(x @ w["in_proj_qkv"].T, x @ w["in_proj_z"].T, x @ w["in_proj_b"].T, x @ w["in_proj_a"].T,
                          st.conv_states[0], st.recurrent_states[0], layer.conv1d.weight[:, 0], layer.A_log,
                          layer.dt_bias, layer.norm.weight, layer.num_k_heads, layer.norm.variance_epsilon)
    return (out @ w["out_proj"].T)[:, None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_matches_transformers_layer(dtype):
    import copy
    layer, cache, config = layer_and_cache(dtype)
    step = torch.randn(2, 1, config.hidden_size, generator=torch.Generator().manual_seed(3)).to(dtype)
    theirs_cache, ours_cache = clone_cache(cache), clone_cache(cache)
    ref = float64_layer_step(layer, cache, step)
    fused = copy.deepcopy(layer)
    section = run_pass(LinearAttentionPass(), fused)
    converted, left = section.converted, section.left
    assert list(converted) == [""] and not left and isinstance(fused, FusedDecodeMixin)
    with torch.no_grad():
        theirs = layer(step, cache_params=theirs_cache)
        with cpu_metal.request(), cpu_metal.record() as rec:  # CPU tensors: the kernel's path
            ours = fused(step, cache_params=ours_cache)
    assert "linear_attention_decode_" + {torch.float32: "f32", torch.float16: "f16",
                                          torch.bfloat16: "bf16"}[dtype] in [r.kernel for r in rec.dispatches]
    assert ours.shape == theirs.shape and ours.dtype == dtype
    assert rel_err(ours, theirs) <= TOL[dtype]
    assert rel_err(ours, ref) <= 1.5 * rel_err(theirs, ref) + ULP[dtype]
    mine, their = ours_cache.layers[0], theirs_cache.layers[0]
    assert torch.equal(mine.conv_states[0], their.conv_states[0])
    assert mine.recurrent_states[0].dtype == torch.float32
    assert rel_err(mine.recurrent_states[0], their.recurrent_states[0]) <= (1e-5 if dtype == torch.float32 else
                                                                            4 * ULP[dtype])


def test_prefill_and_no_cache_run_the_layers_own_forward():
    """Not a cached decode step: the layer's own forward, not the decode kernel (its chunked delta rule on
    the prefill kernels: tests/ops/test_linear_attention_chunk.py)."""
    layer, cache, config = layer_and_cache(torch.float32)
    import copy
    fused = copy.deepcopy(layer)
    run_pass(LinearAttentionPass(), fused)
    x = torch.randn(2, 3, config.hidden_size)
    with torch.no_grad(), cpu_metal.request(), cpu_metal.record() as rec:
        a, b = fused(x), fused(x[:, :1])  # no cache: prefill, and a single token without one
    assert not any(r.kernel.startswith("linear_attention_decode") for r in rec.dispatches)
    torch.testing.assert_close(a, layer(x))
    torch.testing.assert_close(b, layer(x[:, :1]))


# ----------------------------------------------------------- bad input --
def test_bad_input():
    d = inputs(2, 2, 4, 16, 16, 4, torch.float32)

    def bad(match, k_heads=2, **change):
        with pytest.raises(RuntimeError, match=match):
            call({**d, **change}, k_heads)
    bad("float32, float16 or bfloat16", qkv=d["qkv"].double())
    bad("recurrent_state must be contiguous float32", recurrent_state=d["recurrent_state"].bfloat16())
    bad("recurrent_state must be contiguous float32", recurrent_state=d["recurrent_state"].transpose(2, 3))
    bad("one token per sequence", qkv=d["qkv"][:, None])
    bad("holds 1 sequences", recurrent_state=d["recurrent_state"][:1].contiguous())
    bad("multiple of k_heads", k_heads=3)
    bad("qkv holds 127 channels", qkv=d["qkv"][:, :127])
    bad("z must be", z=d["z"][:, :8])
    bad("b must be", b=d["b"].half())
    bad("conv_state must be contiguous", conv_state=d["conv_state"].transpose(0, 1).contiguous().transpose(0, 1))
    bad("conv_weight must be contiguous", conv_weight=d["conv_weight"][:, :3])
    bad("A_log must be contiguous", A_log=d["A_log"][:2])
    bad("norm_weight must be", norm_weight=d["norm_weight"].bfloat16())
    bad("at most 64 value heads per key head", k_heads=1,
        **inputs(1, 1, 65, 4, 4, 2, torch.float32))


def test_float64_layer_is_refused_and_left_unchanged():
    layer, _, _ = layer_and_cache(torch.float32)
    layer = layer.double()
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        LinearAttentionPass().refuse(layer)
    assert not isinstance(layer, FusedDecodeMixin)
