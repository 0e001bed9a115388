"""An LFM2 short-convolution decode step (torch.ops.mps_ext.short_conv_decode,
the short_conv family): one dispatch between a conv layer's projections,
LFM2.5-8B-A1B's shapes; the cases of `python -m benchmarks short_conv`.

    python benchmarks/bench_short_conv.py [--quick | --tiny]   (the same)
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import Case, Prepared, run_as_script  # noqa: E402


@dataclasses.dataclass
class ShortConv:
    """An LFM2 conv layer's decode shapes (benchmarks/census.py has the configs)."""
    name: str
    hidden: int
    conv_k: int


SHORT_CONV = ShortConv("LFM2.5-8B-A1B", 2048, 3)


def short_conv(model: ShortConv, tokens: int, dtype) -> Prepared:
    """The decode step of an LFM2 conv layer between its projections
    (short_conv_decode, one dispatch): what LFM2.5-8B-A1B runs in 18 of its
    24 layers besides the MoE."""
    g = torch.Generator().manual_seed(tokens)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(dtype)
    bcx, conv_state, conv_w = r(tokens, 1, 3 * model.hidden), r(tokens, model.hidden, model.conv_k), \
        r(model.hidden, model.conv_k)

    def run():
        torch.ops.mps_ext.short_conv_decode(bcx, conv_state, conv_w, None)
    # The input and weights read once, the window read and written once, the output written.
    minimum = bcx.nbytes + conv_w.nbytes + 2 * conv_state.nbytes + tokens * model.hidden * bcx.element_size()
    return Prepared(run, minimum)


def cases(size: str) -> list[Case]:
    out = []

    def add(model, tokens, dtype):
        labels = {"case": "shortconv", "model": model.name, "activation": str(dtype)[6:], "tokens": str(tokens)}
        out.append(Case("short_conv", f"shortconv {model.name} {labels['activation']} tokens={tokens}", labels,
                        lambda: short_conv(model, tokens, dtype)))

    if size == "tiny":
        add(ShortConv("tiny", 64, 3), 1, torch.bfloat16)
        return out
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        add(SHORT_CONV, 1, dtype)
    return out


if __name__ == "__main__":
    run_as_script("short_conv")
