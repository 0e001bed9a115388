"""A Gated DeltaNet decode step (torch.ops.mps_ext.linear_attention_decode,
the linear_attention family): one dispatch between a linear-attention
layer's projections, Qwen3.5/3.6's shapes; and its prefill core
(torch.ops.mps_ext.linear_attention_chunk: the chunked delta rule, two
dispatches); the cases of `python -m benchmarks linear_attention`.

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


def prefill(model: DeltaNet, tokens: int, dtype, initial: bool = True) -> Prepared:
    """The chunked delta rule of a prompt of `tokens` (linear_attention_chunk:
    the chunk-parallel prep, then the state pass), q, k, v laid out as the
    layer passes them (a transposed view of its convolution's output)."""
    g = torch.Generator().manual_seed(tokens)
    kd, vd = model.k_heads * model.dk, model.v_heads * model.dv
    mixed = torch.randn(1, 2 * kd + vd, tokens, generator=g).to(dtype).transpose(1, 2)
    q, k, v = torch.split(mixed, [kd, kd, vd], dim=-1)
    q, k = q.reshape(1, tokens, model.k_heads, model.dk), k.reshape(1, tokens, model.k_heads, model.dk)
    v = v.reshape(1, tokens, model.v_heads, model.dv)
    gate = -torch.rand(1, tokens, model.v_heads, generator=g)
    beta = torch.rand(1, tokens, model.v_heads, generator=g).to(dtype)
    state = torch.randn(1, model.v_heads, model.dk, model.dv, generator=g) if initial else None

    def run():
        torch.ops.mps_ext.linear_attention_chunk(q, k, v, gate, beta, state, True)
    # The inputs read once, the state read (if given) and written once, the output written once: the float32
    # scratch between the two dispatches is above this minimum.
    minimum = (mixed.nbytes + gate.nbytes + beta.nbytes + (2 if initial else 1) * 4 * model.v_heads * model.dk
               * model.dv + tokens * vd * mixed.element_size())
    return Prepared(run, minimum)


# The prefill kernels at Qwen3.6's head sizes with 4 value heads of its 32 (the executor's cost grows with the
# heads; each head's work is the same): what the budgets measure.
PREFILL_BUDGET = DeltaNet("Qwen3.6 heads 2+4", 2, 4, 128, 128, 4)


def cases(size: str) -> list[Case]:
    out = []

    def add(model, tokens, dtype):
        labels = {"case": "deltanet", "model": model.name, "activation": str(dtype)[6:], "tokens": str(tokens)}
        out.append(Case("linear_attention", f"deltanet {model.name} {labels['activation']} tokens={tokens}", labels,
                        lambda: deltanet(model, tokens, dtype)))

    def add_prefill(model, tokens, dtype):
        labels = {"case": "prefill", "model": model.name, "activation": str(dtype)[6:], "tokens": str(tokens)}
        out.append(Case("linear_attention", f"prefill {model.name} {labels['activation']} tokens={tokens}", labels,
                        lambda: prefill(model, tokens, dtype)))

    if size == "tiny":
        add(DeltaNet("tiny", 2, 4, 32, 16, 4), 1, torch.bfloat16)
        add_prefill(DeltaNet("tiny", 2, 4, 32, 16, 4), 70, torch.bfloat16)
        return out
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        add(DELTANET, 1, dtype)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        add_prefill(PREFILL_BUDGET, 128, dtype)
    if size == "full":
        add_prefill(DELTANET, 512, torch.bfloat16)
    return out


if __name__ == "__main__":
    run_as_script("linear_attention")
