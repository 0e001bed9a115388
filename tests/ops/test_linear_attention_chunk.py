"""torch.ops.mps_ext.linear_attention_chunk (Gated DeltaNet prefill, the
chunked delta rule, csrc/ops/linear_attention.cpp) on the executor: against
transformers' own torch_chunk_gated_delta_rule run in float64 (the oracle),
at lengths around the 64-token chunk, with and without an initial state,
every kernel variant; our float32 error no worse than transformers' own
float32 code's; the layer's prefill through optimize's pass continuing into
decode; gradients; bad input.

The bound is mps_ext.passes.linear_attention.CHUNK_TOLERANCE (its comment
says where it comes from): the output's largest difference over the float64
output's largest magnitude, the final state's over the float64 state's.
"""

import copy

import pytest
import torch

import mps_ext  # noqa: F401  (registers the ops)
import mps_ext_executor as cpu_metal
from mps_ext.passes import LinearAttentionPass, run_pass
from mps_ext.passes.linear_attention import CHUNK_TOLERANCE, FusedDecodeMixin, float64_rule
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as qwen

from test_linear_attention import layer_and_cache, rel_err

NAME = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


def original_rule():
    """transformers' function itself (the pass wraps its module's global)."""
    rule = qwen.torch_chunk_gated_delta_rule
    return getattr(rule, "__wrapped__", rule)


def inputs(batch, tokens, k_heads, v_heads, dk, dv, dtype, seed=0):
    """q, k, v as the layer makes them (views of one [batch, channels, tokens]
    convolution output, transposed: strided), g float32 <= 0 as the layer's
    -exp(A_log) softplus(.), beta in (0, 1) in the dtype, a float32 state."""
    gen = torch.Generator().manual_seed(seed)
    mixed = torch.randn(batch, 2 * k_heads * dk + v_heads * dv, tokens, generator=gen).to(dtype).transpose(1, 2)
    q, k, v = torch.split(mixed, [k_heads * dk, k_heads * dk, v_heads * dv], dim=-1)
    q, k = q.reshape(batch, tokens, k_heads, dk), k.reshape(batch, tokens, k_heads, dk)
    v = v.reshape(batch, tokens, v_heads, dv)
    g = -torch.rand(batch, tokens, v_heads, generator=gen) * 0.3
    beta = torch.rand(batch, tokens, v_heads, generator=gen).to(dtype)
    state = torch.randn(batch, v_heads, dk, dv, generator=gen)
    return q, k, v, g, beta, state


def float64(q, k, v, g, beta, state, l2=True):
    """transformers' own code computing in float64 (float64_rule: it casts to float32 as written)."""
    d = lambda t: None if t is None else t.double()  # noqa: E731
    out, final = float64_rule(original_rule())(d(q), d(k), d(v), g=d(g), beta=d(beta), initial_state=d(state),
                                                output_final_state=True, use_qk_l2norm_in_kernel=l2)
    assert out.dtype == final.dtype == torch.float64
    return out, final


def test_the_oracle_is_float64():
    """float64_rule really computes in float64: its result differs from transformers' float32 code's (which
    it equals bit for bit if the cast to float32 were left in place)."""
    q, k, v, g, beta, state = inputs(1, 70, 2, 2, 16, 8, torch.float32)
    want, _ = float64(q, k, v, g, beta, state)
    theirs, _ = original_rule()(q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True,
                                use_qk_l2norm_in_kernel=True)
    assert 0 < rel_err(theirs, want) < 1e-5


def ours(q, k, v, g, beta, state, l2=True):
    with cpu_metal.record() as rec:
        out, final = torch.ops.mps_ext.linear_attention_chunk(q, k, v, g, beta, state, l2)
    t = NAME[q.dtype]
    assert [r.kernel for r in rec.dispatches] == [f"linear_attention_chunk_prep_{t}",
                                                  f"linear_attention_chunk_state_{t}"]
    return out, final


LENGTHS = [1, 2, 63, 64, 65, 130, 200]


