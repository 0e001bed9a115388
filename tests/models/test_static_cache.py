"""The KV cache under torch.compile: transformers' static cache
(`cache_implementation="static"`) with mps_ext.optimize, the compile path
README and docs/decode.md give. What that path relies on, tested here:
Inductor writes a static layer's new rows in place (DynamicCache's torch.cat
copies the whole cache a token: the copy mps_ext's kv_append avoids eager
and cannot avoid compiled); the optimized models generate with a static
cache what the stock models generate with their default cache, eager and
compiled; the decode census counts the static rows (tests/test_benchmarks.py)."""

import re

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters
from transformers.cache_utils import DynamicLayer, StaticLayer

import mps_ext
import mps_ext_executor as cpu_metal
from model_compare import RELEASE
from test_optimize import ids, make

B, H, D = 1, 2, 16
CACHE = 64  # positions of the static layer
HELD = 5    # positions in the cache before the step


def _layer(kind):
    """A cache layer holding HELD positions, as after a prefill."""
    torch.manual_seed(0)
    k, v = torch.randn(B, H, HELD, D), torch.randn(B, H, HELD, D)
    layer = StaticLayer(max_cache_len=CACHE) if kind == "static" else DynamicLayer()
    layer.update(k, v)
    return layer


def _step(layer, k, v, q):
    keys, values = layer.update(k, v)
    return torch.nn.functional.scaled_dot_product_attention(q, keys, values)


_ALLOCATION = re.compile(r"empty_strided_\w+\(\(([\d, ]*)\)")


def _allocated(code: str) -> list[int]:
    """Elements of each buffer the generated code allocates."""
    sizes = []
    for dims in _ALLOCATION.findall(code):
        n = 1
        for d in filter(None, (x.strip() for x in dims.split(","))):
            n *= int(d)
        sizes.append(n)
    return sizes


@pytest.mark.parametrize("kind", ["static", "dynamic"])
def test_inductor_writes_a_static_cache_in_place(kind):
    """One decode step of one attention layer (the cache update, then SDPA)
    compiled by Inductor: for a static layer, the generated code allocates
    no buffer the size of the held keys (the new row is written into the
    layer's own buffers, which keep their address, and attention reads
    them); for DynamicLayer it allocates the grown keys and values (torch.cat
    copies the cache), which is what shows this check can fail. Both steps
    give eager's output."""
    from torch._inductor.utils import run_and_get_code
    torch._dynamo.reset()
    eager_layer, layer = _layer(kind), _layer(kind)
    k, v, q = torch.randn(B, H, 1, D), torch.randn(B, H, 1, D), torch.randn(B, H, 1, D)
    want = _step(eager_layer, k, v, q)
    keys_before = layer.keys.data_ptr()
    got, code = run_and_get_code(torch.compile(_step, backend="inductor", fullgraph=True), layer, k, v, q)
    torch.testing.assert_close(got, want)
    held = B * H * (HELD + 1) * D  # the keys after the step: what a copy of the cache allocates
    copies = [n for n in _allocated("\n".join(code)) if n >= held]
    if kind == "static":
        assert not copies, f"the compiled step allocates {copies} elements: a copy of the cache"
        assert layer.keys.data_ptr() == keys_before
        assert torch.equal(layer.keys[:, :, HELD], k[:, :, 0]) and torch.equal(layer.values[:, :, HELD], v[:, :, 0])
    else:
        assert copies, "torch.cat's grown cache is not among the compiled step's allocations: the check is blind"


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_5_moe", "lfm2_moe"])
def test_optimized_models_generate_with_a_static_cache(name):
    """Greedy generate with cache_implementation="static" after
    mps_ext.optimize, mps_ext's kernels running (run_model): the tokens the
    stock model generates with its default cache (the attention layers'
    static layers keep their own update; the DeltaNet and convolution
    layers' states are the same classes as in a dynamic cache)."""
    model = make(name)
    prompt = ids()
    with torch.no_grad():
        want = model.generate(prompt, max_new_tokens=5, do_sample=False)
    mps_ext.optimize(model)
    with torch.no_grad(), cpu_metal.run_model(RELEASE) as report:
        got = model.generate(prompt, max_new_tokens=5, do_sample=False, cache_implementation="static")
    assert report.families["moe"].ran > 0 and report.families["norm"].ran > 0
    assert torch.equal(got, want)


def test_compiled_optimized_model_generates_with_a_static_cache():
    """The forward of an optimized Qwen3-MoE compiled (aot_autograd: the
    graphs Inductor would get, run eagerly), generating with a static
    cache: the stock model's tokens; mps_ext's MoE layer and the decoder
    layers' fused norms (add_rms_norm_moe_layer, rms_norm_linear) are in the graphs
    (the attention's q and k norms and rotary are left to Inductor
    compiled), the cache update is index_copy_ into the static buffers, and
    no graph breaks."""
    model = make("qwen3_moe")
    prompt = ids()
    with torch.no_grad():
        want = model.generate(prompt, max_new_tokens=4, do_sample=False)
    mps_ext.optimize(model)
    ops = set()

    def inspect(gm, example_inputs):
        for node in gm.graph.nodes:
            if node.op == "call_function":
                ops.add(str(node.target))
        return gm.forward

    torch._dynamo.reset()
    counters.clear()
    model.forward = torch.compile(model.forward, backend=aot_autograd(fw_compiler=inspect), dynamic=False)
    with torch.no_grad(), cpu_metal.request():
        got = model.generate(prompt, max_new_tokens=4, do_sample=False, cache_implementation="static")
    assert torch.equal(got, want)
    # (a MoE layer's add and post-attention norm in its router's dispatch, the block's op: add_rms_norm_moe_layer)
    assert {"mps_ext.add_rms_norm_moe_layer.default", "mps_ext.rms_norm_linear.default"} <= ops, sorted(ops)
    assert "mps_ext.qk_norm_rope.default" not in ops, sorted(ops)
    assert "aten.index_copy.default" in ops, sorted(ops)  # functionalized index_copy_, reinplaced by Inductor
    assert not counters["graph_break"], dict(counters["graph_break"])
