"""Mixture-of-experts decode: one synthetic MoE layer per model, with the real
shapes of Qwen3-30B-A3B, Qwen3.5/3.6-35B-A3B and LFM2-8B-A1B, for 1, 2, 4 and
8 tokens, bfloat16 and fp8 (e4m3fn) expert weights. From the CPU Metal
executor's counters it prints per layer the dispatches, the expert weight
bytes read over the chosen experts' size, the device bytes over the minimum,
the gate/up threadgroups. (Whole-model decode speed is projected from a
census of real model code: `python -m benchmarks decode`.) On a Mac it also times stock torch's MoE layer (F.grouped_mm)
against mps_ext's fused one.

    python -m benchmarks moe [--quick | --tiny]
    python benchmarks/bench_moe.py [--quick | --tiny]   (the same)

The layer, as mps_ext runs it (torch.ops.mps_ext.moe_layer: 4 dispatches,
nothing read on the host):
    logits = F.linear(x, router)                    router GEMV (mps_ext linear)
    moe_route(logits, top_k)                        softmax, top-k, sort by expert, offsets
    h = moe_experts(x, W_gate_up, ..., swiglu=True) gather + gate/up + silu(gate) * up
    out = moe_down_combine(h, W_down, weights, ...) down projection and each token's weighted sum
The shared expert (Qwen3.5/3.6) is expert E of the banks, chosen by every
token with weight sigmoid(router row E). The same expert products are what
F.grouped_mm runs (one dispatch each, no host sync) for model code that
routes with torch ops.

Expert banks are zeros (the counters do not depend on values, and zeros cost
nothing to create); the router weights are random, so routing is.

Besides the layers, the grouped products themselves (F.grouped_mm,
_scaled_grouped_mm, moe_experts) at a Qwen3-30B-A3B expert's down projection
(K = 768 -> N = 2048, 8 experts): decode (64 routed rows) in both weight
layouts, prefill tiles (128 rows), and operands 16-byte misaligned (the
element-load kernels), so that every grouped_mm kernel is measured; they run
on 256 of the 2048 output columns and count for 8 times that.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import Case, Prepared, run_as_script  # noqa: E402

@dataclasses.dataclass
class Model:
    name: str
    hidden: int
    experts: int
    top_k: int
    shared: int          # shared experts (one, of the routed experts' shape, or none)
    ffn: int             # expert FFN width


# One MoE layer's shapes (benchmarks/census.py has the whole models, from their configs).
MODELS = [
    Model("Qwen3-30B-A3B", 2048, 128, 8, 0, 768),
    Model("Qwen3.6-35B-A3B", 2048, 256, 8, 1, 512),
    Model("LFM2-8B-A1B", 2048, 32, 4, 0, 1792),
]


def quantize_rows_zero(shape):
    """fp8 zeros and unit row scales (values do not change the counters)."""
    return torch.zeros(shape, dtype=torch.float8_e4m3fn), torch.ones(shape[:-1])


TINY = Model("tiny", 256, 8, 2, 1, 128)


def layer(model: Model, tokens: int, fp8: bool, dtype=torch.bfloat16, seed: int = 0,
          residual: bool = False) -> Prepared:
    """One MoE layer of `model` for `tokens` tokens, as mps_ext runs it
    (`residual`: with the decoder layer's residual added in its last dispatch)."""
    g = torch.Generator().manual_seed(seed)
    h, e, f = model.hidden, model.experts + model.shared, model.ffn
    x = torch.randn(tokens, h, generator=g).to(dtype)
    router = (torch.randn(model.experts + model.shared, h, generator=g) * h ** -0.5).to(dtype)
    if fp8:
        w_gu, s_gu = quantize_rows_zero((e, 2 * f, h))
        w_d, s_d = quantize_rows_zero((e, h, f))
    else:
        w_gu, s_gu = torch.zeros(e, 2 * f, h, dtype=dtype), None
        w_d, s_d = torch.zeros(e, h, f, dtype=dtype), None
    slots = model.top_k + model.shared
    ops = torch.ops.mps_ext
    out = {}
    res = torch.randn(tokens, h, generator=g).to(dtype) if residual else None

    def run():
        out["out"] = ops.moe_layer(x, router, w_gu, s_gu, w_d, s_d, model.top_k, True, bool(model.shared),
                                   residual=res)

    def measures(stats):
        """The layer's figures: from the dispatches and what the run returned."""
        if len(stats) == 3:  # torch's own one-row GEMV took the router (torch >= 2.15): count it
            router_read, extra_dispatch = router.nbytes, 1
        else:
            router_read, extra_dispatch = stats[0].bytes_read[stats[0].buffer("w")], 0
        gate_up, down = stats[-2], stats[-1]
        # The experts the router chose (the layer's routing, again, outside the measured run).
        if "offs" not in out:
            out["offs"] = ops.moe_route(F.linear(x, router), model.top_k, True, bool(model.shared))[1]
        offs = out["offs"]
        chosen = int((torch.diff(offs.long(), prepend=torch.zeros(1).long()) > 0).sum())
        expert_bytes = w_gu[0].nbytes + w_d[0].nbytes
        scale_bytes = (s_gu[0].nbytes + s_d[0].nbytes) if fp8 else 0
        weight_read = gate_up.bytes_read[gate_up.buffer("w")] + down.bytes_read[down.buffer("w")]
        # DRAM model: weights as read; every activation-sized tensor once at
        # its size (re-reads by many threadgroups hit the GPU's caches; they
        # are KB): x, the logits, weights, offs, the two slot maps, h and out.
        rows = tokens * slots
        small = (x.nbytes + tokens * e * x.element_size() + rows * 4 + offs.nbytes + 2 * rows * 4
                 + rows * f * x.element_size() + out["out"].nbytes + (res.nbytes if residual else 0))
        dram = weight_read + router_read + chosen * scale_bytes + 2 * small
        return {
            "chosen": chosen,
            "dispatches": len(stats) + extra_dispatch,
            "extra": router.nbytes * extra_dispatch,
            "weight_ratio": weight_read / (chosen * expert_bytes),
            "dram": dram,
            "minimum": chosen * (expert_bytes + scale_bytes) + router.nbytes,
            "gate_up_tgs": gate_up.total_threadgroups,
        }

    def extras(stats):
        r = measures(stats)
        row = {"chosen": r["chosen"], "weight read / chosen": f"{r['weight_ratio']:.3f}",
               "DRAM model / min": f"{r['dram'] / r['minimum']:.3f}", "gate/up threadgroups": r["gate_up_tgs"],
               "layer MB": f"{r['dram'] / 1e6:.1f}"}
        return row

    def mac():
        return stock_layer_fn(model, tokens)

    return Prepared(run, lambda stats: measures(stats)["minimum"], None if fp8 else mac, extras,
                    dram_bytes=lambda stats: measures(stats)["dram"])


def stock_layer_fn(model: Model, tokens: int, device: str = "mps"):
    """A MoE layer as model code writes it with torch ops and F.grouped_mm (for Mac timing)."""
    h, e, f = model.hidden, model.experts + model.shared, model.ffn
    x = torch.randn(tokens, h, device=device, dtype=torch.bfloat16)
    router = torch.randn(e, h, device=device, dtype=torch.bfloat16) * h ** -0.5
    w_gu = torch.randn(e, 2 * f, h, device=device, dtype=torch.bfloat16) * h ** -0.5
    w_d = torch.randn(e, h, f, device=device, dtype=torch.bfloat16) * f ** -0.5

    def stock():
        probs = torch.softmax(F.linear(x, router)[:, :model.experts].float(), -1)
        w, ids = torch.topk(probs, model.top_k, -1)
        w = w / w.sum(-1, keepdim=True)
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        offs = torch.histc(flat.float(), bins=model.experts, min=0, max=model.experts - 1).cumsum(0).int()
        xs = x[order // model.top_k]
        gu = F.grouped_mm(xs, w_gu[:model.experts].transpose(-2, -1), offs=offs)
        g, u = gu.chunk(2, -1)
        ys = F.grouped_mm(F.silu(g) * u, w_d[:model.experts].transpose(-2, -1), offs=offs)
        out = torch.zeros_like(x).index_add_(0, order // model.top_k, ys * w.flatten()[order, None].to(ys.dtype))
        return out

    def ours():
        return torch.ops.mps_ext.moe_layer(x, router, w_gu, None, w_d, None, model.top_k, True, bool(model.shared))

    return stock, ours


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


SAMPLE_N = 256  # output columns the grouped products run on (of N)


def grouped(kind, dtype, rows, k, n, experts, layout, misaligned=0) -> Prepared:
    """One grouped product of `rows` rows spread evenly over `experts`
    experts of [N, K] (layout "nk": F.grouped_mm's W[E, N, K] transposed;
    "kn": W[E, K, N] stored as is). kind "_grouped_mm"; "_scaled_grouped_mm"
    (fp8 operands, row-wise scales); "moe_experts" (bf16 rows, fp8 weights).
    It runs on SAMPLE_N of the N output columns and counts for N / SAMPLE_N
    times that: the kernels split N evenly over threadgroups, each doing the
    same work."""
    g = torch.Generator().manual_seed(rows + k + n)
    counts = [rows // experts + (1 if i < rows % experts else 0) for i in range(experts)]
    offs = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    act = torch.float8_e4m3fn if kind == "_scaled_grouped_mm" else dtype
    a = torch.randn(rows * k + misaligned, generator=g).to(act)[misaligned:].view(rows, k)
    m = SAMPLE_N
    ops = torch.ops.mps_ext
    if kind == "_grouped_mm":
        shape = (experts, m, k) if layout == "nk" else (experts, k, m)
        w = torch.randn(experts * m * k + misaligned, generator=g).to(dtype)[misaligned:].view(shape)
        b = w.transpose(-2, -1) if layout == "nk" else w
        run = lambda: ops._grouped_mm(a, b, offs)  # noqa: E731
        minimum = a.nbytes + experts * n * k * a.element_size() + rows * n * a.element_size()
    elif kind == "_scaled_grouped_mm":
        w, sa, sb = torch.randn(experts, m, k, generator=g).to(act), torch.ones(rows), torch.ones(experts, m)
        run = lambda: ops._scaled_grouped_mm(a, w.transpose(-2, -1), sa, sb, offs)  # noqa: E731
        minimum = a.nbytes + experts * n * k + sa.nbytes + experts * n * 4 + rows * n * 2
    else:
        w, scale = quantize_rows_zero((experts, m, k))
        run = lambda: ops.moe_experts(a, w, scale, offs, None, 1, False)  # noqa: E731
        minimum = a.nbytes + experts * n * k + experts * n * 4 + rows * n * a.element_size()
    return Prepared(run, minimum, scale=n / m)


EXPERT_DOWN = (768, 2048)  # Qwen3-30B-A3B: an expert's down projection, K -> N


def layer_case(model: Model, tokens: int, fp8: bool, dtype=torch.bfloat16, residual: bool = False) -> Case:
    labels = {"case": "layer", "model": model.name, "experts": "fp8" if fp8 else str(dtype)[6:],
              "activation": str(dtype)[6:], "tokens / rows": str(tokens), "weight": ""}
    id_ = f"layer {model.name} {labels['experts']} tokens={tokens}" + (
        f" {labels['activation']}" if dtype != torch.bfloat16 else "") + (" residual" if residual else "")
    return Case("moe", id_, labels, lambda: layer(model, tokens, fp8, dtype, residual=residual))


def cases(size: str) -> list[Case]:
    out = []

    def add_layer(model, tokens, fp8, dtype=torch.bfloat16):
        out.append(layer_case(model, tokens, fp8, dtype))

    def add_grouped(kind, dtype, rows, layout, misaligned=0):
        k, n = EXPERT_DOWN
        labels = {"case": kind, "model": f"Qwen3-30B-A3B expert down {k}->{n}, 8 experts",
                  "experts": "fp8" if kind != "_grouped_mm" else str(dtype)[6:],
                  "activation": "float8_e4m3fn" if kind == "_scaled_grouped_mm" else str(dtype)[6:],
                  "tokens / rows": str(rows), "weight": f"[E,{layout.upper()}]" + (" misaligned" if misaligned else "")}
        id_ = f"{kind} {labels['experts']} {labels['activation']} rows={rows} {layout}" + (
            " misaligned" if misaligned else "")
        out.append(Case("moe", id_, labels, lambda: grouped(kind, dtype, rows, k, n, 8, layout, misaligned)))

    def add_deltanet(model, tokens, dtype):
        labels = {"case": "deltanet", "model": model.name, "experts": "", "activation": str(dtype)[6:],
                  "tokens / rows": str(tokens), "weight": ""}
        out.append(Case("moe", f"deltanet {model.name} {labels['activation']} tokens={tokens}", labels,
                        lambda: deltanet(model, tokens, dtype)))

    def add_short_conv(model, tokens, dtype):
        labels = {"case": "shortconv", "model": model.name, "experts": "", "activation": str(dtype)[6:],
                  "tokens / rows": str(tokens), "weight": ""}
        out.append(Case("moe", f"shortconv {model.name} {labels['activation']} tokens={tokens}", labels,
                        lambda: short_conv(model, tokens, dtype)))

    if size == "tiny":
        add_layer(TINY, 2, False)
        add_layer(TINY, 2, True)
        add_deltanet(DeltaNet("tiny", 2, 4, 32, 16, 4), 1, torch.bfloat16)
        return out
    for model in MODELS:
        for fp8 in (False, True):
            for tokens in (1, 2, 4, 8) if size == "full" else (1, 8):
                add_layer(model, tokens, fp8)
    for dtype in (torch.float32, torch.float16):  # the route and combine kernels of other activation dtypes
        add_layer(MODELS[0], 1, False, dtype)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for layout in ("nk", "kn"):
            add_grouped("_grouped_mm", dtype, 64, layout)
            add_grouped("_grouped_mm", dtype, 64, layout, misaligned=1)
        add_grouped("_grouped_mm", dtype, 128, "nk")
    add_grouped("_scaled_grouped_mm", None, 64, "nk")
    add_grouped("_scaled_grouped_mm", None, 64, "nk", misaligned=1)
    add_grouped("_scaled_grouped_mm", None, 128, "nk")
    add_grouped("moe_experts", torch.bfloat16, 64, "nk", misaligned=1)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        add_deltanet(DELTANET, 1, dtype)
        add_short_conv(SHORT_CONV, 1, dtype)
    return out


def notes() -> str:
    return """chosen: distinct experts the layer's tokens chose (routed and shared). weight read / chosen: expert weight bytes
the two expert kernels read over (chosen experts x one expert's gate/up + down bytes); never an idle expert's. bytes / min
(the layers): every byte any dispatch read or wrote over the minimum, the chosen experts' weights (and fp8 row scales)
and the router once; activation rows re-read by each threadgroup count every time. DRAM model / min: the weights as
read, plus every activation-sized tensor once read and once written (re-reads of KB-sized activations are served by the
GPU's caches): the layer's bytes in us @chip. The grouped products run on 256 of the N output columns, scaled by N / 256.
On a Mac the bf16 layers are timed against stock torch's MoE layer (F.grouped_mm). Whole-model tokens/s: `python -m
benchmarks decode`, which counts the host calls and dispatches of a whole decoded token besides its bytes."""  # noqa: E501


NOTES = notes()


if __name__ == "__main__":
    run_as_script("moe")
