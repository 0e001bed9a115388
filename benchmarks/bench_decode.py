"""What a decoded token costs on a Mac, counted from real model code, and
the tokens/s an MPS stream running it gives (benchmarks/census.py says how
the forward is counted, benchmarks/generate_loop.py how generate's loop is,
benchmarks/timeline.py how the step is simulated).

    python -m benchmarks decode [--quick | --tiny] [--context N] [--optimize]

The step is what `model.generate` runs per token: the forward and
generate's own loop (sampling with top-k/top-p; transformers'
DeferredStopCheck, as on MPS). Per model (Qwen3-30B-A3B, Qwen3.6-35B-A3B,
LFM2.5-8B-A1B, bf16), per decode step of 1 and 4 sequences at a stated
context, per torch release (2.14, 2.15), stock torch and with mps_ext (with
--optimize also after mps_ext.optimize(model), bf16 and after
mps_ext.quantize_fp8), eager and torch.compile: host calls, view calls,
Metal dispatches, commits, syncs and bytes per token, per layer kind and for
the whole step, and the simulated tokens/s on an M3 Ultra with its range.
The simulation is calibrated on torch 2.14's and 2.15's published figures
(and cross-validated); the same tables show generate's loop at 1k, 4k and
32k of context, where commits pay, what issue 31's other points would buy
(what-if rows), issue 31's goals, and the published peers.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import census, generate_loop, timeline  # noqa: E402
from benchmarks.common import markdown  # noqa: E402

STOCK = "stock"
OURS = "mps_ext"
OPTIMIZED = "mps_ext + optimize"
OPTIMIZED_FP8 = "mps_ext + optimize, fp8"
OPTIMIZED_FP8_HEAD = "mps_ext + optimize, fp8 + fp8 LM head"
OPTIMIZED_ROWS = (OPTIMIZED, OPTIMIZED_FP8, OPTIMIZED_FP8_HEAD)
# The KV cache of each row (census.CACHES): optimized and compiled, the static cache README and docs/decode.md
# tell compile users to ask generate for (cache_implementation="static"), which Inductor writes in place; every
# other row transformers' default DynamicCache (eager and optimized: appended in place by kv_append).
CONTEXT = 4096           # tokens of context each sequence has when the step runs (KV cache and states)
CONTEXTS = (1024, 4096, 32768, 131072)
SAMPLING = "sampling"    # generate_loop.SAMPLING: the step a user runs with top-k/top-p
STOP_CHECK = "deferred"  # generate_loop.STOP_CHECKS: transformers' DeferredStopCheck, as generate runs on MPS
COMMIT_EVERY = (1, 2, 4, 8)
# Sequences a step decodes at once (the full benchmark): the MoE kernels read each expert the batch chose once
# (tests/ops/test_moe_layer.py::test_each_chosen_expert_is_read_once), so the weights a token costs fall with
# the batch; mps_ext's decode GEMV takes up to 8 rows, the MoE decode kernels up to 1024 token slots.
BATCHES = (1, 2, 4, 8, 16)  # mps_ext.stream.install_commits(every=k) candidates

# Issue 31's goals (simulated, central, M3 Ultra, 4k context, generate with sampling, one sequence), on the
# optimized path, eager and compiled alike; fp8 with an fp8 LM head (quantize_fp8(model, lm_head=True)).
TOK_S_GOALS = {"Qwen3.6-35B-A3B": {"bf16": 90, "fp8": 140}, "LFM2.5-8B-A1B": {"bf16": 165, "fp8": 250}}
# Issue 19's goals, checked on the optimized path.
MOE_HOST_CALLS_GOAL = 4       # host calls per MoE block (router to combine, shared expert included)
LAYER_DISPATCHES_GOAL = 12    # dispatches per decoder layer, attention included
PAYS = 0.005  # a commit policy pays when it adds more than this share to the simulated tokens/s (below: rounding)
HIDDEN = 0.05  # a step hides its host time behind the GPU when the GPU idles less than this share of it

# Published decode figures, one sequence (anchors.md, "Peers' decode"): (model, engine and weights, chip, tok/s
# low, high, source). Only those of the census's models; bytes differ with the quantisation.
PEERS = [
    ("Qwen3.6-35B-A3B", "MLX 4-bit (oMLX)", "M3 Ultra", 117.5, 122.1, "jundot/omlx PR 2755 (4k context)"),
    ("Qwen3.6-35B-A3B", "MLX 6-bit (oMLX)", "M3 Ultra", 84.5, 84.5, "jundot/omlx issue 2238"),
    ("Qwen3.6-35B-A3B", "MLX 8-bit (Rapid-MLX)", "M3 Ultra", 71.8, 74.7, "raullenchai/Rapid-MLX issue 472"),
    ("Qwen3-30B-A3B", "llama.cpp Q8_0", "M2 Ultra", 76.3, 76.3, "ggml-org/llama.cpp PR 15616"),
    ("Qwen3-30B-A3B", "MLX 4-bit", "M4 Max", 123.9, 123.9, "Rapid-MLX docs/benchmarks/llm.md"),
]


@dataclasses.dataclass
class Row:
    model: str
    tokens: int
    release: str
    mode: str
    who: str                 # STOCK, OURS or one of OPTIMIZED_ROWS
    fp8: bool                # weights as mps_ext.quantize_fp8 leaves them
    counts: census.Counts    # per step: the forward and generate's loop
    loop: census.Counts      # of which generate's loop
    per_kind: dict           # layer kind -> Counts (one layer)
    ffn: dict                # layer kind -> Counts of its feed-forward block alone
    layers: dict             # layer kind -> layers of that kind
    bytes: dict              # census.step_bytes, and 'loop': generate's loop
    tok_s: tuple[float, float, float]  # slow end, central, fast end
    sim: timeline.Timeline   # the central simulation
    make: object = dataclasses.field(repr=False, default=None)  # make(**what_if) -> timeline.Step
    fp8_head: bool = False   # the LM head in fp8 too (quantize_fp8(lm_head=True))
    cache: str = "dynamic"   # the KV cache the step runs with (kv_cache())

    def per_token(self, x: float) -> float:
        return x / self.tokens


def variants(optimize=None) -> list[tuple[str, object, bool]]:
    """(who, transform, fp8) of each mps_ext row: mps_ext as imported and,
    given `optimize` (mps_ext.optimize), the model after it, bf16, after
    mps_ext.quantize_fp8, and after quantize_fp8 with its LM head too."""
    out = [(OURS, None, False)]
    if optimize is not None:
        import mps_ext
        out += [(OPTIMIZED, optimize, False), (OPTIMIZED_FP8, lambda m: optimize(mps_ext.quantize_fp8(m)), True),
                (OPTIMIZED_FP8_HEAD, lambda m: optimize(mps_ext.quantize_fp8(m, lm_head=True)), True)]
    return out


def as_is(model):
    """A transform that keeps the model (census.trace_step and trace_prefill
    then trace a copy of it)."""
    return None


def transformed(model, transform):
    """A copy of `model` after `transform` (None: `model` itself), to be
    traced with `as_is` for every release, cache and length: made once, as
    mps_ext.optimize checks each conversion on a probe and a short generate
    (seconds), and it runs before run_model either way, so it is the same
    for every release."""
    if transform is None:
        return model
    ready = copy.deepcopy(model)
    return transform(ready) or ready


def kv_cache(who: str, mode: str) -> str:
    """The KV cache a row's step runs with (census.CACHES; see OPTIMIZED_ROWS)."""
    return "static" if mode == "compile" and who in OPTIMIZED_ROWS else "dynamic"


