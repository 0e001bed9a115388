"""What a decoded token costs on a Mac, counted from real model code, and
the tokens/s that follows (benchmarks/census.py says how each figure is
counted).

    python -m benchmarks decode [--quick | --tiny] [--context N] [--optimize]

Per model (Qwen3-30B-A3B, Qwen3.6-35B-A3B, LFM2.5-8B-A1B, bf16), per decode
step of 1 and 4 sequences (one new token each) at a stated context, per
torch release (2.14, 2.15), stock torch and with mps_ext (with --optimize
also after mps_ext.optimize(model), bf16 and after mps_ext.quantize_fp8),
eager and torch.compile: host calls, Metal dispatches, syncs and bytes per
token, per layer kind and for the whole model, and the projected tokens/s on
an M3 Ultra with its range. The same projection of stock torch 2.15
(compiled) is set beside the published measurements (calibration: the GPU
cost per dispatch is fitted on them and cross-validated), and issue 19's
goals are checked on the optimized path.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import census  # noqa: E402
from benchmarks.common import markdown  # noqa: E402

STOCK = "stock"
OURS = "mps_ext"
OPTIMIZED = "mps_ext + optimize"
OPTIMIZED_FP8 = "mps_ext + optimize, fp8"
CONTEXT = 4096  # tokens of context each sequence has when the step runs (KV cache and states)

# Issue 19's goals (projected, central, M3 Ultra, one sequence), checked on
# the optimized path, bf16 and fp8, every release, eager and compiled.
TOK_S_GOALS = {"Qwen3.6-35B-A3B": {"bf16": 80, "fp8": 110}}  # the Qwen3.6-35B-A3B class
MOE_HOST_CALLS_GOAL = 4       # host calls per MoE block (router to combine, shared expert included)
LAYER_DISPATCHES_GOAL = 12    # dispatches per decoder layer, attention included


@dataclasses.dataclass
class Row:
    model: str
    tokens: int
    release: str
    mode: str
    who: str                 # STOCK, OURS, OPTIMIZED or OPTIMIZED_FP8
    fp8: bool                # weights as mps_ext.quantize_fp8 leaves them
    counts: census.Counts    # per step, whole model
    per_kind: dict           # layer kind -> Counts (one layer)
    ffn: dict                # layer kind -> Counts of its feed-forward block alone
    layers: dict             # layer kind -> layers of that kind
    bytes: dict              # census.step_bytes
    tok_s: tuple[float, float, float]  # low, central, high

    def per_token(self, x: float) -> float:
        return x / self.tokens


def variants(optimize=None) -> list[tuple[str, object, bool]]:
    """(who, transform, fp8) of each mps_ext row: mps_ext as imported and,
    given `optimize` (mps_ext.optimize), the model after it, bf16 and after
    mps_ext.quantize_fp8."""
    out = [(OURS, None, False)]
    if optimize is not None:
        import mps_ext
        out += [(OPTIMIZED, optimize, False), (OPTIMIZED_FP8, lambda m: optimize(mps_ext.quantize_fp8(m)), True)]
    return out


def census_rows(models: list[str], tokens: tuple[int, ...], context: int = CONTEXT, transform=None,
                releases=census.RELEASES, modes=census.MODES, log=None) -> list[Row]:
    """Every (model, tokens, release, mode, who) row: one stock trace per
    (model, tokens) serves both releases; one trace per release of each
    mps_ext variant (variants(transform); the release's policy decides which
    calls run mps_ext's kernels)."""
    rows = []
    for name in models:
        spec = census.MODELS[name]
        model = census.tiny_model(spec)
        real = spec.config()
        kinds = variants(transform)
        for t in tokens:
            start = time.perf_counter()
            stock = census.trace_step(model, t)
            traces = {(who, r): census.trace_step(model, t, torch_release=r, transform=tf)
                      for who, tf, _ in kinds for r in releases}
            if log:
                log(f"  decode {name} tokens={t}: traced in {time.perf_counter() - start:.1f} s")
            # the KV cache copied whole by torch.cat, or its new rows written in place (kv_append)
            nbytes = {(fp8, copy): census.step_bytes(real, t, context, fp8=fp8, cache_copy=copy)
                      for fp8 in (False, True) for copy in (False, True)}
            for release in releases:
                for mode in modes:
                    for who, fp8 in [(STOCK, False)] + [(who, fp8) for who, _, fp8 in kinds]:
                        trace = stock if who == STOCK else traces[(who, release)]
                        s = census.scale(spec, trace, model.config, t, release, mode, who != STOCK)
                        b = nbytes[(fp8, not census.appends_in_place(trace, mode))]
                        tok_s = tuple(census.project(b["total"], s["total"], t, w)
                                      for w in ("low", "central", "high"))
                        rows.append(Row(name, t, release, mode, who, fp8, s["total"], s["per_kind"], s["ffn"],
                                        s["layers"], b, tok_s))
    return rows


def chart_bars(rows: list[Row]) -> list[dict]:
    """decode_chart's bars: one sequence, every release, mode and stock / mps_ext."""
    out = []
    for r in rows:
        if r.tokens != 1:
            continue
        lo, mid, hi = r.tok_s
        pub = census.MODELS[r.model].published.get(r.release) if _published(r) else None
        out.append({"model": r.model, "series": f"torch {r.release} {r.mode}, {r.who}", "low": lo, "central": mid,
                    "high": hi, "published": pub})
    return out


def _us(seconds: float | None, none: str = "-") -> str:
    return none if seconds is None else f"{seconds * 1e6:.1f}"


def _f(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def census_table(rows: list[Row], context: int) -> str:
    out = []
    for r in rows:
        kinds = [k for k in r.per_kind if k != "head"]
        real = census.MODELS[r.model].config()
        copy = r.bytes["kv_copy"] > 0  # the row's bytes: torch.cat's copy of the cache, or kv_append's rows
        out.append({
            "model": r.model, "tokens": r.tokens, "torch": r.release, "mode": r.mode, "": r.who,
            "host calls / token": _f(r.per_token(r.counts.host)),
            "dispatches / token": _f(r.per_token(r.counts.dispatches)),
            "syncs / step": _f(r.counts.syncs),
            "view calls / token": _f(r.per_token(r.counts.views)),
            "per layer: host calls / dispatches": "; ".join(
                f"{k} x{r.layers[k]}: {_f(r.per_kind[k].host)} / {_f(r.per_kind[k].dispatches)}" for k in kinds)
            + f"; outside the layers: {_f(r.per_kind['head'].host)} / {_f(r.per_kind['head'].dispatches)}",
            "MB / token": f"{r.bytes['total'] / r.tokens / 1e6:,.0f}",
            "per layer: MB / token": "; ".join(
                f"{k}: {census.layer_bytes(real, k, r.tokens, context, r.fp8, cache_copy=copy)['total'] / r.tokens / 1e6:,.1f}"
                for k in kinds),
        })
    return markdown(out, list(out[0]))


def bytes_table(rows: list[Row], context: int) -> str:
    seen, out = set(), []
    for r in rows:
        if (r.model, r.tokens, r.fp8) in seen:
            continue
        seen.add((r.model, r.tokens, r.fp8))
        b = r.bytes
        out.append({"model": r.model, "tokens": r.tokens, "weights": "fp8 (quantize_fp8)" if r.fp8 else "bf16",
                    "weights MB": f"{b['weights'] / 1e6:,.0f}",
                    f"KV cache read by attention MB (context {context})": f"{b['kv_read'] / 1e6:,.1f}",
                    "KV cache copied by DynamicCache's torch.cat (read + written) MB": f"{b['kv_copy'] / 1e6:,.1f}",
                    "recurrent + conv state read and written MB": f"{b['state'] / 1e6:,.1f}",
                    "total MB / step": f"{b['total'] / 1e6:,.0f}"})
    return markdown(out, list(out[0]))


def projection_table(rows: list[Row]) -> str:
    out = []
    for r in rows:
        lo, mid, hi = r.tok_s
        out.append({"model": r.model, "tokens": r.tokens, "torch": r.release, "mode": r.mode, "": r.who,
                    "tok/s M3 Ultra": f"{mid:.1f} ({lo:.1f}-{hi:.1f})",
                    "published": _published(r)})
    return markdown(out, list(out[0]))


def summary_table(rows: list[Row]) -> str:
    """README's table: one sequence, per model, release and stock / mps_ext:
    eager and compiled host calls, dispatches, bytes and tokens/s."""
    keyed = {(r.model, r.release, r.who, r.mode): r for r in rows if r.tokens == 1}

    def pair(e: str, c: str) -> str:
        return e if e == c else f"{e}; {c}"

    def tok_s(r: Row) -> str:
        lo, mid, hi = r.tok_s
        return f"{mid:.0f} ({lo:.0f}-{hi:.0f})"

    out = []
    for (model, release, who, mode), r in keyed.items():
        if mode != "compile":
            continue
        e = keyed[(model, release, who, "eager")]
        pub = census.MODELS[model].published.get(release) if who == STOCK else None
        out.append({"model": model, "torch": release, "": who,
                    "host calls / token (eager; compiled)": f"{_f(e.counts.host)}; {_f(r.counts.host)}",
                    "dispatches / token (eager; compiled)": f"{_f(e.counts.dispatches)}; {_f(r.counts.dispatches)}",
                    "syncs": _f(r.counts.syncs),
                    "GB / token (eager; compiled)": pair(f"{e.bytes['total'] / 1e9:.2f}",
                                                         f"{r.bytes['total'] / 1e9:.2f}"),
                    "tok/s eager": tok_s(e), "tok/s compiled": tok_s(r),
                    "published (torch.compile)": "" if pub is None else str(pub)})
    return markdown(out, list(out[0]))


def _published(r: Row) -> str:
    if r.who != STOCK or r.tokens != 1 or r.mode != "compile":
        return ""
    v = census.MODELS[r.model].published.get(r.release)
    return "" if v is None else f"{v} (measured, torch.compile)"


def calibration(rows: list[Row]) -> tuple[str, list[dict]]:
    """Stock torch compiled, 1 token, against the published measurements;
    census.calibrate on those of census.CALIBRATION_RELEASE."""
    mine = [r for r in rows if _published(r)]
    if not mine:
        return "(no published figure for these rows)", []
    fit = [r for r in mine if r.release == census.CALIBRATION_RELEASE]
    points = [(r.bytes["total"], r.counts, r.tokens, census.MODELS[r.model].published[r.release]) for r in fit]
    cal = census.calibrate(points) if len(points) >= 2 else None
    out = []
    for r in mine:
        measured = census.MODELS[r.model].published[r.release]
        lo, mid, hi = r.tok_s
        i = fit.index(r) if cal and r in fit else None
        out.append({"model": r.model, "torch": r.release, "published tok/s": measured,
                    "projected tok/s": f"{mid:.1f} ({lo:.1f}-{hi:.1f})",
                    "projected / published": f"{mid / measured:.2f}",
                    "within 15%": "yes" if abs(mid / measured - 1) <= 0.15 else "no",
                    "implied GPU us per dispatch": _us(
                        census.implied_dispatch_cost(r.bytes["total"], r.counts, r.tokens, measured))
                    + ("" if i is not None else " (not fitted)"),
                    "the other figures' implied cost predicts: tok/s (/ published)":
                        "-" if i is None else f"{cal['cross'][i] * measured:.1f} ({cal['cross'][i]:.3f})",
                    "host us per call, at most": _us(
                        census.implied_host_cost(r.bytes["total"], r.counts, r.tokens, measured), "GPU-bound")})
    text = markdown(out, list(out[0]))
    if cal:
        bw, d = census.joint_fit(points)
        text += (f"\n\nGPU cost per dispatch fitted on torch {census.CALIBRATION_RELEASE}'s figures: the mean of "
                 f"the implied costs, {cal['central'] * 1e6:.2f} us (the projection's central: "
                 f"{census.DISPATCH.central * 1e6:g} us; the published range "
                 f"{census.DISPATCH.low * 1e6:g}-{census.DISPATCH.high * 1e6:g} us stays the range). Bandwidth "
                 f"fitted as well (least squares, GPU-bound; with two figures exact, so nothing left to check): "
                 f"{bw / 1e9:.0f} GB/s and {d * 1e6:.2f} us, against the measured {census.BANDWIDTH.central / 1e9:g} "
                 f"GB/s central ({census.BANDWIDTH.low / 1e9:g}-{census.BANDWIDTH.high / 1e9:g}): the projection "
                 "keeps the measured bandwidth.")
    return text, out


def _most(counts: dict, what: str) -> tuple[float, str]:
    """The largest `what` of Counts by layer kind, and each kind's."""
    values = {k: getattr(c, what) for k, c in counts.items()}
    return max(values.values()), ", ".join(f"{k} {_f(v)}" for k, v in values.items())


def _met(ok: bool) -> str:
    return "met" if ok else "not met"


def goals(rows: list[Row]) -> tuple[str, list[dict]]:
    """Issue 19's goals on the optimized path, one sequence: per model,
    release, weights and mode, the projected tokens/s (central, range)
    against the goal of its class, host calls per MoE block and dispatches
    per decoder layer (the most of any layer kind)."""
    out = []
    for r in rows:
        if r.tokens != 1 or r.who not in (OPTIMIZED, OPTIMIZED_FP8):
            continue
        weights = "fp8" if r.fp8 else "bf16"
        lo, mid, hi = r.tok_s
        goal = TOK_S_GOALS.get(r.model, {}).get(weights)
        host, host_each = _most({k: c for k, c in r.ffn.items() if k.endswith("+moe")}, "host")
        disp, disp_each = _most({k: c for k, c in r.per_kind.items() if k != "head"}, "dispatches")
        out.append({"model": r.model, "torch": r.release, "weights": weights, "mode": r.mode,
                    "tok/s: central (range)": f"{mid:.1f} ({lo:.1f}-{hi:.1f})",
                    "tok/s goal": "-" if goal is None else f">= {goal}: {_met(mid >= goal)}",
                    "host calls per MoE block": f"{_f(host)} ({host_each})",
                    f"<= {MOE_HOST_CALLS_GOAL}": _met(host <= MOE_HOST_CALLS_GOAL),
                    "dispatches per layer": f"{_f(disp)} ({disp_each})",
                    f"<= {LAYER_DISPATCHES_GOAL}": _met(disp <= LAYER_DISPATCHES_GOAL)})
    if not out:
        return "(the goals are checked on the optimized path: python -m benchmarks decode --optimize)", out
    return markdown(out, list(out[0])), out


SOURCES = """Published figures: torch 2.15 release (anchors.md, "The headline figures"): MoE decode with torch.compile on an M3
Ultra, Qwen3.6-35B-A3B 9.4 (2.14) -> 61.3 (2.15) tokens/s, LFM2.5-8B-A1B 23.6 -> 123.6, bf16, one sequence."""


def models_for(size: str) -> tuple[list[str], tuple[int, ...]]:
    if size == "tiny":
        return ["Qwen3-30B-A3B"], (1,)
    return list(census.MODELS), (1, 4)


def report(size: str = "full", context: int = CONTEXT, transform=None, log=None) -> tuple[str, list[Row]]:
    """The decode benchmark's markdown, and its rows."""
    models, tokens = models_for(size)
    rows = census_rows(models, tokens, context, transform, log=log)
    cal, _ = calibration(rows)
    goal_table, _ = goals(rows)
    notes = "\n".join(f"- {s.name}: {s.source}" for s in census.MODELS.values() if s.name in models)
    text = f"""## decode

Per decode step of `tokens` sequences at a context of {context} tokens each, bf16 weights (the fp8 rows: as
mps_ext.quantize_fp8 leaves them), on a Mac (counted from
transformers {_transformers_version()} model code in tiny configurations with the real layer structure, scaled to the
real configs; benchmarks/census.py says how each figure is counted).

{census_table(rows, context)}

{_rules()}

One sequence, in short:

{summary_table(rows)}

Bytes per step (the real configs' dimensions; activations, KB per layer, left out):

{bytes_table(rows, context)}

Projected tokens/s on an M3 Ultra, central (range): GPU = bytes / bandwidth + dispatches x GPU cost per dispatch;
host = host calls x host cost per call. Constants (published measurements, anchors.md):
{census.constants_text()}

{projection_table(rows)}

Calibration, stock torch with torch.compile against its published decode speed. Implied GPU us per dispatch: the
cost at which the GPU side (central bandwidth) takes the measured step time; the figures of torch
{census.CALIBRATION_RELEASE} fit the projection's central, and each is predicted from the others' implied cost
(cross-validation). Host us per call, at most: the most the measured time allows (without syncs the host side
hides behind the GPU, so the figure bounds it and does not fix it; with syncs host and GPU add, other constants
central; "GPU-bound": the GPU side alone is slower). torch <= 2.14's steps sync (its
_grouped_mm fallback) and its per-expert mm calls of experts no token chose are not costed: not fitted, which its
rows show:

{cal}

Goals (issue 19), on the optimized path, one sequence: projected tokens/s (central, range) against the goal of the
model's class, host calls per MoE block (router to combine, shared expert included) and dispatches per decoder layer
(the most of any layer kind; attention included):

{goal_table}

{SOURCES}

Models:
{notes}
"""
    return text, rows


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
