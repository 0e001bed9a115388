"""Mixture-of-experts decode: one synthetic MoE layer per model, with the real
shapes of Qwen3-30B-A3B, Qwen3.5/3.6-35B-A3B and LFM2-8B-A1B, for 1, 2, 4 and
8 tokens, bfloat16 and fp8 (e4m3fn) expert weights. From the CPU Metal
executor's counters it prints per layer the dispatches, the expert weight
bytes read over the chosen experts' size, the device bytes over the minimum,
the gate/up threadgroups, and a projected whole-model tokens/s on an M3 Ultra
and an M4 Max. On a Mac it also times stock torch's MoE layer (F.grouped_mm)
against mps_ext's fused one.

    python benchmarks/bench_moe.py [--tokens 1,8] [--models qwen3.6]

The layer, as mps_ext runs it (5 dispatches, nothing read on the host):
    logits = F.linear(x, router)                    router GEMV (mps_ext linear)
    moe_route(logits, top_k)                        softmax, top-k, sort by expert, offsets
    h = moe_experts(x, W_gate_up, ..., swiglu=True) gather + gate/up + silu(gate) * up
    y = moe_experts(h, W_down, ...)                 down projection
    out = moe_combine(y, weights, ...)              weighted sum per token
The shared expert (Qwen3.5/3.6) is expert E of the banks, chosen by every
token with weight sigmoid(router row E). The same expert products are what
F.grouped_mm runs (one dispatch each, no host sync) for model code that
routes with torch ops.

Expert banks are zeros (the counters do not depend on values, and zeros cost
nothing to create); the router weights are random, so routing is.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch
import torch.nn.functional as F

import mps_ext  # noqa: F401
from common import mac_times, table
from mps_ext import cpu_metal

DISPATCH_SECONDS = 4e-6
CHIPS = {"M3 Ultra": 819e9, "M4 Max": 546e9}  # bytes/s (anchors.md)
TORCH_215 = {"Qwen3.6-35B-A3B": 61.3, "LFM2-8B-A1B": 123.6}  # tokens/s, M3 Ultra, torch.compile (anchors.md)


@dataclasses.dataclass
class Model:
    name: str
    hidden: int
    layers: int
    moe_layers: int
    experts: int
    top_k: int
    shared: int          # shared experts (one, of the routed experts' shape, or none)
    ffn: int             # expert FFN width
    vocab: int
    mixer_params: int    # attention (or linear-attention / conv) weights of all layers
    dense_ffn_params: int  # FFN weights of the layers that are not MoE
    note: str


def _attention(hidden, q_heads, kv_heads, head_dim, gate=False):
    q = q_heads * head_dim * (2 if gate else 1)
    return hidden * (q + 2 * kv_heads * head_dim) + q_heads * head_dim * hidden


MODELS = [
    # anchors.md: hidden 2048, 48 layers, 128 experts, top-8, FFN 768, 32 q / 4 KV heads of 128, vocab 151936.
    Model("Qwen3-30B-A3B", 2048, 48, 48, 128, 8, 0, 768, 151936, 48 * _attention(2048, 32, 4, 128), 0,
          "attention from anchors.md (32 q / 4 KV heads of 128)"),
    # anchors.md: hidden 2048, 40 layers, 256 experts, top-8 + 1 shared, FFN 512, vocab 248320. Not in
    # anchors.md (public config, assumed): 30 Gated DeltaNet layers (in_proj 2048 -> 12288 + 64,
    # out_proj 4096 -> 2048) and 10 gated attention layers (16 q heads of 256 with gate, 2 KV heads).
    Model("Qwen3.6-35B-A3B", 2048, 40, 40, 256, 8, 1, 512, 248320,
          30 * (2048 * (12288 + 64) + 4096 * 2048) + 10 * _attention(2048, 16, 2, 256, gate=True), 0,
          "mixers assumed: 30 Gated DeltaNet + 10 gated attention layers"),
    # anchors.md: hidden 2048, 24 layers (2 dense, FFN 7168), 32 experts, top-4, FFN 1792, 32 q / 8 KV
    # heads, vocab 65536. Not in anchors.md (assumed): 6 attention layers (heads of 64) and 18 short-conv
    # layers (in_proj 2048 -> 6144, out_proj 2048 -> 2048); tied embedding read once as the LM head.
    Model("LFM2-8B-A1B", 2048, 24, 22, 32, 4, 0, 1792, 65536,
          6 * _attention(2048, 32, 8, 64) + 18 * (2048 * 6144 + 2048 * 2048), 2 * 3 * 2048 * 7168,
          "mixers assumed: 6 attention + 18 short-conv layers"),
]

# Dispatches per layer outside the MoE block (norms, the mixer's projections
# and kernel, residual adds), and for the final norm + LM head: an
# assumption, not a measurement; the second tokens/s column leaves them out.
DENSE_DISPATCHES_PER_LAYER = 6
HEAD_DISPATCHES = 2


def dense_bytes(model: Model, weight_bytes: float, head_bytes: float | None = None) -> float:
    """Weights read once per decode step outside the MoE layers' routed and
    shared experts: mixers, dense FFN layers, LM head (`head_bytes` per
    weight, default `weight_bytes`); bf16 router (measured with the layer).
    fp8 models: every linear weight fp8, unless the head is kept bf16 (what
    mps_ext.quantize_fp8 does by default)."""
    head = model.vocab * model.hidden * (weight_bytes if head_bytes is None else head_bytes)
    return (model.mixer_params + model.dense_ffn_params) * weight_bytes + head


def project(model: Model, layer_bytes: int, layer_dispatches: int, tokens: int, weight_bytes: float,
            bandwidth: float, dense_dispatches: bool, head_bytes: float | None = None) -> float:
    """Tokens/s of a decode step of `tokens` tokens: the MoE layers' measured
    bytes plus the dense weights, over the bandwidth, plus 4 us per dispatch.
    Assumes weights stream at the full bandwidth (no cache reuse across
    steps), ignores the KV cache and activations outside the MoE layers
    (short contexts) and the time kernels overlap."""
    seconds = (model.moe_layers * layer_bytes + dense_bytes(model, weight_bytes, head_bytes)) / bandwidth
    dispatches = model.moe_layers * layer_dispatches
    if dense_dispatches:
        dispatches += model.layers * DENSE_DISPATCHES_PER_LAYER + HEAD_DISPATCHES
    return tokens / (seconds + dispatches * DISPATCH_SECONDS)


def quantize_rows_zero(shape):
    """fp8 zeros and unit row scales (values do not change the counters)."""
    return torch.zeros(shape, dtype=torch.float8_e4m3fn), torch.ones(shape[:-1])


def layer(model: Model, tokens: int, fp8: bool, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    h, e, f = model.hidden, model.experts + model.shared, model.ffn
    x = torch.randn(tokens, h, generator=g).bfloat16()
    router = (torch.randn(model.experts + model.shared, h, generator=g) * h ** -0.5).bfloat16()
    if fp8:
        w_gu, s_gu = quantize_rows_zero((e, 2 * f, h))
        w_d, s_d = quantize_rows_zero((e, h, f))
    else:
        w_gu, s_gu = torch.zeros(e, 2 * f, h, dtype=torch.bfloat16), None
        w_d, s_d = torch.zeros(e, h, f, dtype=torch.bfloat16), None
    slots = model.top_k + model.shared
    ops = torch.ops.mps_ext
    with cpu_metal.record() as rec:
        logits = ops.linear(x, router, None)
        weights, offs, slot_of_row, row_of_slot = ops.moe_route(logits, model.top_k, True, bool(model.shared))
        hid = ops.moe_experts(x, w_gu, s_gu, offs, slot_of_row, slots, True)
        y = ops.moe_experts(hid, w_d, s_d, offs, None, 1, False)
        out = ops.moe_combine(y, weights, row_of_slot)
    if len(rec.dispatches) == 4:  # torch's own one-row GEMV took the router (torch >= 2.15): count it
        router_read, extra_dispatch = router.nbytes, 1
    else:
        router_read, extra_dispatch = rec.dispatches[0].bytes_read[rec.dispatches[0].buffer("w")], 0
    gate_up, down = rec.dispatches[-3], rec.dispatches[-2]
    chosen = int((torch.diff(offs.long(), prepend=torch.zeros(1).long()) > 0).sum())
    expert_bytes = (w_gu[0].nbytes + w_d[0].nbytes)
    scale_bytes = (s_gu[0].nbytes + s_d[0].nbytes) if fp8 else 0
    weight_read = gate_up.bytes_read[gate_up.buffer("w")] + down.bytes_read[down.buffer("w")]
    minimum = chosen * (expert_bytes + scale_bytes) + router.nbytes
    device = sum(d.memory_bytes_moved for d in rec.dispatches) + (router.nbytes if extra_dispatch else 0)
    # DRAM model: weights as read; every activation-sized tensor once at its
    # size (re-reads by many threadgroups hit the GPU's caches; they are KB).
    small = [x, logits, weights, offs, slot_of_row, row_of_slot, hid, y, out]
    dram = weight_read + router_read + chosen * scale_bytes + 2 * sum(t.nbytes for t in small)
    return {"chosen": chosen, "dispatches": len(rec.dispatches) + extra_dispatch,
            "weight_ratio": weight_read / (chosen * expert_bytes), "device_ratio": device / minimum,
            "dram_ratio": dram / minimum, "dram": dram, "gate_up_tgs": gate_up.total_threadgroups,
            "kernels": [d.kernel for d in rec.dispatches]}


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
        ops = torch.ops.mps_ext
        weights, offs, s2r, r2s = ops.moe_route(F.linear(x, router), model.top_k, True, bool(model.shared))
        hid = ops.moe_experts(x, w_gu, None, offs, s2r, model.top_k + model.shared, True)
        return ops.moe_combine(ops.moe_experts(hid, w_d, None, offs), weights, r2s)

    return stock, ours


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", default="1,2,4,8")
    parser.add_argument("--models", default="", help="comma-separated name fragments (default: all)")
    args = parser.parse_args()
    token_counts = [int(t) for t in args.tokens.split(",")]
    models = [m for m in MODELS if not args.models or any(s.lower() in m.name.lower() for s in args.models.split(","))]
    started = time.perf_counter()
    rows = []
    for model in models:
        for fp8 in (False, True):
            for tokens in token_counts:
                r = layer(model, tokens, fp8)
                wb = 1 if fp8 else 2
                row = {"model": model.name, "w": "fp8" if fp8 else "bf16", "tokens": tokens, "experts": r["chosen"],
                       "disp": r["dispatches"], "wread": f"{r['weight_ratio']:.3f}",
                       "dev": f"{r['device_ratio']:.2f}", "dram": f"{r['dram_ratio']:.3f}",
                       "tgs": r["gate_up_tgs"], "layer MB": f"{r['dram'] / 1e6:.1f}"}
                for chip, bw in CHIPS.items():
                    row[chip] = f"{project(model, r['dram'], r['dispatches'], tokens, wb, bw, True):.0f}"
                row["M3U moe-only"] = f"{project(model, r['dram'], r['dispatches'], tokens, wb, CHIPS['M3 Ultra'], False):.0f}"
                row["M3U bf16 head"] = (f"{project(model, r['dram'], r['dispatches'], tokens, wb, CHIPS['M3 Ultra'], True, 2):.0f}"
                                        if fp8 else "-")
                row["torch 2.15"] = str(TORCH_215.get(model.name, "-")) if tokens == 1 and not fp8 else "-"
                row["mac stock/ours us"] = "-"
                if mps_ext.is_available() and not fp8:
                    times = mac_times(*stock_layer_fn(model, tokens))
                    if times:
                        row["mac stock/ours us"] = f"{times[0] * 1e6:.0f}/{times[1] * 1e6:.0f}"
                rows.append(row)
                print(f"  {model.name} {row['w']} tokens={tokens}: {r['kernels']}", flush=True)
    print(table(rows, [("model", "model"), ("w", "experts"), ("tokens", "tokens"), ("experts", "chosen"),
                       ("disp", "dispatches"), ("wread", "weight read/chosen"), ("dev", "device bytes/min"),
                       ("dram", "DRAM model/min"), ("tgs", "gate/up threadgroups"), ("layer MB", "layer MB"),
                       ("M3 Ultra", "tok/s M3 Ultra"), ("M4 Max", "tok/s M4 Max"),
                       ("M3U moe-only", "tok/s M3U (MoE dispatches only)"),
                       ("M3U bf16 head", "tok/s M3U (LM head bf16)"), ("torch 2.15", "torch 2.15 M3U"),
                       ("mac stock/ours us", "Mac layer stock/ours us")]))
    print()
    for m in models:
        print(f"{m.name}: {m.layers} layers, {m.moe_layers} MoE; dense weights {dense_bytes(m, 2) / 1e9:.2f} GB bf16 / "
              f"{dense_bytes(m, 1) / 1e9:.2f} GB fp8 per step ({m.note}).")
    print(f"""