def _maker(spec, trace, config, **base):
    """make(**what_if): the row's timeline.step, its arguments `base` with
    `what_if`'s in their place (built once for each what_if)."""
    built = {}

    def make(**what_if):
        key = repr(sorted(what_if.items(), key=lambda kv: kv[0]))
        if key not in built:
            built[key] = timeline.step(spec, trace, config, **{**base, **what_if})
        return built[key]
    return make


def census_rows(models: list[str], tokens: tuple[int, ...], context: int = CONTEXT, transform=None,
                releases=census.RELEASES, modes=census.MODES, log=None, sampling: str = SAMPLING,
                stop_check: str = STOP_CHECK) -> list[Row]:
    """Every (model, tokens, release, mode, who) row: one stock trace per
    (model, tokens) serves both releases; one trace per release of each
    mps_ext variant (variants(transform); the release's policy decides which
    calls run mps_ext's kernels); one trace of generate's loop per (model,
    tokens)."""
    rows = []
    for name in models:
        spec = census.MODELS[name]
        model = census.tiny_model(spec)
        real = spec.config()
        kinds = variants(transform)
        ready = {who: transformed(model, tf) for who, tf, _ in kinds}
        for t in tokens:
            start = time.perf_counter()
            stock = census.trace_step(model, t)
            caches = {who: {kv_cache(who, m) for m in modes} for who, _, _ in kinds}
            traces = {(who, r, c): census.trace_step(ready[who], t, torch_release=r, transform=as_is, cache=c)
                      for who, _, _ in kinds for r in releases for c in caches[who]}
            loop = generate_loop.trace_loop(model, sampling, t, stop_check=stop_check)
            if log:
                log(f"  decode {name} tokens={t}: traced in {time.perf_counter() - start:.1f} s")
            loop_b = generate_loop.loop_bytes(loop, real.vocab_size, context + 1)
            for release in releases:
                for mode in modes:
                    for who, fp8 in [(STOCK, False)] + [(who, fp8) for who, _, fp8 in kinds]:
                        cache = kv_cache(who, mode)
                        trace = stock if who == STOCK else traces[(who, release, cache)]
                        ours = who != STOCK
                        head = who == OPTIMIZED_FP8_HEAD
                        s = census.scale(spec, trace, model.config, t, release, mode, ours, context, cache)
                        copy = not census.appends_in_place(trace, mode)
                        b = dict(census.step_bytes(real, t, context, fp8=fp8, fp8_head=head, cache_copy=copy,
                                                   cache=cache), loop=loop_b)
                        make = _maker(spec, trace, model.config, loop=loop, release=release, mode=mode,
                                      ours=ours, tokens=t, context=context, fp8=fp8, fp8_head=head,
                                      cache_copy=copy, cache=cache)
                        k = timeline.costs()
                        st = make()
                        loop_counts = census.count(loop.calls, release, "eager", False)
                        rows.append(Row(name, t, release, mode, who, fp8, st.counts, loop_counts, s["per_kind"],
                                        s["ffn"], s["layers"], b, timeline.tok_s_range(make),
                                        timeline.simulate(st, k), make, head, cache))
    return rows


