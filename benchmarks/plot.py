"""The benchmark's plots, drawn with matplotlib (the `bench` extra of
pyproject.toml: `pip install -e ".[bench]"`).

- ops_chart: per op (its cases summed), the bandwidth limit against mps_ext's
  cost at that bandwidth (its traffic plus the GPU cost of its dispatches;
  and, on a Mac, stock torch's and mps_ext's measured times), on a log scale
  of time.
- decode_chart: per model, decode tokens/s on an M3 Ultra, one sequence:
  stock torch 2.15 (published), mps_ext's optimized path in bf16 and fp8
  (simulated, with their ranges), the peers' published figures, and the
  byte limits as lines.
- prefill_chart: per model, the time to first token of a prompt on an M3
  Ultra: torch 2.15 stock and mps_ext's optimized path in bf16 and fp8
  (projected, with their ranges), the peers' published prompt rates as that
  prompt's time, and the compute limit as a line.
"""

from __future__ import annotations

from pathlib import Path

# Bar colours, in the legend's order.
SERIES = {
    "bandwidth limit": "#969696",
    "mps_ext: traffic + dispatches": "#2864c8",
    "stock measured": "#d23c32",
    "mps_ext measured": "#28a046",
}


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ImportError("the benchmark plots need matplotlib: pip install -e \".[bench]\" (or --png '' to skip "
                          "the plot)") from None
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    return plt


def ops_chart(groups: list[dict[str, float]], ops: list[str], path: str | Path, chip: str) -> None:
    """A PNG at `path`: one group of bars per op (values in us by the names
    of SERIES; a missing series leaves a gap), log scale of time."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6.0, 1.4 * len(ops) + 2), 4.5), layout="constrained")
    width = 0.8 / len(SERIES)
    for s, (name, colour) in enumerate(SERIES.items()):
        xs = [i + (s - (len(SERIES) - 1) / 2) * width for i, g in enumerate(groups) if g.get(name, 0) > 0]
        ys = [g[name] for g in groups if g.get(name, 0) > 0]
        if ys:
            ax.bar(xs, ys, width, label=name, color=colour)
    ax.set_yscale("log")
    ax.set_xticks(range(len(ops)), ops)
    ax.set_ylabel("us per op (the sum of its cases)")
    ax.set_title(f"Per op: bandwidth limit and mps_ext's cost\n(at the {chip}'s bandwidth)", fontsize="medium")
    ax.grid(axis="y", which="major", color="#dddddd")
    ax.set_axisbelow(True)
    ax.legend(loc="upper left", fontsize="small")
    fig.savefig(path, dpi=120)
    plt.close(fig)


# decode_chart's colours by kind of bar; peers take the greens in turn.
_DECODE_COLOURS = {"published": "#b4504b", "stock": "#b4504b", "ours": ("#2864c8", "#143c8c"),
                   "peer": ("#46a05a", "#82c36e", "#2d7841")}


def decode_chart(bars: list[dict], path: str | Path) -> None:
    """A PNG at `path`: decode tokens/s per model (model_chart)."""
    model_chart(bars, path, "decode tokens/s, one sequence (M3 Ultra unless named)",
                "Decode: stock torch and peers (published), mps_ext (simulated), byte limits", "{:.0f}")


def prefill_chart(bars: list[dict], path: str | Path, length: int) -> None:
    """A PNG at `path`: time to first token per model (model_chart)."""
    model_chart(bars, path, "seconds to first token",
                f"Prefill of a {length}-token prompt, M3 Ultra unless named: torch 2.15 and mps_ext (projected), "
                "peers (published), compute limit", "{:.2f}")


def model_chart(bars: list[dict], path: str | Path, ylabel: str, title: str, fmt: str) -> None:
    """A PNG at `path`: per model (x), a bar per entry of `bars` (dicts with
    model, series, kind and central; 'ours', 'stock' (projected stock
    torch) and 'peer' optionally low and high, drawn as whiskers) except kind 'limit', drawn as a dashed line
    across the model's bars; each bar labelled with its value (`fmt`)."""
    plt = _pyplot()
    models = list(dict.fromkeys(b["model"] for b in bars))
    fig, ax = plt.subplots(figsize=(max(7.0, 3.2 * len(models) + 1.5), 5.5), layout="constrained")
    width, drawn = 0.16, set()
    for m, model in enumerate(models):
        mine = [b for b in bars if b["model"] == model and b["kind"] != "limit"]
        left = m - width * (len(mine) - 1) / 2
        counters = {"ours": 0, "peer": 0}
        for i, b in enumerate(mine):
            x = left + i * width
            colour = _DECODE_COLOURS[b["kind"]]
            if isinstance(colour, tuple):
                colour = colour[counters[b["kind"]] % len(colour)]
                counters[b["kind"]] += 1
            label = b["series"] if b["series"] not in drawn else None
            drawn.add(b["series"])
            err = None
            if b["kind"] in ("ours", "stock", "peer") and b.get("high", 0) > b.get("low", 0):
                err = [[b["central"] - b["low"]], [b["high"] - b["central"]]]
            ax.bar([x], [b["central"]], width * 0.92, yerr=err, capsize=3, color=colour, label=label)
            ax.annotate(fmt.format(b["central"]), (x, b.get("high", b["central"])), ha="center", va="bottom",
                        fontsize=7, xytext=(0, 2), textcoords="offset points")
        span = (left - width / 2, left + width * (len(mine) - 0.5))
        for b in bars:
            if b["model"] == model and b["kind"] == "limit":
                style = "--" if "bf16" in b["series"] else ":"
                ax.plot(span, [b["central"]] * 2, style, color="black", linewidth=1.2,
                        label=b["series"] if b["series"] not in drawn else None)
                drawn.add(b["series"])
                ax.annotate(fmt.format(b["central"]), (span[1], b["central"]), ha="left", va="center", fontsize=7,
                            xytext=(2, 0), textcoords="offset points")
    ax.set_xticks(range(len(models)), models)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize="medium")
    ax.grid(axis="y", color="#dddddd")
    ax.set_axisbelow(True)
    fig.legend(fontsize="small", ncols=3, loc="outside lower center")
    fig.savefig(path, dpi=120)
    plt.close(fig)
