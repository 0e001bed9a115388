"""The prefill census (benchmarks/prefill.py) against independent counts:
its FLOP formula against the matrix products the traced tiny model's own
calls make, its per-chunk derivation of calls against a trace at a third
length, and its efficiency hook."""

import pytest

from benchmarks import census, prefill

import mps_ext  # noqa: F401  (the executor's backend of CPU tensors: tests/conftest.py)


@pytest.mark.parametrize("name", list(census.MODELS))
@pytest.mark.parametrize("length", [100, 192])
def test_the_flop_formula_is_what_the_traced_prefill_multiplies(name, length):
    """layer_flops of the tiny config, part by part and layer by layer,
    equals the FLOPs of the tiny prefill's own matrix calls (census.matrix_flops
    of each traced mm, bmm, linear, _grouped_mm, SDPA and triangular solve,
    from the tensors' shapes), at a length inside a chunk (100: the delta
    rule pads it to 128) and at whole chunks; the LM head on one row."""
    spec = census.MODELS[name]
    model = census.tiny_model(spec)
    trace = census.trace_prefill(model, length)
    traced = {}
    for call in trace.calls:
        if call.flops:
            part = prefill.part_of(call)
            assert part is not None, f"{call.op} makes matrix FLOPs outside every part"
            traced.setdefault(call.layer, {}).setdefault(part, 0)
            traced[call.layer][part] += call.flops
    for i, kind in enumerate(census.layer_kinds(model.config)):
        want = {p: f for p, f in prefill.layer_flops(model.config, kind, length).items() if f}
        assert traced[i] == want, (i, kind)
    assert traced[None] == prefill.head_flops(model.config)


def test_attention_flops_are_the_causal_half():
    """SDPA's count is over the pairs a causal prompt attends: L(L+1)/2 a
    head (is_causal, or a boolean mask of that triangle), and every pair
    without either."""
    import torch
    q = torch.zeros(1, 2, 5, 4)
    sdpa = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    full = 2 * 2 * 25 * 8
    assert census.matrix_flops(sdpa, (q, q, q), {}) == full
    assert census.matrix_flops(sdpa, (q, q, q), {"is_causal": True}) == full * 15 // 25
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    assert census.matrix_flops(sdpa, (q, q, q), {"attn_mask": mask}) == full * 15 // 25


# torch 2.15's policy (2.14's differs in which MoE products run mps_ext's kernels, not in what grows with the
# prompt; its executor products make it twice as slow here)
@pytest.mark.parametrize("release", ["2.15"])
def test_calls_per_chunk_predict_a_third_length(release):
    """scale_counts' base + per chunk x chunks, derived from the tiny
    Qwen3.6 prefill at trace_lengths, gives at a third length what a trace
    at that length counts (host calls, views, dispatches, syncs, per layer
    kind and in total), stock and with mps_ext; the DeltaNet layers' calls
    grow (the delta rule's loop over chunks), the attention layers' do not."""
    spec = census.MODELS["Qwen3.6-35B-A3B"]
    model = census.tiny_model(spec)
    lengths = prefill.trace_lengths(model.config)
    third = lengths[-1] + prefill.CHUNK
    for ours in (False, True):
        r = release if ours else None
        traces = {n: census.trace_prefill(model, n, torch_release=r) for n in lengths}
        derived = prefill.scale_counts(spec, traces, model.config, third, release, ours)
        direct = census.scale(spec, census.trace_prefill(model, third, torch_release=r), model.config, third,
                              release, "eager", ours)
        assert derived["total"] == direct["total"]
        for kind, counts in direct["per_kind"].items():
            assert derived["per_kind"][kind] == counts, kind
        assert derived["per_chunk"]["linear_attention+moe"].host > 0
        assert derived["per_chunk"]["full_attention+moe"] == census.Counts()


def test_trace_lengths_are_whole_chunks_past_the_moe_decode_slots():
    """Both traced lengths take mps_ext's MoE prefill path (more token slots
    than its decode kernels take) and differ by a chunk of the delta rule."""
    for spec in census.MODELS.values():
        config = spec.config(tiny=True)
        a, b = prefill.trace_lengths(config)
        assert a % prefill.CHUNK == 0 and b == a + prefill.CHUNK
        assert a * config.num_experts_per_tok > prefill.MOE_SLOTS


def test_a_counted_efficiency_replaces_the_assumption(monkeypatch):
    """MEASURED_EFFICIENCY (the executor's counted figure, when it lands)
    takes the place of a kernel's assumed efficiency, capped at the matrix
    ceiling; a kernel with neither is an error naming where to add it."""
    assumed, _ = prefill.efficiency("fp8_mm_tile")
    monkeypatch.setitem(prefill.MEASURED_EFFICIENCY, "fp8_mm_tile", 0.5)
    assert prefill.efficiency("fp8_mm_tile")[0] == 0.5 != assumed
    monkeypatch.setitem(prefill.MEASURED_EFFICIENCY, "fp8_mm_tile", 3.0)
    assert prefill.efficiency("fp8_mm_tile")[0] == prefill.MATRIX_CEILING
    with pytest.raises(KeyError, match="KERNEL_EFFICIENCY"):
        prefill.efficiency("no_such_kernel")



def test_a_releases_own_kernel_costs_its_op_on_that_release_only():
    """torch's _grouped_mm is costed by 2.15's counted tile on 2.15
    (RELEASE_COUNTED: torch's share over steel's, times MLX's steel
    measured) and by the MPSGraph assumption on 2.14 (the per-expert mm
    fallback). Planted: kernels_of without the RELEASE_COUNTED lookup
    fails the 2.15 line."""
    call = census.Call("_grouped_mm", 0, "compute", False, 0, 0, 0, ffn=True)
    c = prefill.RELEASE_COUNTED["torch _grouped_mm (2.15)"]
    assert prefill.kernels_of(call, "2.14") == prefill.kernels_of(call) == ["torch _grouped_mm"]
    assert prefill.kernels_of(call, "2.15") == [c.name]
    assert prefill.efficiency(c.name)[0] == pytest.approx(c.torch / c.steel * prefill._MLX_STEEL)
    assert prefill.efficiency("torch _grouped_mm")[0] == prefill._TORCH_MATMUL.value
    assert prefill.part_kernels([call], "2.15") == {"experts": c.name}



def test_the_prefill_plot_shows_each_peer_once_at_its_nearest_published_length(monkeypatch):
    from types import SimpleNamespace

    from benchmarks import bench_prefill
    peers = [("M", "engine a", "chip x", 512, 1000.0, "s"), ("M", "engine a", "chip x", 2048, 2000.0, "s"),
             ("M", "engine a", "chip y", 16384, 4000.0, "s"), ("M", "engine b", "chip x", 1024, 500.0, "s"),
             ("M", "engine b", "chip x", 8192, 800.0, "s"), ("other", "engine a", "chip x", 4096, 9.0, "s")]
    monkeypatch.setattr(bench_prefill, "PEERS", peers)
    ours = SimpleNamespace(model="M", length=4096, release="2.15", who=bench_prefill.OPTIMIZED, ttft=(1.0, 1.2, 2.0),
                           projection=SimpleNamespace(limit_s=0.8))
    bars = {b["series"]: b["central"] for b in bench_prefill.chart_bars([ours], 4096) if b["kind"] == "peer"}
    assert bars == {"engine a, chip x (published pp2048 rate)": 4096 / 2000.0,
                    "engine a, chip y (published pp16384 rate)": 4096 / 4000.0,
                    "engine b, chip x (published pp1024 rate)": 4096 / 500.0}