def _f(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def _tok(t: tuple[float, float, float], digits: int = 0) -> str:
    lo, mid, hi = t
    return f"{mid:.{digits}f} ({lo:.{digits}f}-{hi:.{digits}f})"


def census_table(rows: list[Row], context: int) -> str:
    out = []
    for r in rows:
        kinds = [k for k in r.per_kind if k != "head"]
        real = census.MODELS[r.model].config()
        copy = r.bytes["kv_copy"] > 0  # the row's bytes: torch.cat's copy of the cache, or kv_append's rows
        out.append(
            {
                "model": r.model,
                "tokens": r.tokens,
                "torch": r.release,
                "mode": r.mode,
                "": r.who,
                "host calls / token": _f(r.per_token(r.counts.host)),
                "view calls / token": _f(r.per_token(r.counts.views)),
                "dispatches / token": _f(r.per_token(r.counts.dispatches)),
                "syncs / step": _f(r.counts.syncs),
                "commits / step": _f(r.counts.commits),
                "of which generate's loop: host / views / dispatches": f"{_f(r.loop.host)} / {_f(r.loop.views)} / "
                f"{_f(r.loop.dispatches)}",
                "per layer: host calls / dispatches": "; ".join(
                    f"{k} x{r.layers[k]}: {_f(r.per_kind[k].host)} / {_f(r.per_kind[k].dispatches)}" for k in kinds
                )
                + f"; outside the layers: {_f(r.per_kind['head'].host)} / {_f(r.per_kind['head'].dispatches)}",
                "MB / token": f"{(r.bytes['total'] + r.bytes['loop']) / r.tokens / 1e6:,.0f}",
                "per layer: MB / token": "; ".join(
                    f"{k}: {census.layer_bytes(real, k, r.tokens, context, r.fp8, cache_copy=copy, cache=r.cache)['total'] / r.tokens / 1e6:,.1f}"  # noqa: E501
                    for k in kinds
                ),
            }
        )
    return markdown(out, list(out[0]))


def loop_table(models: list[str], contexts=CONTEXTS) -> str:
    """Generate's loop per token, one sequence: per model, sampling and stop
    check, its calls (the same at every context) and bytes at each context;
    and torch's decode SDPA's dispatches at each."""
    out = []
    for name in models:
        spec = census.MODELS[name]
        model = census.tiny_model(spec)
        real = spec.config()
        for sampling in generate_loop.SAMPLING:
            for stop in generate_loop.STOP_CHECKS:
                loop = generate_loop.trace_loop(model, sampling, 1, stop_check=stop)
                c = census.count(loop.calls, "2.15", "eager", False)
                out.append(
                    {
                        "model": name,
                        "generate": sampling,
                        "stop check": stop,
                        "host calls": _f(c.host),
                        "view calls": _f(c.views),
                        "dispatches": _f(c.dispatches),
                        "syncs": _f(c.syncs),
                        "commits": _f(c.commits),
                        "waits for the previous step": _f(c.waits),
                        **{
                            f"MB at {n // 1024}k": f"{generate_loop.loop_bytes(loop, real.vocab_size, n + 1) / 1e6:.1f}"
                            for n in contexts
                        },
                    }
                )
    table = markdown(out, list(out[0]))
    sdpa = ", ".join(f"{n // 1024}k: {census.sdpa_dispatches(n + 1)}" for n in contexts)
    return (f"{table}\n\ntorch's decode SDPA (2.14 and 2.15), dispatches per attention layer and token by context "
            f"({sdpa}): two passes from {census.SDPA_TWO_PASS_KEYS} keys (census.sdpa_dispatches).")


def bytes_table(rows: list[Row], context: int) -> str:
    seen, out = set(), []
    for r in rows:
        if (r.model, r.tokens, r.fp8, r.fp8_head) in seen:
            continue
        seen.add((r.model, r.tokens, r.fp8, r.fp8_head))
        b = r.bytes
        weights = ("fp8 (quantize_fp8, LM head too)" if r.fp8_head else "fp8 (quantize_fp8)") if r.fp8 else "bf16"
        out.append({"model": r.model, "tokens": r.tokens, "weights": weights,
                    "weights MB": f"{b['weights'] / 1e6:,.0f}",
                    f"KV cache read by attention MB (context {context})": f"{b['kv_read'] / 1e6:,.1f}",
                    "KV cache copied by DynamicCache's torch.cat (read + written) MB": f"{b['kv_copy'] / 1e6:,.1f}",
                    "recurrent + conv state read and written MB": f"{b['state'] / 1e6:,.1f}",
                    "generate's loop MB": f"{b['loop'] / 1e6:,.1f}",
                    "total MB / step": f"{(b['total'] + b['loop']) / 1e6:,.0f}"})
    return markdown(out, list(out[0]))


def _published(r: Row) -> float | None:
    if r.who != STOCK or r.tokens != 1 or r.mode != "compile":
        return None
    return census.MODELS[r.model].published.get(r.release)


def summary_table(rows: list[Row], keep=lambda release, who: True, columns: list[str] | None = None) -> str:
    """One sequence, per model, release and stock / mps_ext: eager and
    compiled host calls, dispatches, commits, syncs, bytes and simulated
    tokens/s beside the published figure (docs/decode.md); `keep(release,
    who)` picks the rows and `columns` the columns (README's short table)."""
    keyed = {(r.model, r.release, r.who, r.mode): r for r in rows if r.tokens == 1}
    out = []
    for (model, release, who, mode), c in keyed.items():
        if mode != "compile" or not keep(release, who):
            continue
        e = keyed[(model, release, who, "eager")]
        pub = _published(c)

        def pair(f):
            a, b = f(e), f(c)
            return a if a == b else f"{a}; {b}"

        out.append({"model": model, "torch": release, "": who,
                    "host calls (eager; compiled)": pair(lambda r: _f(r.counts.host)),
                    "view calls": _f(e.counts.views),
                    "dispatches (eager; compiled)": pair(lambda r: _f(r.counts.dispatches)),
                    "commits": pair(lambda r: _f(r.counts.commits)), "syncs": pair(lambda r: _f(r.counts.syncs)),
                    "GB (eager; compiled)": pair(lambda r: f"{(r.bytes['total'] + r.bytes['loop']) / 1e9:.2f}"),
                    "tok/s eager": _tok(e.tok_s), "tok/s compiled": _tok(c.tok_s),
                    "published (torch.compile)": "" if pub is None else str(pub)})
    return markdown(out, columns or list(out[0]))


def readme_table(rows: list[Row]) -> str:
    """README's short table: per model, stock torch 2.14 and 2.15 and the
    optimized path on 2.15 (bf16, fp8)."""
    return summary_table(rows, lambda release, who: who == STOCK or (release == "2.15" and who != OURS),
                         ["model", "torch", "", "dispatches (eager; compiled)", "GB (eager; compiled)",
                          "tok/s eager", "tok/s compiled", "published (torch.compile)"])


def byte_limit(model: str, fp8: bool, fp8_head: bool = False, context: int = CONTEXT) -> float:
    """Tokens/s if a step (one sequence, the KV cache appended in place)
    cost only its bytes at the measured sustained bandwidth."""
    b = census.step_bytes(census.MODELS[model].config(), 1, context, fp8=fp8, fp8_head=fp8_head, cache_copy=False)
    return timeline.BANDWIDTH.high / b["total"]


def peers_table(rows: list[Row]) -> str:
    """Per model: the published figures (stock torch and the peers), the
    byte limits, and the simulated optimized path."""
    out = []
    for model in dict.fromkeys(r.model for r in rows):
        spec = census.MODELS[model]
        for release, v in sorted(spec.published.items()):
            out.append({"model": model, "": f"torch {release} bf16, torch.compile (published)", "tok/s": f"{v}",
                        "source": "the torch 2.15 release (anchors.md)"})
        for m, engine, chip, lo, hi, source in PEERS:
            if m == model:
                out.append({"model": model, "": f"{engine}, {chip} (published)",
                            "tok/s": f"{lo}" if lo == hi else f"{lo}-{hi}", "source": source})
        for r in rows:
            if r.model == model and r.tokens == 1 and r.release == "2.15" and r.who in OPTIMIZED_ROWS:
                out.append({"model": model, "": f"{r.who}, torch 2.15 {r.mode} (simulated)", "tok/s": _tok(r.tok_s),
                            "source": "this census (timeline.py)"})
        for label, fp8, head in (("bf16", False, False), ("fp8", True, False), ("fp8 with an fp8 LM head", True, True)):
            out.append({"model": model, "": f"byte limit, {label} (bytes / 692 GB/s, no overhead)",
                        "tok/s": f"{byte_limit(model, fp8, head):.0f}", "source": "census.step_bytes"})
    return markdown(out, ["model", "", "tok/s", "source"])


def calibration(rows: list[Row]) -> tuple[str, dict | None]:
    """Stock torch compiled, one sequence, against the published figures:
    timeline.calibrate (DISPATCH on 2.15's, ROUND_TRIP on 2.14's)."""
    points = {(r.model, r.release): (r.make, _published(r)) for r in rows if _published(r) is not None}
    releases = {rel for _, rel in points}
    if not set(timeline.CALIBRATION.values()) <= releases or len(points) < 4:
        return "(calibration needs the published figures of both releases: the full decode benchmark)", None
    cal = timeline.calibrate(points)
    out = []
    for (model, release), f in cal["figures"].items():
        fits = f["fits"]
        unit = 1e6 if fits == "dispatch" else 1e3
        out.append(
            {
                "model": model,
                "torch": release,
                "published tok/s": f["published"],
                "simulated, both constants fitted": f"{f['fitted']:.1f} ({f['fitted'] / f['published']:.2f})",
                "within 15%": "yes" if timeline.within(f["fitted"] / f["published"]) else "no",
                "fits": {"dispatch": "GPU us per dispatch", "round_trip": "round trip ms"}[fits],
                "its own value": f"{f['implied'] * unit:.3g}",
                "predicted from the other model's value": f"{f['predicted']:.1f} ({f['predicted'] / f['published']:.2f})",  # noqa: E501
                "cross-validated within 15%": "yes" if timeline.within(f["predicted"] / f["published"]) else "no",
            }
        )
    text = markdown(out, list(out[0]))
    text += (f"\n\nFitted: GPU cost per dispatch {cal['dispatch'] * 1e6:.2f} us on torch "
             f"{timeline.CALIBRATION['dispatch']}'s figures (central in use: {timeline.DISPATCH.central * 1e6:g} us), "
             f"round trip of a synchronisation {cal['round_trip'] * 1e3:.3f} ms on torch "
             f"{timeline.CALIBRATION['round_trip']}'s with that dispatch cost (central in use: "
             f"{timeline.ROUND_TRIP.central * 1e3:g} ms). Every other constant is measured or published.")
    return text, cal


def _simulate(make, k: dict, **what_if) -> timeline.Timeline:
    return timeline.simulate(make(**what_if), k)


def commit_table(rows: list[Row], loops: dict) -> tuple[str, list[dict]]:
    """Where commits pay: the optimized path, one sequence, torch 2.15, per
    stop check: simulated tokens/s without commits and with
    mps_ext.stream.install_commits(every=k)."""
    from mps_ext.stream import commit_layers
    out = []
    k = timeline.costs()
    for r in rows:
        if r.tokens != 1 or r.release != "2.15" or r.who not in OPTIMIZED_ROWS:
            continue
        n = sum(r.layers.values())
        for stop in generate_loop.STOP_CHECKS:
            loop = loops[(r.model, stop)]
            base = _simulate(r.make, k, loop=loop)
            row = {"model": r.model, "weights": "fp8" if r.fp8 else "bf16", "mode": r.mode, "stop check": stop,
                   "no commits: tok/s (host / GPU / GPU idle ms)":
                       f"{base.tokens_per_s:.1f} ({base.host_busy * 1e3:.1f} / {base.gpu_busy * 1e3:.1f} / "
                       f"{base.gpu_idle * 1e3:.1f})"}
            best = (base.tokens_per_s, None)
            for every in COMMIT_EVERY:
                sim = _simulate(r.make, k, loop=loop, commit_after=commit_layers(n, every))
                row[f"every {every}"] = f"{sim.tokens_per_s:.1f}"
                if sim.tokens_per_s > best[0] * (1 + PAYS):
                    best = (sim.tokens_per_s, every)
            row["pays most"] = (
                "none" if best[1] is None else f"every {best[1]} (+{best[0] / base.tokens_per_s - 1:.0%})"
            )
            out.append(row)
    if not out:
        return "(commit points are simulated on the optimized path: python -m benchmarks decode --optimize)", out
    return markdown(out, list(out[0])), out


def what_if(rows: list[Row]) -> tuple[str, list[dict]]:
    """What issue 31's points 4 and 5 would still buy on the optimized path
    (one sequence, torch 2.15): simulated tokens/s (central) with each
    remaining change alone and all together, and the dispatches a token each
    leaves. (Point 6, the fp8 LM head and the compiled cache without
    copies, are rows of their own: OPTIMIZED_FP8_HEAD, kv_cache().)"""
    out = []
    k = timeline.costs()
    for r in rows:
        if r.tokens != 1 or r.release != "2.15" or r.who not in OPTIMIZED_ROWS:
            continue
        cases = {"as today": {}, "4: one host call a decoder layer": {"layer_host_calls": 1} if r.mode == "eager"
                 else None}
        cases.update((f"5: {label}", delta and {"dispatch_delta": delta}) for label, delta in _fusions_left(r).items())
        together = {kk: v for case in cases.values() if case for kk, v in case.items() if kk != "dispatch_delta"}
        together["dispatch_delta"] = collections.Counter()
        for case in cases.values():
            together["dispatch_delta"].update((case or {}).get("dispatch_delta", {}))
        cases["all"] = together
        row = {"model": r.model, "": r.who, "mode": r.mode}
        for label, kw in cases.items():
            if kw is None:
                row[label] = "-"
                continue
            step = r.make(**kw)
            row[label] = f"{timeline.simulate(step, k).tokens_per_s:.1f} ({step_dispatches(step):.0f})"
        out.append(row)
    if not out:
        return "(what-ifs are simulated on the optimized path: python -m benchmarks decode --optimize)", out
    return markdown(out, list(out[0])) + "\n\n(tokens/s (dispatches a token); -: not in that row)", out


def step_dispatches(step: timeline.Step) -> float:
    """The dispatches of a step's ops (what-ifs included)."""
    return sum(op.counts.dispatches for op in step.ops)


def _fusions_left(r: Row) -> dict[str, dict]:
    """Issue 31 point 5's fusions not done yet, as the dispatches each layer
    kind (or the calls before the layers, "pre") would lose: {label: delta,
    or None where the row has no such calls}. None left: done and in the
    rows are the norms in the GEMVs that read them, the post-attention add
    and norm in the router GEMV, the cache append in the q/k-norm + rotary
    dispatch, the output gate in o_proj's GEMV (sigmoid_gate_linear), the
    routing in the experts' gate/up kernel (moe_gate_up_routed: moe_route's
    dispatch, one a MoE layer) and, eager, the rotary tables as one gather
    from tables made once (mps_ext/passes/rotary.py: the calls before the
    layers are the embedding, the positions the model makes and that
    gather)."""
    return {}


def context_table(rows: list[Row], contexts=CONTEXTS) -> str:
    """One sequence, torch 2.15, stock and optimized bf16: simulated tokens/s
    and MB a step at each context."""
    out = []
    for r in rows:
        if r.tokens != 1 or r.release != "2.15" or r.who not in (STOCK, *OPTIMIZED_ROWS):
            continue
        row = {"model": r.model, "": r.who, "mode": r.mode}
        for n in contexts:
            k = timeline.costs()
            st = r.make(context=n)
            row[f"{n // 1024}k: tok/s (MB)"] = f"{timeline.simulate(st, k).tokens_per_s:.1f} ({st.bytes / 1e6:,.0f})"
        out.append(row)
    return markdown(out, list(out[0]))


def batch_table(rows: list[Row]) -> str:
    """Per model, torch 2.15, eager, stock and optimized: simulated tokens/s
    of all the sequences together and MB a token, at each batch traced."""
    batches = sorted({r.tokens for r in rows})
    out = {}
    for r in rows:
        if r.release != "2.15" or r.mode != "eager" or r.who not in (STOCK, OPTIMIZED, OPTIMIZED_FP8):
            continue
        row = out.setdefault((r.model, r.who), {"model": r.model, "": r.who})
        row[f"{r.tokens} seq: tok/s (MB / token)"] = (
            f"{r.tok_s[1]:.0f} ({(r.bytes['total'] + r.bytes['loop']) / r.tokens / 1e6:,.0f})")
    if not out:
        return "(no rows)"
    return markdown(list(out.values()), ["model", ""] + [f"{b} seq: tok/s (MB / token)" for b in batches])


def _most(counts: dict, what: str) -> tuple[float, str]:
    """The largest `what` of Counts by layer kind, and each kind's."""
    values = {k: getattr(c, what) for k, c in counts.items()}
    return max(values.values()), ", ".join(f"{k} {_f(v)}" for k, v in values.items())


def _met(ok: bool) -> str:
    return "met" if ok else "not met"


def goals(rows: list[Row]) -> tuple[str, list[dict]]:
    """On the optimized path, one sequence: issue 31's goals (simulated
    tokens/s, central, against the goal of the model: bf16, and fp8 with
    an fp8 LM head; host time hidden behind the GPU) and issue
    19's (host calls per MoE block, dispatches per decoder layer, the most
    of any layer kind)."""
    out = []
    for r in rows:
        if r.tokens != 1 or r.who not in OPTIMIZED_ROWS:
            continue
        weights = "fp8" if r.fp8 else "bf16"
        # the fp8 goal is the fp8 head's
        goal = None if r.who == OPTIMIZED_FP8 else TOK_S_GOALS.get(r.model, {}).get(weights)
        sim = r.sim  # its own simulation: the fp8 head is a row of its own (OPTIMIZED_FP8_HEAD)
        host, host_each = _most({kk: c for kk, c in r.ffn.items() if kk.endswith("+moe")}, "host")
        disp, disp_each = _most({kk: c for kk, c in r.per_kind.items() if kk != "head"}, "dispatches")
        hidden = sim.gpu_idle <= HIDDEN * sim.period
        out.append({"model": r.model, "torch": r.release, "": r.who, "mode": r.mode,
                    "tok/s": f"{sim.tokens_per_s:.1f}",
                    "tok/s goal": "-" if goal is None else f">= {goal}: {_met(sim.tokens_per_s >= goal)}",
                    "host hidden behind the GPU (GPU idle ms a step)": f"{_met(hidden)} ({sim.gpu_idle * 1e3:.2f})",
                    "host calls per MoE block": f"{_f(host)} ({host_each})",
                    f"<= {MOE_HOST_CALLS_GOAL}": _met(host <= MOE_HOST_CALLS_GOAL),
                    "dispatches per layer": f"{_f(disp)} ({disp_each})",
                    f"<= {LAYER_DISPATCHES_GOAL}": _met(disp <= LAYER_DISPATCHES_GOAL)})
    if not out:
        return "(the goals are checked on the optimized path: python -m benchmarks decode --optimize)", out
    return markdown(out, list(out[0])), out


def chart_bars(rows: list[Row]) -> list[dict]:
    """decode_chart's bars, per model: stock torch 2.15 (published), the
    optimized path bf16 and fp8 (simulated, torch 2.15 eager: central and
    range), the peers' published figures; and the byte limits (bf16, fp8)."""
    out = []
    for model in dict.fromkeys(r.model for r in rows):
        spec = census.MODELS[model]
        if "2.15" in spec.published:
            v = spec.published["2.15"]
            out.append({"model": model, "series": "torch 2.15, bf16, compiled (published)", "kind": "published",
                        "low": v, "central": v, "high": v})
        for r in rows:
            if (r.model == model and r.tokens == 1 and r.release == "2.15" and r.mode == "eager"
                    and r.who in OPTIMIZED_ROWS):
                lo, mid, hi = r.tok_s
                out.append({"model": model, "series": f"{r.who} (simulated, eager)", "kind": "ours",
                            "low": lo, "central": mid, "high": hi})
        for m, engine, chip, lo, hi, _ in PEERS:
            if m == model:
                out.append({"model": model, "series": f"{engine}, {chip} (published)", "kind": "peer",
                            "low": lo, "central": (lo + hi) / 2, "high": hi})
        for label, fp8 in (("bf16", False), ("fp8", True)):
            out.append({"model": model, "series": f"byte limit, {label}", "kind": "limit",
                        "central": byte_limit(model, fp8)})
    return out


SOURCES = """Published figures: torch 2.15 release (anchors.md, "The headline figures"): MoE decode with torch.compile on an M3
Ultra, Qwen3.6-35B-A3B 9.4 (2.14) -> 61.3 (2.15) tokens/s, LFM2.5-8B-A1B 23.6 -> 123.6, bf16, one sequence; their
context and generate settings are not stated (simulated at this table's context, with generate's loop as above)."""  # noqa: E501


def models_for(size: str) -> tuple[list[str], tuple[int, ...]]:
    if size == "tiny":
        return ["Qwen3-30B-A3B"], (1,)
    return list(census.MODELS), BATCHES


def report(size: str = "full", context: int = CONTEXT, transform=None, log=None) -> tuple[str, list[Row]]:
    """The decode benchmark's markdown, and its rows."""
    models, tokens = models_for(size)
    rows = census_rows(models, tokens, context, transform, log=log)
    cal, _ = calibration(rows)
    loops = stop_check_loops(models) if transform is not None else {}
    commits, _ = commit_table(rows, loops)
    whatifs, _ = what_if(rows)
    goal_table, _ = goals(rows)
    notes = "\n".join(f"- {s.name}: {s.source}" for s in census.MODELS.values() if s.name in models)
    text = f"""## decode

Per decode step of `tokens` sequences at a context of {context} tokens each, as `model.generate` runs it (the forward
and generate's loop: {SAMPLING} with top-k/top-p, transformers' {STOP_CHECK} stop check), bf16 weights (the fp8 rows:
as mps_ext.quantize_fp8 leaves them), on a Mac (counted from transformers {_transformers_version()} model and generate
code in tiny configurations with the real layer structure, scaled to the real configs; benchmarks/census.py and
benchmarks/generate_loop.py say how each figure is counted).

{census_table(rows, context)}

{_rules()}

Generate's loop, per token (benchmarks/generate_loop.py; one sequence; its calls are the same at every context, its
bytes grow with the vocabulary and the context):

{loop_table(models)}

One sequence, in short (tokens/s simulated on an M3 Ultra, central (range)):

{summary_table(rows)}

Bytes per step (the real configs' dimensions; activations, KB per layer, left out):

{bytes_table(rows, context)}

Simulated tokens/s on an M3 Ultra (benchmarks/timeline.py): the host encodes the step's calls in order, the GPU runs
what has been committed, commits and waits where torch's MPS stream makes them. Constants:
{timeline.constants_text()}

Calibration, stock torch with torch.compile against its published decode speed (one sequence):

{cal}

By context (one sequence, torch 2.15):

{context_table(rows)}

By batch (sequences decoded together, each at the context above; torch 2.15, eager; the MoE layers read each expert
the batch chose once, census.expected_experts; all the sequences' tokens/s):

{batch_table(rows)}

Commit points (mps_ext.stream.install_commits(model, every=k)), one sequence, torch 2.15, simulated tokens/s; the
stop check decides: with DeferredStopCheck the host encodes a step while the GPU runs the previous one, so a step
costs the larger of the two and commits buy nothing; with a sync every step (StopCheck) host and GPU add up within
the step and commits overlap them:

{commits}

What issue 31's other points would buy (simulated tokens/s, central, one sequence, torch 2.15, sampling, deferred
stop check; point 4 applies to eager steps, the compiled KV cache to compiled ones, the fp8 head to fp8 weights):

{whatifs}

Published figures beside the simulated optimized path (one sequence):

{peers_table(rows)}

Goals, on the optimized path, one sequence (issue 31: tok/s at 4k context with sampling, the host hidden behind the
GPU; issue 19: host calls per MoE block, dispatches per decoder layer, attention included):

{goal_table}

{SOURCES}

Models:
{notes}
"""
    return text, rows


def stop_check_loops(models: list[str]) -> dict:
    """{(model, stop check): generate's loop traced with that stop check}:
    what commit_table simulates each optimized step with."""
    return {(name, stop): generate_loop.trace_loop(census.tiny_model(census.MODELS[name]), SAMPLING, 1,
                                                   stop_check=stop)
            for name in models for stop in generate_loop.STOP_CHECKS}


# ------------------------------------------------------------------- docs --
# The figures the docs show, each between two markers that `python -m
# benchmarks decode --optimize --write-docs` rewrites and tests/test_docs.py
# compares with what the benchmark gives: {file: its blocks}.
DOCS = {"README.md": ("readme",), "docs/decode.md": ("summary", "constants", "calibration", "commits")}
ROOT = Path(__file__).resolve().parents[1]


def doc_blocks(rows: list[Row], loops: dict) -> dict[str, str]:
    """Every block of DOCS from census_rows of every model at one token
    (after mps_ext.optimize) and stop_check_loops."""
    return {"readme": readme_table(rows), "summary": summary_table(rows), "constants": timeline.constants_text(),
            "calibration": calibration(rows)[0], "commits": commit_table(rows, loops)[0]}


DOC_COMMAND = "python -m benchmarks decode --optimize --write-docs"


def _markers(name: str, command: str = DOC_COMMAND) -> tuple[str, str]:
    return (f"<!-- generated by `{command}`: {name} -->\n", f"\n<!-- end of generated {name} -->")


def blocks_in(text: str, names, command: str = DOC_COMMAND) -> dict[str, str]:
    """The generated blocks `names` of a doc's text, each between the
    markers of the `command` that writes it (an error names a missing
    marker)."""
    out = {}
    for name in names:
        start, end = _markers(name, command)
        if start not in text or end not in text:
            raise ValueError(f"no generated block {name!r}: its markers are {start.strip()} ... {end.strip()}")
        out[name] = text.split(start, 1)[1].split(end, 1)[0]
    return out


def write_docs(blocks: dict[str, str], root: Path = ROOT, docs: dict = DOCS, command: str = DOC_COMMAND) -> list[str]:
    """Rewrites each block of `docs` ({file: block names}; the decode
    tables by default, written by `command`) in its file under `root`;
    returns the files that changed."""
    changed = []
    for rel, names in docs.items():
        path = root / rel
        text = before = path.read_text()
        for name, old in blocks_in(text, names, command).items():
            start, end = _markers(name, command)
            text = text.replace(start + old + end, start + blocks[name] + end)
        if text != before:
            path.write_text(text)
            changed.append(rel)
    return changed


def _rules() -> str:
    """How each figure is counted: census.py's docstring, from its rules to the scaling."""
    doc = census.__doc__
    return doc[doc.index("From the trace, per call"):].strip()


def _transformers_version() -> str:
    import transformers
    return transformers.__version__


if __name__ == "__main__":
    from benchmarks.common import run_as_script
    run_as_script("decode")
