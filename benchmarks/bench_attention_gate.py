"""The attention layer's output gate (torch.ops.mps_ext.sigmoid_gate, the
attention_gate family): `x * sigmoid(gate)` with the gate read in place from
q_proj's output (Qwen3.5/3.6, Qwen3-Next); the cases of `python -m
benchmarks attention_gate`.

    python benchmarks/bench_attention_gate.py [--quick | --tiny]   (the same)

Its minimum is every element moved once: x and the gate read, the output
written. On a Mac, torch's three calls (a copy of the strided gate, sigmoid,
mul) against the one dispatch.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import Case, Prepared, run_as_script  # noqa: E402

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
GATE_CASES = [  # (tokens, heads, head_dim, dtype, what, sizes)
    (1, 16, 256, BF16, "Qwen3.6-35B-A3B decode: the output gate of 16 heads of 256", ("full", "quick")),
    (1, 8, 128, F16, "a gated attention's decode in fp16", ("full", "quick")),
    (1, 8, 128, F32, "in float32", ("full", "quick")),
    (2, 3, 40, F32, "tiny", ("tiny",)),
]


def prepare_gate(t, h, d, dtype) -> Prepared:
    q = torch.randn(1, t, h, 2 * d).to(dtype)  # q_proj's output: each head's query, then its gate
    gate = q[..., d:]
    x = torch.randn(1, t, h, d).to(dtype)

    def mac():
        qm, xm = q.to("mps"), x.to("mps")
        gm = qm[..., d:]
        return (lambda: xm.reshape(1, t, -1) * torch.sigmoid(gm.reshape(1, t, -1)),
                lambda: torch.ops.mps_ext.sigmoid_gate(xm, gm))

    return Prepared(lambda: torch.ops.mps_ext.sigmoid_gate(x, gate), 3 * x.nbytes, mac)


def cases(size: str) -> list[Case]:
    out = []
    for t, h, d, dtype, what, sizes in GATE_CASES:
        if size not in sizes:
            continue
        labels = {"shape": f"{t}x{h}x{d}", "dtype": str(dtype)[6:], "variant": "", "what": what}
        out.append(Case("attention_gate", f"sigmoid_gate {labels['shape']} {labels['dtype']}", labels,
                        lambda a=(t, h, d, dtype): prepare_gate(*a)))
    return out


if __name__ == "__main__":
    run_as_script("attention_gate")
