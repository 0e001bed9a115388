"""The benchmark's plots, drawn with matplotlib (the `bench` extra of
pyproject.toml: `pip install -e ".[bench]"`).

- ops_chart: per op (its cases summed), the bandwidth limit against mps_ext's
  projected time (and, on a Mac, stock torch's and mps_ext's measured
  times), on a log scale of time.
- decode_chart: per model, projected decode tokens/s on an M3 Ultra, stock
  torch and mps_ext per release, each bar with its range, and the published
  measurements marked.
"""

from __future__ import annotations

from pathlib import Path

# Bar colours, in the legend's order.
SERIES = {
    "bandwidth limit": "#969696",
    "mps_ext projected": "#2864c8",
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
    ax.set_title(f"Per op: the bandwidth limit against mps_ext's traffic, at the {chip}'s bandwidth")
    ax.grid(axis="y", which="major", color="#dddddd")
    ax.set_axisbelow(True)
    ax.legend(loc="upper left", fontsize="small")
    fig.savefig(path, dpi=120)
    plt.close(fig)


def decode_chart(bars: list[dict], path: str | Path) -> None:
    """A PNG at `path`: per model (x), one bar per series (`bars`: dicts
    with model, series, central, low, high and, where there is one,
    published), its range as an error bar; published measurements as
    black marks on the stock bar of their release."""
    plt = _pyplot()
    models = list(dict.fromkeys(b["model"] for b in bars))
    series = list(dict.fromkeys(b["series"] for b in bars))
    colours = plt.get_cmap("tab20").colors
    fig, ax = plt.subplots(figsize=(max(7.0, 2.6 * len(models) + 2), 6), layout="constrained")
    width = 0.8 / len(series)
    marked = False
    for s, name in enumerate(series):
        mine = {b["model"]: b for b in bars if b["series"] == name}
        xs = [m + (s - (len(series) - 1) / 2) * width for m, model in enumerate(models) if model in mine]
        rows = [mine[model] for model in models if model in mine]
        ys = [r["central"] for r in rows]
        err = [[r["central"] - r["low"] for r in rows], [r["high"] - r["central"] for r in rows]]
        ax.bar(xs, ys, width, yerr=err, capsize=3, label=name, color=colours[s % len(colours)])
        for x, r in zip(xs, rows):
            ax.annotate(f"{r['central']:.0f}", (x, r["high"]), ha="center", va="bottom", fontsize=7,
                        xytext=(0, 2), textcoords="offset points")
            if r.get("published"):
                ax.plot([x - width / 2, x + width / 2], [r["published"]] * 2, color="black", linewidth=2,
                        label=None if marked else "published measurement (torch.compile)")
                marked = True
    ax.set_xticks(range(len(models)), models)
    ax.set_ylabel("projected decode tokens/s, one sequence (M3 Ultra)")
    ax.set_title("Decode speed: projected from the census (bars: central; whiskers: range)")
    ax.grid(axis="y", color="#dddddd")
    ax.set_axisbelow(True)
    fig.legend(fontsize="small", ncols=3, loc="outside lower center")
    fig.savefig(path, dpi=120)
    plt.close(fig)
