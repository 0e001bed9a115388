"""The benchmark runner (`python -m benchmarks`) on its tiny configuration:
every op's markdown table, the kernel table, the decode census, and the
plots; the census checked against independent counts."""

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest
import torch

from benchmarks import __main__ as runner
from benchmarks import census, common, timeline

import mps_ext

ROOT = Path(__file__).resolve().parents[1]


def test_the_runner_on_its_tiny_configuration(tmp_path, capsys):
    png, decode_png, prefill_png = tmp_path / "plot.png", tmp_path / "decode.png", tmp_path / "prefill.png"
    results = runner.main(["--tiny", "--no-mac", "--png", str(png), "--decode-png", str(decode_png),
                           "--prefill-png", str(prefill_png)])
    out = capsys.readouterr().out
    for op in runner.OPS:
        cases = runner.op_cases(op, "tiny")
        assert cases and [r.case.id for r in results if r.case.op == op] == [c.id for c in cases]
        table = out.split(f"## {op}\n\n")[1].split("\n\n")[0].splitlines()
        assert table[0].startswith("| ") and len(table) == 2 + len(cases)
        assert "| lines / min |" in table[0] and "| registers |" in table[0]
    # Every dispatch was measured with the counters on, and every kernel of
    # kernels_metal/ has a row in the kernel table.
    assert all(d.counters for r in results for d in r.stats)
    kernels = out.split("## Kernels\n\n")[1].split("\n\n")[0]
    for names in common.library_kernels().values():
        for name in names:
            assert f"| {name} |" in kernels
    reached = {d.kernel for r in results for d in r.stats}
    assert "softmax_segment_f16_f32_i32" in reached and "gemv_cols_f16_r2_vec" in reached
    # The tiled case (fp8_linear at 128 rows) against MLX's steel GEMM.
    compute = out.split("## Compute efficiency\n\n")[1].split("\n\n")[0].splitlines()
    assert len(compute) == 3 and "| fp8_mm_tile_f16_vec |" in compute[2] and "steel MMA slots" in compute[0]
    # The plots: PNGs matplotlib reads back; the legend has each op's sums.
    assert matplotlib.image.imread(png).shape[0] > 100
    assert matplotlib.image.imread(decode_png).shape[0] > 100
    legend = out.split("## Plot\n\n")[1].split("\n\n")[1].splitlines()
    assert len(legend) == 2 + len(runner.OPS)
    for i, op in enumerate(runner.OPS):
        mine = [r for r in results if r.case.op == op]
        cells = [c.strip() for c in legend[2 + i].strip("|").split("|")]
        assert cells[:3] == [str(i + 1), op, str(len(mine))]
        assert float(cells[3]) == pytest.approx(sum(r.limit_us("M3 Ultra") for r in mine), rel=1e-3)
        # mps_ext's bar: its traffic plus each dispatch's GPU cost (not its traffic alone, which the limit bounds)
        dispatched = sum(r.projected_us("M3 Ultra") + len(r.stats) * timeline.DISPATCH.central * 1e6 for r in mine)
        assert float(cells[4]) == pytest.approx(dispatched, rel=1e-3) and float(cells[4]) > float(cells[3])
        assert cells[5:] == ["-", "-"]  # no Mac here
    # The decode census: a row per release, mode and stock / mps_ext, and the calibration.
    decode = out.split("## decode\n\n")[1]
    assert "| Qwen3-30B-A3B | 1 | 2.15 | compile | mps_ext |" in decode
    assert "Calibration" in decode and "jundot/omlx issue 2238" in decode
    # The prefill census: a row per length and path on 2.15, what grows per chunk, the constants, the plot.
    prefill = out.split("## prefill\n\n")[1]
    for length in (512, 4096, 32768):
        assert f"| Qwen3.6-35B-A3B | {length} | 2.15 | mps_ext |" in prefill
    assert "| Qwen3.6-35B-A3B | 2.15 | stock | linear_attention+moe: " in prefill
    assert "huggingface/huggingface.js" in prefill
    # The first prompt's compile term (docs/dev/first_call.md): mps_ext's row counts the variants it runs.
    assert re.search(r"\| Qwen3\.6-35B-A3B \| 2\.15 \| mps_ext \| [1-9]\d* / \d+ \|", prefill)
    assert matplotlib.image.imread(prefill_png).shape[0] > 100


def test_a_case_that_reaches_no_kernel_is_an_error():
    case = common.Case("none", "nothing", {}, lambda: common.Prepared(lambda: None, 1))
    with pytest.raises(RuntimeError, match="made no dispatch"):
        common.measure(case, mac=False)


def test_unknown_op_is_refused(capsys):
    with pytest.raises(SystemExit):
        runner.main(["softmx", "--tiny"])
    assert (
        f"no benchmark for softmx; the ops are {', '.join(runner.OPS)}, routing, decode, prefill"
        in capsys.readouterr().err
    )


