"""A Gated DeltaNet decode step (torch.ops.mps_ext.linear_attention_decode,
the linear_attention family): one dispatch between a linear-attention
layer's projections, Qwen3.5/3.6's shapes; the cases of `python -m
benchmarks linear_attention`.

    python benchmarks/bench_linear_attention.py [--quick | --tiny]   (the same)
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
class DeltaNet:
    """A Gated DeltaNet layer's decode shapes (benchmarks/census.py has the configs)."""
    name: str
    k_heads: int
    v_heads: int
    dk: int
    dv: int
    conv_k: int


DELTANET = DeltaNet("Qwen3.6-35B-A3B", 16, 32, 128, 128, 4)


def deltanet(model: DeltaNet, tokens: int, dtype) -> Prepared:
    """The decode step of a linear-attention layer between its projections
    (linear_attention_decode, one dispatch): what the MoE models with Gated
    DeltaNet layers (Qwen3.5/3.6) run besides their MoE layers."""
    g = torch.Generator().manual_seed(tokens)
    conv_dim = 2 * model.k_heads * model.dk + model.v_heads * model.dv
    vd = model.v_heads * model.dv

    def r(*shape):
        return torch.randn(*shape, generator=g).to(dtype)
    qkv, z, b, a = r(tokens, conv_dim), r(tokens, vd), r(tokens, model.v_heads), r(tokens, model.v_heads)
    conv_state, conv_w = r(tokens, conv_dim, model.conv_k), r(conv_dim, model.conv_k)
    state = torch.randn(tokens, model.v_heads, model.dk, model.dv, generator=g)
    a_log, dt_bias, norm_w = r(model.v_heads), r(model.v_heads), r(model.dv)

    def run():
        torch.ops.mps_ext.linear_attention_decode(qkv, z, b, a, conv_state, state, conv_w, a_log, dt_bias, norm_w,
                                                  model.k_heads, 1e-6)
    # Every input read once, both states read and written once, the output written.
    minimum = (sum(t.nbytes for t in (qkv, z, b, a, conv_w, a_log, dt_bias, norm_w)) + 2 * conv_state.nbytes
               + 2 * state.nbytes + tokens * vd * qkv.element_size())
    return Prepared(run, minimum)


def cases(size: str) -> list[Case]:
    out = []

    def add(model, tokens, dtype):
        labels = {"case": "deltanet", "model": model.name, "activation": str(dtype)[6:], "tokens": str(tokens)}
        out.append(Case("linear_attention", f"deltanet {model.name} {labels['activation']} tokens={tokens}", labels,
                        lambda: deltanet(model, tokens, dtype)))

    if size == "tiny":
        add(DeltaNet("tiny", 2, 4, 32, 16, 4), 1, torch.bfloat16)
        return out
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        add(DELTANET, 1, dtype)
    return out


if __name__ == "__main__":
    run_as_script("linear_attention")