weight read/chosen: expert weight bytes the two expert kernels read over (distinct chosen experts x one expert's
  gate/up + down bytes); the routed and shared experts only, never an idle one.
device bytes/min: every byte any dispatch of the layer read or wrote (executor counters) over the minimum, the
  chosen experts' weights (and fp8 row scales) and the router once. Activation rows re-read by each threadgroup
  that uses them count every time here.
DRAM model/min: the weights as read, plus every activation-sized tensor once read and once written (re-reads of
  KB-sized activations are served by the GPU's caches). This is the layer's bytes in the projection.
tok/s: (MoE layers x layer bytes + dense weights) / bandwidth + 4 us x dispatches, for one decode step of
  `tokens` tokens (tokens/s = tokens / step time). Dispatches: the layer's, measured, x MoE layers, plus
  {DENSE_DISPATCHES_PER_LAYER} per layer and {HEAD_DISPATCHES} for the head outside MoE blocks (assumed); the
  'MoE dispatches only' column leaves the assumed ones out. fp8: every linear weight fp8 (experts, mixers, LM
  head: quantize_fp8(model, filter=...) choosing the head too), the router bf16; the 'LM head bf16' column keeps
  the head in bf16, as quantize_fp8 does by default. Weights stream at the full bandwidth, KV cache and other
  activations are ignored, kernels do not overlap. Dense weights per model are printed above; those not in
  anchors.md are assumptions.
torch 2.15 M3U: anchors.md, measured end to end with torch.compile (not a projection).
executor run time: {time.perf_counter() - started:.0f} s""")


if __name__ == "__main__":
    main()