@pytest.mark.parametrize("with_state", [False, True], ids=["zeros", "initial_state"])
@pytest.mark.parametrize("tokens", LENGTHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matches_float64_reference(dtype, tokens, with_state):
    q, k, v, g, beta, state = inputs(2, tokens, 2, 4, 16, 8, dtype, seed=tokens)
    state = state if with_state else None
    want, want_state = float64(q, k, v, g, beta, state)
    out, final = ours(q, k, v, g, beta, state)
    assert out.dtype == dtype and out.shape == (2, tokens, 4, 8) and out.is_contiguous()
    assert final.dtype == torch.float32 and final.shape == (2, 4, 16, 8)
    tol = CHUNK_TOLERANCE[dtype]
    assert rel_err(out, want) <= tol
    assert rel_err(final, want_state) <= CHUNK_TOLERANCE[torch.float32]
    if dtype == torch.float32:
        # transformers' own float32 code against the same oracle. Both are a few float32 ulps off (1e-7 to
        # 8e-7 here); the sums run in other orders (ours sequential, BLAS's blocked), so ours is within twice
        # theirs plus two ulps, not below theirs case by case (measured: 0.4x to 1.8x of theirs).
        theirs, theirs_state = original_rule()(q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True,
                                               use_qk_l2norm_in_kernel=True)
        ulp = 2.0 ** -23
        assert rel_err(out, want) <= 2 * rel_err(theirs, want) + 2 * ulp
        assert rel_err(final, want_state) <= 2 * rel_err(theirs_state, want_state) + 2 * ulp


# (tokens, k_heads, v_heads, dk, dv): float16; one value head per key head with dv past a 32-column tile (two
# tiles, the second partial) and dk past a 16-column Gram slice (the last partial); dk 256, the largest, whose
# state pass takes tiles of 16 columns; dk and dv not whole 8 x 8 fragments (the scratch rows padded to 24 and
# 48: dk 20 ends inside the second Gram slice and a fragment, dv 44's second tile has 12 columns, the second
# of its fragments partial).
@pytest.mark.parametrize("shape, dtype", [((70, 2, 4, 16, 8), torch.float16), ((70, 3, 3, 40, 40), torch.float32),
                                          ((66, 1, 2, 256, 20), torch.bfloat16),
                                          ((70, 1, 2, 20, 44), torch.float32)], ids=str)
def test_other_shapes_and_float16(shape, dtype):
    tokens, hk, hv, dk, dv = shape
    q, k, v, g, beta, state = inputs(1, tokens, hk, hv, dk, dv, dtype, seed=dk)
    want, want_state = float64(q, k, v, g, beta, state)
    out, final = ours(q, k, v, g, beta, state)
    assert rel_err(out, want) <= CHUNK_TOLERANCE[dtype]
    assert rel_err(final, want_state) <= CHUNK_TOLERANCE[torch.float32]


def test_without_l2_norm():
    """use_qk_l2norm_in_kernel=False: q and k as given (q still scaled by dk^-0.5). Small keys keep the
    un-normalised delta rule stable."""
    q, k, v, g, beta, state = inputs(1, 70, 2, 2, 16, 8, torch.float32)
    q, k = q * 0.2, k * 0.2
    want, want_state = float64(q, k, v, g, beta, state, l2=False)
    out, final = ours(q, k, v, g, beta, state, l2=False)
    assert rel_err(out, want) <= CHUNK_TOLERANCE[torch.float32]
    assert rel_err(final, want_state) <= CHUNK_TOLERANCE[torch.float32]


# ------------------------------------------------------- through the pass --
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_layer_prefill_then_decode(dtype):
    """A converted layer's prefill of 70 tokens (two chunks) on the prefill kernels, then a decode step on
    linear_attention_decode from the state they left in the cache: both against the stock layer."""
    import transformers
    layer, _, config = layer_and_cache(dtype, prompt=1)
    fused = copy.deepcopy(layer)
    section = run_pass(LinearAttentionPass(), fused)
    assert list(section.converted) == [""] and isinstance(fused, FusedDecodeMixin)
    assert "linear_attention_chunk" in section.converted[""]
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 70, config.hidden_size, generator=gen).to(dtype)
    step = torch.randn(2, 1, config.hidden_size, generator=gen).to(dtype)
    theirs_cache, ours_cache = (transformers.DynamicCache(config=config) for _ in range(2))
    with torch.no_grad():
        theirs = layer(x, cache_params=theirs_cache)
        theirs_step = layer(step, cache_params=theirs_cache)
        with cpu_metal.request(), cpu_metal.record() as rec:
            got = fused(x, cache_params=ours_cache)
            got_step = fused(step, cache_params=ours_cache)
    kernels = [r.kernel for r in rec.dispatches]
    t = NAME[dtype]
    assert kernels.count(f"linear_attention_chunk_prep_{t}") == 1
    assert kernels.count(f"linear_attention_chunk_state_{t}") == 1
    assert kernels.count(f"linear_attention_decode_{t}") == 1
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]  # the layer's (passes/linear_attention.py TOLERANCE)
    assert rel_err(got, theirs) <= tol and rel_err(got_step, theirs_step) <= tol
    mine, their = ours_cache.layers[0].recurrent_states[0], theirs_cache.layers[0].recurrent_states[0]
    assert rel_err(mine, their) <= (1e-5 if dtype == torch.float32 else 1e-2)


