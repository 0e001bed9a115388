"""What a decoded token costs on a Mac, counted from real model code, and
the tokens/s that follows (benchmarks/census.py says how each figure is
counted).

    python -m benchmarks decode [--quick | --tiny] [--context N] [--optimize]

Per model (Qwen3-30B-A3B, Qwen3.6-35B-A3B, LFM2.5-8B-A1B, bf16), per decode
step of 1 and 4 sequences (one new token each) at a stated context, per
torch release (2.14, 2.15), stock torch and with mps_ext, eager and
torch.compile: host calls, Metal dispatches, syncs and bytes per token, per
layer kind and for the whole model, and the projected tokens/s on an M3
Ultra with its range. The same projection of stock torch 2.15 (compiled)
is set beside the published measurements (calibration).
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

OURS = "mps_ext"
CONTEXT = 4096  # tokens of context each sequence has when the step runs (KV cache and states)


@dataclasses.dataclass
class Row:
    model: str
    tokens: int
    release: str
    mode: str
    who: str                 # "stock" or "mps_ext"
    counts: census.Counts    # per step, whole model
    per_kind: dict           # layer kind -> Counts (one layer)
    layers: dict             # layer kind -> layers of that kind
    bytes: dict              # census.step_bytes
    tok_s: tuple[float, float, float]  # low, central, high
    calibrated: float                  # with census.CALIBRATED

    def per_token(self, x: float) -> float:
        return x / self.tokens


def census_rows(models: list[str], tokens: tuple[int, ...], context: int = CONTEXT, transform=None,
                releases=census.RELEASES, modes=census.MODES, log=None) -> list[Row]:
    """Every (model, tokens, release, mode, stock / mps_ext) row: one stock
    trace per (model, tokens) serves both releases; one mps_ext trace per
    release (its policy decides which calls run mps_ext's kernels)."""
    rows = []
    for name in models:
        spec = census.MODELS[name]
        model = census.tiny_model(spec)
        real = spec.config()
        for t in tokens:
            start = time.perf_counter()
            stock = census.trace_step(model, t)
            ours = {r: census.trace_step(model, t, torch_release=r, transform=transform) for r in releases}
            if log:
                log(f"  decode {name} tokens={t}: traced in {time.perf_counter() - start:.1f} s")
            nbytes = census.step_bytes(real, t, context)
            for release in releases:
                for mode in modes:
                    for who, trace in (("stock", stock), (OURS if transform is None else OURS + " + optimize",
                                                          ours[release])):
                        s = census.scale(spec, trace, model.config, t, release, mode, who == "mps_ext")
                        tok_s = tuple(census.project(nbytes["total"], s["total"], t, w)
                                      for w in ("low", "central", "high"))
                        rows.append(Row(name, t, release, mode, who, s["total"], s["per_kind"], s["layers"],
                                        nbytes, tok_s, census.project(nbytes["total"], s["total"], t, "calibrated")))
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
                f"{k}: {census.layer_bytes(real, k, r.tokens, context)['total'] / r.tokens / 1e6:,.1f}"
                for k in kinds),
        })
    return markdown(out, list(out[0]))


def bytes_table(rows: list[Row], context: int) -> str:
    seen, out = set(), []
    for r in rows:
        if (r.model, r.tokens) in seen:
            continue
        seen.add((r.model, r.tokens))
        b = r.bytes
        out.append({"model": r.model, "tokens": r.tokens, "weights MB": f"{b['weights'] / 1e6:,.0f}",
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
                    "calibrated": f"{r.calibrated:.1f}",
                    "published": _published(r)})
    return markdown(out, list(out[0]))


def summary_table(rows: list[Row]) -> str:
    """README's table: one sequence, per model, release and stock / mps_ext:
    eager and compiled host calls, dispatches, bytes and tokens/s."""
    keyed = {(r.model, r.release, r.who, r.mode): r for r in rows if r.tokens == 1}
    out = []
    for (model, release, who, mode), r in keyed.items():
        if mode != "compile":
            continue
        e = keyed[(model, release, who, "eager")]
        lo, mid, hi = r.tok_s
        pub = census.MODELS[model].published.get(release) if who == "stock" else None
        out.append({"model": model, "torch": release, "": who,
                    "host calls / token (eager; compiled)": f"{_f(e.counts.host)}; {_f(r.counts.host)}",
                    "dispatches / token (eager; compiled)": f"{_f(e.counts.dispatches)}; {_f(r.counts.dispatches)}",
                    "syncs": _f(r.counts.syncs), "GB / token": f"{r.bytes['total'] / 1e9:.2f}",
                    "tok/s compiled: central (range); calibrated": f"{mid:.0f} ({lo:.0f}-{hi:.0f}); {r.calibrated:.0f}",
                    "measured": "" if pub is None else str(pub)})
    return markdown(out, list(out[0]))


def _published(r: Row) -> str:
    if r.who != "stock" or r.tokens != 1 or r.mode != "compile":
        return ""
    v = census.MODELS[r.model].published.get(r.release)
    return "" if v is None else f"{v} (measured, torch.compile)"


def calibration(rows: list[Row]) -> tuple[str, list[dict]]:
    """Stock torch compiled, 1 token, against the published measurements."""
    out = []
    for r in rows:
        v = _published(r)
        if not v:
            continue
        measured = census.MODELS[r.model].published[r.release]
        lo, mid, hi = r.tok_s
        out.append({"model": r.model, "torch": r.release, "published tok/s": measured,
                    "projected tok/s": f"{mid:.1f} ({lo:.1f}-{hi:.1f})",
                    "projected / published": f"{mid / measured:.2f}",
                    "within 15%": "yes" if abs(mid / measured - 1) <= 0.15 else "no",
                    "calibrated tok/s": f"{r.calibrated:.1f}",
                    "calibrated / published": f"{r.calibrated / measured:.2f}",
                    "implied GPU us per dispatch": _us(
                        census.implied_dispatch_cost(r.bytes["total"], r.counts, r.tokens, measured)),
                    "implied host us per call": _us(
                        census.implied_host_cost(r.bytes["total"], r.counts, r.tokens, measured), "GPU-bound")})
    return (markdown(out, list(out[0])) if out else "(no published figure for these rows)"), out


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
    notes = "\n".join(f"- {s.name}: {s.source}" for s in census.MODELS.values() if s.name in models)
    text = f"""## decode

Per decode step of `tokens` sequences at a context of {context} tokens each, bf16 weights, on a Mac (counted from
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

Calibration, stock torch with torch.compile against its published decode speed. implied: the GPU cost per dispatch
(central bandwidth) and the host cost per call (other constants central) at which the projection reproduces the
measurement ("GPU-bound": the GPU side alone is slower). torch <= 2.14's per-expert mm calls of experts no token
chose are not costed, which its rows show:

{cal}

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
