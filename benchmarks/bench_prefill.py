"""What a prompt's prefill costs on a Mac, counted from real model code, and
the time to first token it projects on an M3 Ultra (benchmarks/prefill.py
says how each figure is counted).

    python -m benchmarks prefill [--tiny] [--optimize] [--prefill-png PATH] [--write-docs]

Per model (Qwen3-30B-A3B, Qwen3.6-35B-A3B, LFM2.5-8B-A1B), per torch release
(2.14, 2.15), per prompt length (512, 4096, 32768), stock torch and with
mps_ext (with --optimize also after mps_ext.optimize, bf16 and after
mps_ext.quantize_fp8), eager: matrix FLOPs, bytes, host calls, dispatches
and syncs, by layer kind and for the whole prefill; the projected time to
first token with the bound it hits, beside the compute limit and the
published prefill rates of other engines.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import census, prefill, timeline  # noqa: E402
from benchmarks.bench_decode import OPTIMIZED, OPTIMIZED_FP8, OURS, STOCK, as_is, transformed, variants  # noqa: E402
from benchmarks.common import markdown  # noqa: E402

DOC_LENGTH = 4096  # the length README's table and the plot show

# Published prefill rates, one prompt (tok/s): (model, engine and weights, chip, prompt tokens, tok/s, source).
# Only those of the census's models on an Ultra-class chip (M2 or M3 Ultra) whose chip, engine, weights, prompt
# length and rate are all stated; GPU cores where the source says them. Their weights (Q8_0, 8-bit, 6-bit) differ
# from ours (bf16, fp8).
PEERS = [
    ("Qwen3-30B-A3B", "llama.cpp Q8_0", "M2 Ultra", 512, 2045.19, "ggml-org/llama.cpp PR 15616 (pp512)"),
    ("Qwen3-30B-A3B", "llama.cpp Q8_0", "M2 Ultra", 2048, 2272.56, "ggml-org/llama.cpp PR 15616 (pp2048)"),
    ("Qwen3-30B-A3B", "llama.cpp Q8_0", "M2 Ultra", 16384, 1022.81, "ggml-org/llama.cpp PR 15616 (pp16384)"),
    # The oMLX maintainer's table (cache misses forced) on "Apple Silicon, 512 GB": his machine is an M3 Ultra
    # (jundot/omlx issue 2204: "On my M3 Ultra ..."), and 512 GB is an M3 Ultra configuration.
    ("Qwen3.6-35B-A3B", "mlx-lm 6-bit", "M3 Ultra (512 GB)", 16384, 2512.2,
     "jundot/omlx issue 936 (pp16384, mlx-lm column; chip: issue 2204)"),
    ("Qwen3.6-35B-A3B", "oMLX 6-bit", "M3 Ultra (512 GB)", 16384, 2469.9,
     "jundot/omlx issue 936 (pp16384, oMLX cache-off column; chip: issue 2204)"),
    ("Qwen3.6-35B-A3B", "oMLX 0.5.0.dev2 8-bit", "M2 Ultra 60-core", 1024, 1110.0,
     "jundot/omlx issue 2132 (8-bit, 1k context; 862.9 tok/s on oMLX 0.4.4)"),
]
PEERS_NOTE = ("A peer's TTFT above is the table's prompt length over the rate it published at the length in its "
              "prompt column (the plot does the same). Peers whose figures could not be read or whose chip is not "
              "stated are left out: www.lilaclabs.ai/blog/2026/05/13/qwen-3-6-gemma-4-on-m3-ultra-mac-studio "
              "(Qwen3.6-35B-A3B, MLX and llama.cpp, BF16/8-bit/4-bit, 4K-256K, M3 Ultra 60-core: the stored copy's "
              "excerpts stop before its results), jundot/omlx issue 2155 (Qwen3.6-35B-A3B, oMLX, M3 Ultra 80-core: its "
              "tables were not readable), nicedreamzapp/claude-code-local issue 31 (mlx_lm.benchmark, "
              "Qwen3.6-35B-A3B 4-bit, 1,518 tok/s at 512 and 1,777 at 1024 tokens, on a \"M4 Studio Ultra 64GB\", "
              "a chip that does not exist). No prompt rate for LFM2-8B-A1B or LFM2.5-8B-A1B on an Ultra chip, and "
              "none from MLX for Qwen3-30B-A3B on one, was found in the stored issues and pages.")


@dataclasses.dataclass
class Row:
    model: str
    length: int
    release: str
    who: str
    fp8: bool
    counts: dict          # prefill.scale_counts
    projection: prefill.Projection
    ttft: tuple           # fast end, central, slow end (s)
    flops: dict           # layer kind -> part -> FLOPs (one layer)
    bytes: dict           # prefill.model_bytes
    # mps_ext's rows, with first_call=True: the kernel variants the prompt runs ("prefill") and those the first
    # decode step after it runs ("decode"), which each compile on their first call (prefill.COMPILE_PER_FUNCTION)
    functions: dict | None = None


# The variants a prefill row is counted for: decode's, but its fp8 LM head (one row of logits at the prefill:
# no figure here would change).
WHOS = (STOCK, OURS, OPTIMIZED, OPTIMIZED_FP8)


def census_rows(models: list[str], lengths=prefill.LENGTHS, transform=None, releases=census.RELEASES,
                whos=WHOS, log=None, first_call: bool = False) -> list[Row]:
    """Every (model, release, who, length) row: the stock prefill traced
    once per trace length (it serves both releases), each mps_ext variant
    (bench_decode.variants) in `whos` once per release and trace length;
    with first_call also one decode step after the prompt (Row.functions)."""
    rows = []
    for name in models:
        spec = census.MODELS[name]
        model = census.tiny_model(spec)
        real = spec.config()
        lengths_traced = prefill.trace_lengths(model.config)
        kinds = [v for v in [(STOCK, None, False)] + variants(transform) if v[0] in whos]
        start = time.perf_counter()
        stock = {n: census.trace_prefill(model, n) for n in lengths_traced} if kinds[0][0] == STOCK else None
        traces, functions = {}, {}
        for who, tf, _ in kinds:
            if who == STOCK:
                continue
            ready = transformed(model, tf)
            for r in releases:
                traces[(who, r)] = {n: census.trace_prefill(ready, n, torch_release=r, transform=as_is)
                                    for n in lengths_traced}
                if first_call:  # the longer trace runs the path a real prompt runs (trace_lengths)
                    step = census.trace_step(ready, context=lengths_traced[-1], torch_release=r, transform=as_is)
                    functions[(who, r)] = {"prefill": prefill.functions_run(traces[(who, r)][lengths_traced[-1]]),
                                           "decode": prefill.functions_run(step)}
        if log:
            log(f"  prefill {name} at {lengths_traced} tokens: traced in {time.perf_counter() - start:.1f} s")
        for release in releases:
            for who, _, fp8 in kinds:
                pair = stock if who == STOCK else traces[(who, release)]
                calls, _ = census.layer_calls(spec, pair[lengths_traced[-1]], model.config)
                for length in lengths:
                    counts = prefill.scale_counts(spec, pair, model.config, length, release, who != STOCK)
                    rows.append(Row(name, length, release, who, fp8, counts,
                                    prefill.project(spec, counts, calls, length, fp8, release=release),
                                    prefill.ttft_range(spec, counts, calls, length, fp8, release),
                                    {k: prefill.layer_flops(real, k, length) for k in counts["layers"]},
                                    prefill.model_bytes(real, length, fp8), functions.get((who, release))))
    return rows


def _f(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def _s(t: tuple) -> str:
    lo, mid, hi = t
    return f"{mid:.2f} ({lo:.2f}-{hi:.2f})"


def census_table(rows: list[Row]) -> str:
    out = []
    for r in rows:
        p, c = r.projection, r.counts
        kinds = [k for k in c["per_kind"] if k != "head"]
        out.append({
            "model": r.model, "prompt": r.length, "torch": r.release, "": r.who,
            "TFLOP": f"{p.flops / 1e12:.2f}", "GB": f"{p.bytes / 1e9:.1f}",
            "host calls": _f(c["total"].host), "view calls": _f(c["total"].views),
            "dispatches": _f(c["total"].dispatches), "syncs": _f(c["total"].syncs),
            "per layer: host calls / dispatches": "; ".join(
                f"{k} x{c['layers'][k]}: {_f(c['per_kind'][k].host)} / {_f(c['per_kind'][k].dispatches)}"
                for k in kinds) + f"; outside the layers: {_f(c['per_kind']['head'].host)} / "
                                  f"{_f(c['per_kind']['head'].dispatches)}",
            "TTFT s": _s(r.ttft), "bound": p.bound,
            "compute limit s": f"{p.limit_s:.2f}", "of the limit": f"{p.limit_s / p.ttft_s:.0%}",
        })
    return markdown(out, list(out[0]))


def _first_per(rows: list[Row], key) -> list[Row]:
    """The first row of each key(row), in order: the tables whose figures
    are the same for every length (or every path) of a key."""
    first = {}
    for r in rows:
        first.setdefault(key(r), r)
    return list(first.values())


def growth_table(rows: list[Row]) -> str:
    """Per model, release and path, the calls a layer kind adds per chunk
    of the delta rule (derived from the two traces): what grows with the
    prompt."""
    out = []
    for r in _first_per(rows, lambda r: (r.model, r.release, r.who)):
        grows = {k: v for k, v in r.counts["per_chunk"].items() if v.host or v.dispatches or v.views}
        out.append({"model": r.model, "torch": r.release, "": r.who,
                    f"per chunk of {prefill.CHUNK} tokens: host calls / views / dispatches": "; ".join(
                        f"{k}: {_f(v.host)} / {_f(v.views)} / {_f(v.dispatches)}" for k, v in grows.items()) or
                    "nothing grows"})
    return markdown(out, list(out[0]))


def work_table(rows: list[Row]) -> str:
    """Per model and length, FLOPs and bytes by layer kind and part (the
    real configs; the same for every path but the fp8 weights' bytes)."""
    out = []
    for r in _first_per(rows, lambda r: (r.model, r.length)):
        real = census.MODELS[r.model].config()
        out.append({"model": r.model, "prompt": r.length,
                    "per layer: GFLOP by part": "; ".join(
                        f"{k}: " + ", ".join(f"{part} {f / 1e9:,.1f}" for part, f in parts.items())
                        for k, parts in r.flops.items()),
                    "per layer: MB weights / activations / cache (bf16)": "; ".join(
                        f"{k}: " + " / ".join(f"{v / 1e6:,.0f}" for n, v in prefill.layer_bytes(real, k, r.length)
                                              .items() if n != "total") for k in r.flops),
                    "TFLOP": f"{prefill.model_flops(real, r.length) / 1e12:.2f}",
                    "GB bf16": f"{prefill.model_bytes(real, r.length)['total'] / 1e9:.1f}",
                    "GB fp8": f"{prefill.model_bytes(real, r.length, fp8=True)['total'] / 1e9:.1f}"})
    return markdown(out, list(out[0]))


def kernel_table(rows: list[Row]) -> str:
    """Which kernel does each part's matrix work, per model, release and
    path, and the efficiency it is costed at."""
    out = []
    for r in _first_per(rows, lambda r: (r.model, r.release, r.who)):
        out.append({"model": r.model, "torch": r.release, "": r.who, "kernels (efficiency of peak)": "; ".join(
            f"{part}: {k} ({prefill.efficiency(k)[0]:.2f})" for part, k in r.projection.kernels.items())})
    return markdown(out, list(out[0]))


def first_call_table(rows: list[Row], length: int = DOC_LENGTH) -> str:
    """Per model, release and mps_ext path at `length`: the kernel variants
    the first prompt and the first decode step after it compile, and the
    TTFT of the process's first prompt beside the warm one."""
    out = []
    for r in rows:
        if r.functions is None or r.length != length:
            continue
        first, step = r.functions["prefill"], r.functions["decode"]
        new = step - first
        compile_s = tuple(prefill.compile_s(len(first), w) for w in ("high", "central", "low"))
        out.append({"model": r.model, "torch": r.release, "": r.who,
                    "variants: prompt / first step's new": f"{len(first)} / {len(new)}",
                    "whole libraries (before): prompt": prefill.whole_library_functions(first),
                    "compile s: prompt": _s(compile_s),
                    "TTFT s: warm": _s(r.ttft),
                    "TTFT s: first prompt": _s(tuple(t + c for t, c in zip(r.ttft, compile_s))),
                    "first step adds s": f"{prefill.compile_s(len(new)):.2f}"})
    return markdown(out, list(out[0])) if out else "(no mps_ext rows)"


def peer_ttft(tok_s: float, tokens: int) -> float:
    return tokens / tok_s


def nearest_peers(model: str, length: int) -> list[tuple]:
    """`model`'s PEERS rows, one per engine and chip: the one published at
    the prompt length nearest `length` (the longer on a tie)."""
    best = {}
    for p in PEERS:
        if p[0] == model:
            key, kept = (p[1], p[2]), best.get((p[1], p[2]))
            if kept is None or (abs(p[3] - length), -p[3]) < (abs(kept[3] - length), -kept[3]):
                best[key] = p
    return list(best.values())


def peers_table(rows: list[Row], length: int = DOC_LENGTH) -> str:
    """Per model at `length` (torch 2.15): stock and the optimized paths
    projected, the compute limit, and the published peers."""
    out = []
    for r in rows:
        if r.length != length or r.release != "2.15" or r.who == OURS:
            continue
        out.append({"model": r.model, "engine": f"torch 2.15, {r.who} (projected)", "chip": "M3 Ultra",
                    "prompt": length, "TTFT s": _s(r.ttft), "prompt tok/s": f"{length / r.ttft[1]:,.0f}",
                    "source": "this census"})
    for model in dict.fromkeys(r.model for r in rows if r.length == length):
        p = next(r.projection for r in rows if r.model == model and r.length == length)
        out.append({"model": model, "engine": "compute limit (bf16 FLOPs at peak)", "chip": "M3 Ultra",
                    "prompt": length, "TTFT s": f"{p.limit_s:.2f}", "prompt tok/s": f"{length / p.limit_s:,.0f}",
                    "source": "prefill.PEAK"})
        for m, engine, chip, tokens, tok_s, source in PEERS:
            if m == model:
                out.append({"model": model, "engine": f"{engine} (published)", "chip": chip, "prompt": tokens,
                            "TTFT s": f"{peer_ttft(tok_s, length):.2f}", "prompt tok/s": f"{tok_s:,.0f}",
                            "source": source})
    return markdown(out, list(out[0]))


def readme_table(rows: list[Row]) -> str:
    """README's short table: per model, a 4k prompt on torch 2.15, stock and
    optimized (bf16, fp8): TTFT, its bound, the share of the compute limit."""
    out = []
    for r in rows:
        if r.length != DOC_LENGTH or r.release != "2.15" or r.who == OURS:
            continue
        p = r.projection
        out.append({"model": r.model, "": r.who, "TFLOP": f"{p.flops / 1e12:.1f}",
                    "dispatches": _f(r.counts["total"].dispatches), "TTFT s (projected)": _s(r.ttft),
                    "bound": p.bound, "of the compute limit": f"{p.limit_s / p.ttft_s:.0%}"})
    return markdown(out, list(out[0]))


def chart_bars(rows: list[Row], length: int = DOC_LENGTH) -> list[dict]:
    """The prefill plot's bars (plot.prefill_chart): per model at `length`,
    torch 2.15 stock and the optimized paths (projected, with ranges), the
    peers (each engine and chip: its TTFT at the rate of its nearest published length), the
    compute limit (a line)."""
    out = []
    for model in dict.fromkeys(r.model for r in rows):
        mine = [r for r in rows if r.model == model and r.length == length and r.release == "2.15" and r.who != OURS]
        for r in mine:
            lo, mid, hi = r.ttft
            out.append({"model": model, "series": f"torch 2.15, {r.who} (projected)",
                        "kind": "stock" if r.who == STOCK else "ours",
                        "low": lo, "central": mid, "high": hi})
        for m, engine, chip, tokens, tok_s, _ in nearest_peers(model, length):
            out.append({"model": model, "series": f"{engine}, {chip} (published pp{tokens} rate)", "kind": "peer",
                        "central": peer_ttft(tok_s, length)})
        if mine:
            out.append({"model": model, "series": "compute limit (bf16 FLOPs at peak)", "kind": "limit",
                        "central": mine[0].projection.limit_s})
    return out


def models_for(size: str) -> list[str]:
    return ["Qwen3.6-35B-A3B"] if size == "tiny" else list(census.MODELS)


def report(size: str = "full", transform=None, log=None) -> tuple[str, list[Row]]:
    """The prefill benchmark's markdown, and its rows."""
    models = models_for(size)
    rows = census_rows(models, transform=transform, releases=("2.15",) if size == "tiny" else census.RELEASES,
                       log=log, first_call=True)
    notes = "\n".join(f"- {s.name}: {s.source}" for s in census.MODELS.values() if s.name in models)
    doc = prefill.__doc__
    text = f"""## prefill

One prompt of each length through the model, as `model.generate`'s first forward runs it (a new cache, logits of the
last position), bf16 weights (the fp8 rows: as mps_ext.quantize_fp8 leaves them), eager, on a Mac; counted from
transformers' model code in tiny configurations traced at two lengths and scaled to the real configs. TTFT: time to
first token, projected on an M3 Ultra, central (fast end-slow end); "of the limit": the compute limit (every matrix
FLOP at the 16-bit peak) over the TTFT. Dispatches are a lower bound (an MPSGraph op counted as one, its internal
kernels uncounted), bytes a lower bound (each operand once); the compute time is the part these figures project best.

{census_table(rows)}

Calls that grow with the prompt (the delta rule's loop over chunks, derived from the two traced lengths):

{growth_table(rows)}

Matrix work by layer kind (the real configs' dimensions):

{work_table(rows)}

The kernel that does each part's matrix work, and its efficiency (prefill.KERNEL_EFFICIENCY; a counted figure in
prefill.MEASURED_EFFICIENCY replaces an assumption):

{kernel_table(rows)}

The first prompt of a process ({DOC_LENGTH} tokens): mps_ext's kernel variants compile on their first call, one
variant at a time (the Mac backend; docs/dev/first_call.md), at prefill.COMPILE_PER_FUNCTION each (below); "whole
libraries (before)": the variants compiled when a first call compiled its whole library. Variants as the tiny trace
ran them (a real model's dimensions may pick other variants of the same kernels, about as many); torch's own kernels
and MPSGraph graphs, which also build on first use, are not counted:

{first_call_table(rows)}

Beside published prefill rates ({DOC_LENGTH}-token prompt, torch 2.15):

{peers_table(rows)}

{PEERS_NOTE}

Constants:
{prefill.constants_text()}
- compile of one kernel variant: {_s(tuple(prefill.compile_s(1, w) * 1e3 for w in ("high", "central", "low")))} ms
  ({prefill.COMPILE_PER_FUNCTION.source})
{timeline.constants_text()}

How each figure is counted:

{doc[doc.index("- Calls and dispatches"):].strip()}

Models:
{notes}
"""
    return text, rows


# ------------------------------------------------------------------- docs --
# README's prefill table, between markers `python -m benchmarks prefill --optimize --write-docs` rewrites and
# tests/test_docs.py compares with what the census gives (bench_decode's blocks, its markers' helpers).
DOCS = {"README.md": ("prefill",)}
DOC_COMMAND = "python -m benchmarks prefill --optimize --write-docs"


def doc_rows(transform) -> list[Row]:
    """The rows README's table needs: every model at DOC_LENGTH on torch
    2.15, stock and after `transform` (mps_ext.optimize), bf16 and fp8."""
    return census_rows(list(census.MODELS), lengths=(DOC_LENGTH,), transform=transform, releases=("2.15",),
                       whos=(STOCK, OPTIMIZED, OPTIMIZED_FP8))


def doc_blocks(rows: list[Row]) -> dict[str, str]:
    return {"prefill": readme_table(rows)}


if __name__ == "__main__":
    from benchmarks.common import run_as_script
    run_as_script("prefill")