def test_gradients_take_the_reference():
    """A forward that needs gradients runs transformers' differentiable code (no kernel), and the gradients
    are the stock layer's."""
    layer, _, config = layer_and_cache(torch.float32, prompt=1)
    fused = copy.deepcopy(layer)
    run_pass(LinearAttentionPass(), fused)
    x = torch.randn(1, 70, config.hidden_size, generator=torch.Generator().manual_seed(2))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    layer(xa).square().sum().backward()
    with cpu_metal.request(), cpu_metal.record() as rec:
        fused(xb).square().sum().backward()
    assert not any(r.kernel.startswith("linear_attention_chunk") for r in rec.dispatches)
    torch.testing.assert_close(xb.grad, xa.grad)
    torch.testing.assert_close(fused.A_log.grad, layer.A_log.grad)


def test_unconverted_layers_keep_transformers_rule():
    """The wrapper runs the original outside converted layers: a stock layer in the same process dispatches
    nothing."""
    layer, _, config = layer_and_cache(torch.float32, prompt=1)
    run_pass(LinearAttentionPass(), copy.deepcopy(layer))  # installs the wrapper
    assert qwen.torch_chunk_gated_delta_rule is not original_rule()
    x = torch.randn(1, 70, config.hidden_size)
    with torch.no_grad(), cpu_metal.request(), cpu_metal.record() as rec:
        layer(x)
    assert not rec.dispatches


# ----------------------------------------------------------- bad input --
def test_bad_input():
    q, k, v, g, beta, state = inputs(2, 5, 2, 4, 16, 8, torch.float32)

    def bad(match, **change):
        a = {**dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=state, use_qk_l2norm=True), **change}
        with pytest.raises(RuntimeError, match=match):
            torch.ops.mps_ext.linear_attention_chunk(*a.values())
    bad("float32, float16 or bfloat16", q=q.double(), k=k.double(), v=v.double(), beta=beta.double())
    bad("q and k must be", k=k[:, :, :1])
    bad("batch and tokens must agree", v=v[:, :4])
    bad("in q's dtype", v=v.bfloat16())
    bad("g \\(the log decay\\) must be float32", g=g.bfloat16())
    bad("g and beta must be", beta=beta[:, :, :2])
    bad("multiple of k_heads", q=q.repeat(1, 1, 3, 1)[:, :, :3], k=k.repeat(1, 1, 3, 1)[:, :, :3])
    bad("key heads of 1 to 256", **dict(zip("qk", (t.repeat(1, 1, 1, 17) for t in (q, k)))),
        initial_state=None)
    bad("initial_state must be contiguous float32", initial_state=state.transpose(2, 3))
    bad("initial_state must be contiguous float32", initial_state=state.bfloat16())


def test_empty_prompt_gives_the_initial_state():
    q, k, v, g, beta, state = inputs(1, 0, 2, 2, 16, 8, torch.float32)
    out, final = torch.ops.mps_ext.linear_attention_chunk(q, k, v, g, beta, state, True)
    assert out.shape == (1, 0, 2, 8) and torch.equal(final, state)
    _, zeros = torch.ops.mps_ext.linear_attention_chunk(q, k, v, g, beta, None, True)
    assert torch.equal(zeros, torch.zeros_like(state))