def test_a_bench_script_runs_the_runner_on_its_op(tmp_path):
    r = subprocess.run(
        [sys.executable, "benchmarks/bench_pad.py", "--tiny", "--no-mac", "--png", str(tmp_path / "p.png")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    assert "## pad" in r.stdout and "## softmax" not in r.stdout
    assert matplotlib.image.imread(tmp_path / "p.png").shape[0] > 100


def test_the_routing_benchmark_times_every_case_and_restores_what_it_set(capsys):
    from benchmarks import bench_routing

    rows = runner.main(["routing", "--tiny"])
    assert rows == []  # no kernel cases
    table = capsys.readouterr().out.split("## routing\n\n")[1].split("\n\n")[1].splitlines()
    assert len(table) == 2 + len(bench_routing.CASES)
    for line, (_, what, _) in zip(table[2:], bench_routing.CASES):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[0] == what and all(float(c) > 0 for c in cells[1:3])
    # The benchmark's switch and rule are undone: pad on, F.linear's one row runs mps_ext's kernel.
    assert mps_ext.family_status("pad").startswith("on")
    mps_ext.reset_stats()
    torch.ops.mps_ext.linear(torch.randn(1, 8), torch.randn(4, 8), None)
    assert mps_ext.stats()["linear"]["ran"] == 1


# ------------------------------------------------------------------ census --
def _chosen_experts(model):
    """Distinct experts each MoE block's router chose, seen at the experts'
    input (top_k_index), not by the census."""
    seen, handles = [], []
    for name, m in model.named_modules():
        if name.endswith(".experts"):
            handles.append(m.register_forward_hook(lambda m, a, o: seen.append(int(a[1].unique().numel()))))
    return seen, handles


@pytest.mark.parametrize("name", list(census.MODELS))
@pytest.mark.parametrize("tokens", [1, 4])
def test_census_reads_each_needed_weight_once(name, tokens):
    """The weight bytes a decode step reads, by the trace and by step_bytes
    from the config's dimensions, against the model's own parameters: every
    parameter once, an expert bank only for the experts the router chose,
    the embedding only for the step's rows (and whole, as the LM head, when
    tied)."""
    spec = census.MODELS[name]
    model = census.tiny_model(spec)
    seen, handles = _chosen_experts(model)
    try:
        trace = census.trace_step(model, tokens, context=3)
    finally:
        for h in handles:
            h.remove()
    kinds = census.layer_kinds(model.config)
    moe_layers = [i for i, k in enumerate(kinds) if k.endswith("+moe")]
    chosen = seen[-len(moe_layers):]  # the decode step's (after the prefill's)
    embed = model.get_input_embeddings().weight
    tied = model.get_output_embeddings().weight is embed
    expected = 0
    for pname, p in model.named_parameters():
        if p is embed:
            expected += tokens * p.shape[1] * p.element_size() + (p.nbytes if tied else 0)
        elif ".experts." in pname:  # an expert bank [experts, out, in]
            layer = int(pname.split(".layers.")[1].split(".")[0])
            expected += p.nbytes // p.shape[0] * chosen[moe_layers.index(layer)]
        else:
            expected += p.nbytes
    assert sum(c.param_read for c in trace.calls) == expected
    # step_bytes takes one count of chosen experts for every MoE layer.
    per_count = {u: census.step_bytes(model.config, tokens, 3, used=u)["weights"] for u in set(chosen)}
    if len(per_count) == 1:
        assert per_count[chosen[0]] == expected
    else:
        assert min(per_count.values()) < expected < max(per_count.values())


def test_scaling_by_layer_kind_counts_what_a_deeper_model_does():
    """scale() from the 4-layer tiny Qwen3.6 (one layer of each kind
    traced) against tracing the same structure 8 layers deep."""
    spec = census.MODELS["Qwen3.6-35B-A3B"]
    deep = census.Spec(spec.name, spec.family, spec.model, {**spec.real, **spec.tiny, "num_hidden_layers": 8,
                       "layer_types": spec.tiny["layer_types"] * 2}, "", {})
    shallow = census.tiny_model(spec)
    traced_deep = census.trace_step(census.tiny_model(deep), 1, context=3)
    traced = census.trace_step(shallow, 1, context=3)
    for release in census.RELEASES:
        for mode in census.MODES:
            scaled = census.scale(deep, traced, shallow.config, 1, release, mode, False)["total"]
            direct = census.count(traced_deep.calls, release, mode, False)
            assert scaled == direct, (release, mode)


def test_torch_2_14_grouped_mm_fallback_costs_a_sync_and_a_call_per_chosen_expert():
    """mps_ext/_policy.py: before 2.15 torch's _grouped_mm copies offs to the
    CPU and runs mm per expert; from 2.15 it is one Metal kernel."""
    call = census.Call("_grouped_mm", 0, "compute", False, 1, 1, 1, groups=128, groups_used=8)
    old = census.count([call], "2.14", "eager", False)
    assert (old.host, old.dispatches, old.syncs, old.empty) == (9, 9, 1, 120)
    new = census.count([call], "2.15", "eager", False)
    assert (new.host, new.dispatches, new.syncs, new.empty) == (1, 1, 0, 0)
    # Inductor leaves matmuls to aten: under compile the same, and a run of
    # pointwise calls between two matmuls is one kernel.
    mul = census.Call("mul", 0, "compute", True, 1, 1, 0)
    c = census.count([call, mul, mul, mul, call, mul], "2.15", "compile", False)
    assert (c.host, c.dispatches) == (4, 4)


def test_an_optimized_norm_counts_as_its_fusible_ops_when_compiled():
    """FusedRMSNorm alone leaves its norm to Inductor under torch.compile
    (fused with the residual add before it); eager, it is one call of
    mps_ext's op. mps_ext's other ops stay extern calls compiled, a decoder
    layer's fused norms (add_rms_norm, rms_norm_linear) too."""
    add = census.Call("add", 0, "compute", True, 1, 1, 0)
    mm = census.Call("mm", 0, "compute", False, 1, 1, 1)
    norm = census.Call("rms_norm", 0, "compute", True, 1, 1, 1, ours=1)
    moe = census.Call("moe_layer", 0, "compute", False, 1, 1, 1, ours=5)
    eager = census.count([mm, add, norm, moe], "2.15", "eager", True)
    assert (eager.host, eager.dispatches) == (4, 1 + 1 + 1 + 5)
    compiled = census.count([mm, add, norm, moe], "2.15", "compile", True)
    assert (compiled.host, compiled.dispatches) == (3, 1 + 1 + 5)
    assert census._fused_edges([norm, mm], True) == (True, False)
    add_norm = census.Call("add_rms_norm", 0, "compute", False, 1, 1, 1, ours=1)
    norm_gemv = census.Call("rms_norm_linear", 0, "compute", False, 1, 1, 1, ours=1)
    layer = [norm_gemv, mm, add_norm, moe]
    assert census._fused_edges(layer, True) == (False, False)
    for mode in census.MODES:
        c = census.count(layer, "2.15", mode, True)
        assert (c.host, c.dispatches) == (4, 1 + 1 + 1 + 5), mode


def test_mps_ext_dispatches_are_the_executors():
    """A tiny Qwen3-MoE decode step under run_model: with torch 2.14's
    policy mps_ext runs both grouped products of the layer (no sync); with
    2.15's it leaves them to torch's own kernel."""
    model = census.tiny_model(census.MODELS["Qwen3-30B-A3B"])
    for release, ours in (("2.14", True), ("2.15", False)):
        trace = census.trace_step(model, 1, context=3, torch_release=release)
        grouped = [c for c in trace.calls if c.op == "_grouped_mm"]
        assert len(grouped) == 2 and all((c.ours is not None) == ours for c in grouped), release
        assert all(c.ours >= 1 for c in trace.calls if c.ours is not None)
        counted = census.count(trace.calls, release, "eager", True)
        assert counted.syncs == 0
        assert counted.dispatches == sum(c.ours if c.ours is not None else (1 if c.written else 0)
                                         for c in trace.calls if c.kind == "compute")


def test_a_tiny_model_without_every_layer_kind_is_refused():
    spec = census.MODELS["LFM2.5-8B-A1B"]
    lacking = census.Spec(
        spec.name,
        spec.family,
        spec.model,
        spec.real,
        "",
        {**spec.tiny, "num_hidden_layers": 2, "layer_types": ["conv", "full_attention"]},
    )  # both dense
    small = census.tiny_model(lacking)
    with pytest.raises(ValueError, match="has no layer of kind"):
        census.scale(spec, census.trace_step(small, 1, context=3), small.config, 1, "2.15", "eager", False)


@pytest.mark.parametrize("tokens", [1, 4])
def test_census_kv_cache_bytes_match_the_attention_layers_cache_calls(tokens):
    """The KV cache traffic of step_bytes against what the traced
    attention layer's calls move: transformers' DynamicCache appends with
    torch.cat, so every step reads the cache and the new rows and writes
    the grown cache (the two largest calls of the layer's cats), besides
    attention reading it."""
    spec = census.MODELS["Qwen3-30B-A3B"]
    model = census.tiny_model(spec)
    context = 5
    trace = census.trace_step(model, tokens, context=context)
    c = model.config
    row = c.num_key_value_heads * c.head_dim * 2  # one token's K (or V) row, bf16
    cats = sorted((call for call in trace.calls if call.op == "cat" and call.layer == 0),
                  key=lambda call: call.written)[-2:]  # K and V
    moved = sum(call.read + call.written for call in cats)
    assert moved == 2 * tokens * row * (context + 1) * 2  # read: old cache + new rows; written: the grown cache
    b = census.step_bytes(c, tokens, context)
    assert b["kv_copy"] == moved
    # Attention reads the cache with the new rows (its other input: the query).
    sdpa = [call for call in trace.calls if call.op.startswith("_scaled_dot_product") and call.layer == 0]
    query = tokens * c.num_attention_heads * c.head_dim * 2
    assert len(sdpa) == 1 and sdpa[0].read - query == 2 * tokens * row * (context + 1) == b["kv_read"]
    assert b["kv_written"] == 0  # within the copy


@pytest.mark.parametrize("tokens", [1, 4])
def test_census_conv_state_bytes_match_what_the_cache_holds_and_the_op_moves(tokens):
    """A conv layer's state traffic in step_bytes: the window transformers'
    cache holds for each channel (conv_L_cache taps, not L - 1), read and
    written once, as short_conv_decode moves it (executor counters)."""
    import mps_ext_executor as cpu_metal
    spec = census.MODELS["LFM2.5-8B-A1B"]
    model = census.tiny_model(spec)
    c = model.config
    with torch.no_grad():
        cache = model(torch.ones(tokens, 3, dtype=torch.long), use_cache=True).past_key_values
    state = cache.get_conv_state(c.layer_types.index("conv"))
    assert state.shape == (tokens, c.hidden_size, c.conv_L_cache)
    b = census.layer_bytes(c, "conv+moe", tokens, context=3, cache_bytes=state.element_size())
    bcx = torch.zeros(tokens, 1, 3 * c.hidden_size, dtype=state.dtype)
    weight = torch.zeros(c.hidden_size, c.conv_L_cache, dtype=state.dtype)
    with cpu_metal.record(counters=True) as rec:
        torch.ops.mps_ext.short_conv_decode(bcx, state, weight, None)
    (d,) = rec.dispatches
    assert d.bytes_read[1] + d.bytes_written[1] == b["state"]


def test_census_counts_kv_appends_rows_not_a_copy_of_the_cache():
    """After mps_ext.optimize, eager, the attention layer writes its new K
    and V rows in place (into the cache's spare capacity, in the q/k norm
    and rotary dispatch: qk_norm_rope_append): the executor's bytes of that
    call are q, k and v read and written once (the k and v rows written:
    layer_bytes(cache_copy=False)'s kv_written; the rest activations, which
    layer_bytes leaves out) and cos, sin and the norm weights read, and the
    step is costed without torch.cat's copy; compiled, the forward keeps
    DynamicCache's torch.cat, and the copy is costed."""
    spec = census.MODELS["Qwen3-30B-A3B"]
    model = census.tiny_model(spec)
    trace = census.trace_step(model, 1, context=5, torch_release="2.15", transform=mps_ext.optimize)
    (call,) = [c for c in trace.calls if c.op == "qk_norm_rope_append"]
    assert not [c for c in trace.calls if c.op in ("kv_append", "qk_norm_rope")]
    assert not [c for c in trace.calls if c.op == "cat" and c.layer is not None]
    b = census.layer_bytes(model.config, "full_attention+moe", 1, 5, cache_copy=False)
    c, size = model.config, next(model.parameters()).element_size()
    q_bytes = c.num_attention_heads * c.head_dim * size  # the query row, read and written
    # and per threadgroup at most cos, sin and the two weights (head_dim each)
    staged = 4 * c.head_dim * size * -(-(c.num_attention_heads + 2 * c.num_key_value_heads) // 8)
    assert call.ours == 1 and b["kv_copy"] == 0 and b["kv_written"] > 0
    assert 2 * b["kv_written"] + 2 * q_bytes <= call.ours_bytes <= 2 * b["kv_written"] + 2 * q_bytes + staged
    assert census.appends_in_place(trace, "eager") and not census.appends_in_place(trace, "compile")
    assert not census.appends_in_place(census.trace_step(model, 1, context=5), "eager")


def test_a_transform_changes_the_model_counted_and_not_the_callers():
    """trace_step(transform=...) counts the model a callable (such as a
    future mps_ext.optimize) returns or changes: here transformers' eager
    experts, which loop over the chosen experts after a nonzero (a sync)."""
    model = census.tiny_model(census.MODELS["Qwen3-30B-A3B"])

    def eager_experts(m):
        m.set_experts_implementation("eager")

    changed = census.trace_step(model, 1, context=3, transform=eager_experts)
    assert not any(c.op == "_grouped_mm" for c in changed.calls)
    assert any(c.op == "nonzero" and c.kind == "sync" for c in changed.calls)
    assert census.count(changed.calls, "2.15", "eager", False).syncs >= 1
    unchanged = census.trace_step(model, 1, context=3)
    assert sum(c.op == "_grouped_mm" for c in unchanged.calls) == 2


@pytest.mark.parametrize("name", list(census.MODELS))
def test_decode_fp8_bytes_match_the_quantized_models_storage(name):
    """step_bytes(fp8=True) from the config's dimensions against the tiny
    model's own parameters and fp8 buffers after mps_ext.quantize_fp8: every
    one once, an expert bank (and its scales) for `used` of its experts, the
    embedding for the step's rows (and whole, as the LM head, when tied);
    what quantize_fp8 leaves (LM head, router, norms, convolutions) in bf16."""
    spec = census.MODELS[name]
    model = mps_ext.quantize_fp8(census.tiny_model(spec))
    assert model.fp8_summary.converted["FP8Experts"]
    embed = model.get_input_embeddings().weight
    tied = model.get_output_embeddings().weight is embed
    tokens, experts = 4, model.config.num_experts
    for used in (3, experts):
        expected, seen = 0, set()
        for mod in model.modules():
            own = list(mod.named_parameters(recurse=False))
            if isinstance(mod, (mps_ext.FP8Linear, mps_ext.FP8Experts)):
                own += list(mod.named_buffers(recurse=False))
            for _, p in own:
                if id(p) in seen:  # a tied LM head is the embedding
                    continue
                seen.add(id(p))
                if p is embed:
                    expected += tokens * p.shape[1] * p.element_size() + (p.nbytes if tied else 0)
                elif isinstance(mod, mps_ext.FP8Experts):  # [experts, ...]: the chosen ones
                    expected += p.nbytes // experts * used
                else:
                    expected += p.nbytes
        assert census.step_bytes(model.config, tokens, 3, fp8=True, used=used)["weights"] == expected
    assert (census.step_bytes(spec.config(), 1, 8, fp8=True)["weights"]
            < census.step_bytes(spec.config(), 1, 8)["weights"])


def test_decode_census_tells_the_moe_blocks_calls_apart():
    """Call.ffn marks the calls made inside a layer's feed-forward block: the
    router's product and the grouped expert products are in it, attention
    and the norms around it are not."""
    model = census.tiny_model(census.MODELS["Qwen3-30B-A3B"])
    trace = census.trace_step(model, 1, context=3)
    inside = [c for c in trace.calls if c.ffn]
    assert {c.layer for c in inside} == {0}
    assert sum(c.op == "_grouped_mm" for c in inside) == 2
    assert not any(c.op.startswith("_scaled_dot_product") for c in inside)
    assert sum(c.ffn for c in trace.calls if c.op == "linear") == 1  # the router; q, k, v, o and the LM head outside


def test_decode_optimized_rows_count_mps_exts_dispatches():
    """The rows after mps_ext.optimize count the executor's dispatches of
    mps_ext's calls (moe_layer: one host call, several dispatches), bf16 and
    fp8, and the fp8 rows read fp8 weights."""
    from benchmarks import bench_decode
    rows = bench_decode.census_rows(["Qwen3-30B-A3B"], (1,), releases=("2.15",), modes=("eager",),
                                    transform=mps_ext.optimize)
    by = {r.who: r for r in rows}
    assert set(by) == {bench_decode.STOCK, bench_decode.OURS, *bench_decode.OPTIMIZED_ROWS}
    for who in bench_decode.OPTIMIZED_ROWS:
        ffn = by[who].ffn["full_attention+moe"]
        assert ffn.dispatches > ffn.host, who
    fp8, head = by[bench_decode.OPTIMIZED_FP8], by[bench_decode.OPTIMIZED_FP8_HEAD]
    assert fp8.fp8 and head.fp8 and head.fp8_head and not by[bench_decode.OPTIMIZED].fp8
    assert head.bytes["weights"] < fp8.bytes["weights"] < by[bench_decode.OPTIMIZED].bytes["weights"]
    assert head.tok_s[1] > fp8.tok_s[1]
    table, out = bench_decode.goals(rows)
    assert [(g[""], g["mode"]) for g in out] == [(who, "eager") for who in bench_decode.OPTIMIZED_ROWS]


def test_the_fp8_head_row_traces_a_quantized_head():
    """OPTIMIZED_FP8_HEAD's transform is quantize_fp8(lm_head=True): the
    traced LM head reads an fp8 byte an element (and a scale a row), not
    bf16's two (what its bytes, census.head_bytes(fp8_head=True), assume)."""
    from benchmarks import bench_decode
    model = census.tiny_model(census.MODELS["Qwen3-30B-A3B"])
    head = {}
    for who, transform, _ in bench_decode.variants(mps_ext.optimize)[1:]:
        trace = census.trace_step(model, 1, context=3, torch_release="2.15", transform=transform)
        last = [c for c in trace.calls if c.layer is None and c.op in ("linear", "fp8_linear")][-1]
        head[who] = (last.op, last.read)
    v, h = model.config.vocab_size, model.config.hidden_size
    x = 2 * h  # the final norm's output, bf16
    assert head[bench_decode.OPTIMIZED] == head[bench_decode.OPTIMIZED_FP8] == ("linear", 2 * v * h + x)
    assert head[bench_decode.OPTIMIZED_FP8_HEAD] == ("fp8_linear", v * h + 4 * v + x)


def test_static_cache_census():
    """A step with transformers' static cache: attention reads every
    position of the cache (census.attention_keys), the new rows are
    index_copy_'d in place (no torch.cat's copy, eager or compiled, and
    under compile the update fuses into generated code: no more host calls
    than the dynamic cache's); kv_cache gives the optimized compiled rows
    the static cache and every other row the dynamic one."""
    from benchmarks import bench_decode
    spec = census.MODELS["Qwen3-30B-A3B"]
    model = census.tiny_model(spec)
    static, dynamic = (census.trace_step(model, 1, context=3, cache=c) for c in ("static", "dynamic"))
    keys = census.attention_keys(3, "static")
    assert keys == 3 + census.STATIC_HEADROOM and census.attention_keys(3) == 4
    assert [c.keys for c in static.calls if c.op.startswith("_scaled_dot_product")] == [keys]
    # the keys' and the values' torch.cat of the dynamic cache are gone (the rotary embedding's remain)
    cats = [sum(c.op == "cat" and c.layer == 0 for c in t.calls) for t in (dynamic, static)]
    assert cats[0] - cats[1] == 2 and sum(c.op == "index_copy_" for c in static.calls) == 2
    for mode in census.MODES:
        assert census.appends_in_place(static, mode)
        assert not census.appends_in_place(dynamic, mode)
    s, d = (census.scale(spec, t, model.config, 1, "2.15", "compile", False, 4096, c)["total"]
            for t, c in ((static, "static"), (dynamic, "dynamic")))
    assert s.host <= d.host and s.dispatches <= d.dispatches
    real = spec.config()
    b = census.layer_bytes(real, "full_attention+moe", 1, 4096, cache_copy=False, cache="static")
    per_token = 2 * real.num_key_value_heads * real.head_dim * 2
    assert b["kv_copy"] == 0 and b["kv_read"] == (4096 + census.STATIC_HEADROOM) * per_token
    assert b["kv_written"] == per_token
    with pytest.raises(ValueError, match="cache must be one of"):
        census.attention_keys(8, "paged")
    assert bench_decode.kv_cache(bench_decode.OPTIMIZED, "compile") == "static"
    assert {bench_decode.kv_cache(w, m) for w in (bench_decode.STOCK, bench_decode.OURS) for m in census.MODES} \
        == {bench_decode.kv_cache(bench_decode.OPTIMIZED_FP8, "eager")} == {"dynamic"}


@pytest.mark.parametrize("release", ["2.15", "2.13"])
@pytest.mark.parametrize("name", list(census.MODELS))
def test_optimized_layers_take_at_most_12_dispatches(name, release):
    """Issue 19's goal: after mps_ext.optimize, every decoder layer of the
    three census models (attention or its linear and convolution mixers
    included) takes at most 12 Metal dispatches a token, eager and under
    torch.compile (one token, bf16), with torch 2.15's and 2.13's policies; each MoE
    layer's one add_rms_norm_moe_layer call takes 3 of them (the residual add,
    the post-attention norm and the router GEMV, gate/up with the routing
    (moe_gate_up_routed), and the down product with the combine; fp8 banks take the same kernels' fp8
    variants: tests/ops/test_moe_layer.py), and a MoE layer calls neither
    add_rms_norm nor moe_layer apart."""
    spec = census.MODELS[name]
    model = census.tiny_model(spec)
    kinds = set(census.layer_kinds(spec.config()))
    trace = census.trace_step(model, 1, context=3, torch_release=release, transform=mps_ext.optimize)
    layers = census.by_layer(trace)
    for i, kind in enumerate(census.layer_kinds(model.config)):
        if kind.endswith("+moe"):
            moe = [c for c in layers[i] if c.op in ("add_rms_norm_moe_layer", "add_rms_norm", "moe_layer")]
            assert [(c.op, c.ours, c.ffn) for c in moe] == [("add_rms_norm_moe_layer", 3, True)], (i, kind)
    for mode in census.MODES:
        per = census.scale(spec, trace, model.config, 1, release, mode, True)["per_kind"]
        over = {k: per[k].dispatches for k in kinds if per[k].dispatches > 12}
        assert not over, (mode, over)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_fused_projections_count_as_one_gemv_and_their_split_as_views(monkeypatch, fp8):
    """After mps_ext.optimize, the Gated DeltaNet layer's four input
    projections are one linear call of one dispatch, and q_proj, k_proj and
    v_proj one: per layer 3 and 2 host calls and dispatches fewer than
    optimize without the fusion (eager, one more: the input norm goes into
    the fused GEMV, rms_norm_linear), and the split is views; compiled too
    (the input norm too: the decoder layers' fused path runs compiled);
    so too after mps_ext.quantize_fp8 (fp8_linear, rms_norm_fp8_linear). (It
    saved 1 more compiled while the attention copied Qwen3.6's output gate
    right after q_proj, a run of generated code of its own between the
    projections; the gate is now read as q_proj's view, and the model's
    copy of it, compiled, sits with the sigmoid and mul after attention.)"""
    from mps_ext.passes import projections as fused_projections
    spec = census.MODELS["Qwen3.6-35B-A3B"]
    model = census.tiny_model(spec)
    transform = (lambda m: mps_ext.optimize(mps_ext.quantize_fp8(m))) if fp8 else mps_ext.optimize
    # (bf16: Qwen3.6's o_proj takes the output gate along, sigmoid_gate_linear; an fp8 o_proj does not)
    products = ("fp8_linear", "rms_norm_fp8_linear") if fp8 else ("linear", "rms_norm_linear", "sigmoid_gate_linear")
    traces = {}
    for fuse in (False, True):
        with monkeypatch.context() as m:
            if not fuse:
                m.setattr(fused_projections, "GROUPS", ())
            traces[fuse] = census.trace_step(model, 1, context=3, torch_release="2.15", transform=transform)
    kinds = census.layer_kinds(model.config)
    for fuse, trace in traces.items():
        layers = census.by_layer(trace)
        for i, saved in ((kinds.index("linear_attention+moe"), 3), (kinds.index("full_attention+moe"), 2)):
            # the fused projection takes the layer's input norm along (rms_norm_linear, rms_norm_fp8_linear)
            # where it can
            linears = [c for c in layers[i] if c.op in products]
            n = 2 if fuse else 2 + saved  # and out_proj / o_proj
            assert len(linears) == n, (fuse, i)
            counted = census.count(linears, "2.15", "eager", True)
            assert (counted.host, counted.dispatches) == (n, n)
            splits = [c for c in layers[i] if c.op == "split_with_sizes"]
            assert len(splits) == (1 if fuse else 0) and all(c.kind == "view" for c in splits)
    for mode in census.MODES:
        per = {fuse: census.scale(spec, t, model.config, 1, "2.15", mode, True)["per_kind"]
               for fuse, t in traces.items()}
        # a fused projection also takes the layer's input norm (rms_norm_linear): one call and dispatch more
        # saved, eager and compiled (the decoder layer's fused path runs compiled as eager)
        norm = 1
        for kind, saved in (("linear_attention+moe", 3), ("full_attention+moe", 2)):
            assert per[True][kind].host == per[False][kind].host - saved - norm, (mode, kind)
            assert per[True][kind].dispatches == per[False][kind].dispatches - saved - norm, (mode, kind)


# ---------------------------------------------------------- generate's loop --
def test_generate_loop_counts_the_stop_checks_stream_actions():
    """generate's loop outside the forward, one step: with DeferredStopCheck
    (what generate runs on MPS) the flag's asynchronous copy and the event
    record commit, the host waits for the previous step's event, and
    nothing syncs (its read of the flag is of a host tensor); with
    StopCheck, one sync. Sampling adds top-k, top-p's sort and the
    multinomial to greedy's argmax; the counts do not change with the
    context."""
    from benchmarks import generate_loop
    model = census.tiny_model(census.MODELS["Qwen3-30B-A3B"])
    deferred = generate_loop.trace_loop(model, "sampling", stop_check="deferred")
    c = census.count(deferred.calls, "2.15", "eager", False)
    assert (c.syncs, c.commits, c.waits) == (0, 2, 1)
    assert [x.op for x in deferred.calls if x.stream] == ["copy_", "event_record", "event_synchronize"]
    ops = {x.op for x in deferred.calls}
    assert {"topk", "sort", "multinomial", "cat"} <= ops and "argmax" not in ops
    sync = generate_loop.trace_loop(model, "greedy", stop_check="sync", context=20)
    c = census.count(sync.calls, "2.15", "eager", False)
    assert (c.syncs, c.commits, c.waits) == (1, 0, 0)
    assert "argmax" in {x.op for x in sync.calls} and "sort" not in {x.op for x in sync.calls}
    longer = generate_loop.trace_loop(model, "greedy", stop_check="sync", context=30)
    assert census.count(longer.calls, "2.15", "eager", False) == c
    with pytest.raises(ValueError, match="sampling must be one of"):
        generate_loop.trace_loop(model, "beam")


def test_generate_loop_bytes_scale_with_the_vocabulary_and_the_context():
    """Calls on a logits row scale with the real vocabulary, the input ids'
    and attention mask's concatenations with the real context, the rest
    not at all."""
    from benchmarks import generate_loop
    model = census.tiny_model(census.MODELS["Qwen3-30B-A3B"])
    loop = generate_loop.trace_loop(model, "sampling", stop_check="deferred")
    by = {size: sum(c.read + c.written for c in loop.calls if c.size == size) for size in ("vocab", "context", "")}
    assert by["vocab"] > 0 and by["context"] > 0
    scaled = generate_loop.loop_bytes(loop, 3 * loop.vocab, 5 * loop.length)
    assert scaled == pytest.approx(3 * by["vocab"] + 5 * by["context"] + by[""])


def test_torch_decode_sdpa_is_two_dispatches_from_1024_keys():
    """Attention.mm takes sdpa_vector_2pass (two dispatches) from 1024 keys:
    the census counts the attention layer one dispatch more at 4k of context
    than at the traced 8."""
    call = census.Call("_scaled_dot_product_flash_attention_for_cpu", 0, "compute", False, 1, 1, 0, keys=8)
    assert census.count([call], "2.15", "eager", False, keys=1023).dispatches == 1
    assert census.count([call], "2.15", "eager", False, keys=1024).dispatches == 2
    assert census.count([call], "2.15", "eager", False).dispatches == 1  # the traced key length
    spec = census.MODELS["Qwen3-30B-A3B"]
    model = census.tiny_model(spec)
    trace = census.trace_step(model, 1)
    kind = "full_attention+moe"
    short = census.scale(spec, trace, model.config, 1, "2.15", "eager", False)["per_kind"][kind]
    long = census.scale(spec, trace, model.config, 1, "2.15", "eager", False, context=4096)["per_kind"][kind]
    assert long.dispatches == short.dispatches + 1 and long.host == short.host


# ---------------------------------------------------------------- timeline --
def _k(**overrides):
    return timeline.costs(**{"round_trip": 100e-6, "submit_share": 0.5, "commit": 10e-6, **overrides})


def _layers(n, host, gpu, commit_after=(), end=("sync",)):
    """A step of `n` layers, each one host call of `host` s encoding one
    dispatch of `gpu` s (no bytes), a commit after the layers in
    `commit_after`, then the loop's `end` actions; and its constants (_k)."""
    ops = []
    for i in range(n):
        ops.append(timeline.Op(census.Counts(host=1, dispatches=1), 0.0, "", i))
        if i in commit_after:
            ops.append(timeline.Op(census.Counts(commits=1), 0.0, "commit", "commit"))
    ops += [timeline.Op(census.Counts(), 0.0, a, "loop") for a in end]
    return timeline.Step(ops, census.Counts(), 0.0, 1), _k(host=host, dispatch=gpu)


def test_a_step_that_commits_only_at_its_sync_adds_host_and_gpu():
    """No commit before the sync: the GPU starts when the host has encoded
    the whole step, so the step is host + GPU + the sync's round trip."""
    sim = timeline.simulate(*_layers(40, 50e-6, 200e-6))
    assert sim.period == pytest.approx(40 * 50e-6 + 40 * 200e-6 + 100e-6)
    assert sim.gpu_idle == pytest.approx(40 * 50e-6 + 100e-6)  # the host's encoding and the round trip


def test_committing_every_layer_hides_the_host_behind_the_gpu():
    """A commit after every layer where a layer's host time (plus the
    commit's) is below its GPU time: the GPU waits only for the first layer
    and its commit, then runs back to back; the step is the first layer's
    host time, one commit, the GPU time and the round trip."""
    sim = timeline.simulate(*_layers(40, 50e-6, 200e-6, commit_after=range(39)))
    assert sim.period == pytest.approx(50e-6 + 10e-6 + 40 * 200e-6 + 100e-6)
    # host-bound layers gain only what the GPU overlaps: each commit's round trip share lands on an idle GPU
    slow = timeline.simulate(*_layers(40, 300e-6, 200e-6, commit_after=range(39)))
    assert 40 * 300e-6 < slow.period < 40 * 300e-6 + 40 * 200e-6 + 100e-6


def test_deferred_stop_check_overlaps_a_step_with_the_previous_ones_gpu():
    """DeferredStopCheck's commit at the end of a step and its wait for the
    previous step's event: the steady state costs the larger of host and
    GPU, whichever bounds it."""
    gpu_bound = timeline.simulate(*_layers(40, 50e-6, 200e-6, end=("commit", "wait_previous")))
    assert gpu_bound.period == pytest.approx(40 * 200e-6) and gpu_bound.gpu_idle == pytest.approx(0, abs=1e-12)
    host_bound = timeline.simulate(*_layers(40, 300e-6, 200e-6, end=("commit", "wait_previous")))
    assert host_bound.period == pytest.approx(40 * 300e-6)


def test_timeline_refuses_what_it_cannot_simulate():
    with pytest.raises(ValueError, match="which must be"):
        timeline.costs("calibrated")
    with pytest.raises(ValueError, match="no constant named"):
        timeline.costs(dispach=1e-6)
    with pytest.raises(ValueError, match="steps must be at least 4"):
        timeline.simulate(*_layers(1, 1e-6, 1e-6), steps=2)


@pytest.fixture(scope="module")
def published_steps():
    """{(model, release): (make_step, published tok/s)} of stock torch
    compiled, one sequence, at bench_decode's context and loop."""
    from benchmarks import bench_decode, generate_loop
    out = {}
    for spec in census.MODELS.values():
        if not spec.published:
            continue
        model = census.tiny_model(spec)
        trace = census.trace_step(model, 1)
        loop = generate_loop.trace_loop(model, bench_decode.SAMPLING, stop_check=bench_decode.STOP_CHECK)
        for release, figure in spec.published.items():
            make = bench_decode._maker(spec, trace, model.config, loop=loop, release=release, mode="compile",
                                       ours=False, tokens=1, context=bench_decode.CONTEXT)
            out[(spec.name, release)] = (make, figure)
    return out


def test_the_simulation_is_calibrated_within_15_percent_of_all_four_published_figures(published_steps):
    """The GPU cost per dispatch fitted on torch 2.15's two figures and the
    synchronisation's round trip on torch 2.14's (with that dispatch cost)
    are the constants in use (to their rounding); with them the simulation
    lands within 15% of all four figures, and each model's own value of
    each constant predicts the other model's figure within 15%."""
    cal = timeline.calibrate(published_steps)
    assert cal["dispatch"] == pytest.approx(timeline.DISPATCH.central, abs=0.05e-6)
    assert cal["round_trip"] == pytest.approx(timeline.ROUND_TRIP.central, abs=0.005e-3)
    assert timeline.DISPATCH.low <= timeline.DISPATCH.central <= timeline.DISPATCH.high
    implied = [f["implied"] for f in cal["figures"].values() if f["fits"] == "round_trip"]
    assert timeline.ROUND_TRIP.low == pytest.approx(min(implied), abs=0.005e-3)
    assert timeline.ROUND_TRIP.high == pytest.approx(max(implied), abs=0.005e-3)
    assert len(cal["figures"]) == 4
    for key, f in cal["figures"].items():
        assert timeline.within(f["fitted"] / f["published"]), key
        assert timeline.within(f["predicted"] / f["published"]), key
        make, published = published_steps[key]
        assert timeline.tokens_per_s(make) == pytest.approx(f["fitted"], rel=0.02)


# ----------------------------------------------------------- commit points --
def test_the_commit_op_is_a_no_op_on_cpu_that_the_census_counts():
    """torch.ops.mps_ext.commit on a CPU tensor (the executor: nothing to
    commit) returns nothing and leaves the tensor; the census counts it as
    a commit, not a host call that encodes or a dispatch."""
    x = torch.arange(3.0)
    assert torch.ops.mps_ext.commit(x) is None and torch.equal(x, torch.arange(3.0))
    trace = census.Trace()
    with census._Tracer(trace, set(), None):
        torch.ops.mps_ext.commit(x)
    (call,) = trace.calls
    assert (call.op, call.stream) == ("commit", "commit")
    c = census.count(trace.calls, "2.15", "eager", True)
    assert (c.commits, c.host, c.dispatches) == (1, 0, 0)


def test_install_commits_commits_after_the_chosen_decoder_layers():
    """install_commits(model, every=k) hooks every k-th decoder layer but
    the last; the census sees each commit in its layer, and the step's
    other counts do not change; it replaces commits installed before and
    refuses what it cannot do."""
    from mps_ext import stream
    spec = census.MODELS["Qwen3.6-35B-A3B"]
    model = census.tiny_model(spec)  # 4 layers
    assert stream.commit_layers(4, 1) == [0, 1, 2] and stream.commit_layers(4, 2) == [1]
    assert stream.commit_layers(40, 4) == [3, 7, 11, 15, 19, 23, 27, 31, 35]
    plain = census.trace_step(model, 1)
    for every, layers in ((1, [0, 1, 2]), (2, [1])):
        def install(m, every=every):
            stream.install_commits(m, every=1)  # replaced by the next call
            assert stream.install_commits(m, every=every) == layers
        traced = census.trace_step(model, 1, transform=install)
        assert [c.layer for c in traced.calls if c.op == "commit"] == layers
        with_commits = census.count(traced.calls, "2.15", "eager", False)
        without = census.count(plain.calls, "2.15", "eager", False)
        assert with_commits.commits == len(layers)
        assert dataclasses.replace(with_commits, commits=0) == without

    def installed_then_removed(m):
        stream.install_commits(m, every=1)
        stream.remove_commits(m)
    removed = census.trace_step(model, 1, transform=installed_then_removed)
    assert not [c for c in removed.calls if c.op == "commit"]
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="every must be a positive int"):
            stream.install_commits(model, every=bad)
    with pytest.raises(ValueError, match="no decoder layers"):
        stream.install_commits(torch.nn.Linear(2, 2), every=1)


def test_commits_stay_in_a_compiled_graph_in_order():
    """Under torch.compile the commit is an ordered effect: the graph keeps
    it (an op without outputs would otherwise be dead code) after the work
    that made its tensor."""
    from torch._dynamo.backends.common import aot_autograd
    from mps_ext import stream

    class Layer(torch.nn.Module):
        def forward(self, x):
            y = x * 2
            stream.commit(y)
            return y + 1

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    compiled = torch.compile(Layer(), backend=aot_autograd(fw_compiler=keep))
    with torch.no_grad():
        assert torch.equal(compiled(torch.ones(3)), torch.full((3,), 3.0))
    (gm,) = graphs
    order = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    effect = next(i for i, n in enumerate(gm.graph.nodes) if n.op == "call_function"
                  and torch.ops.mps_ext.commit.default in n.args)
    mul = next(i for i, n in enumerate(gm.graph.nodes) if n.target == torch.ops.aten.mul.Tensor)
    assert mul < effect, order
