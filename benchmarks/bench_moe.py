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

The layer, as mps_ext runs it (torch.ops.mps_ext.moe_layer: 3 dispatches,
nothing read on the host):
    logits = F.linear(x, router)                    router GEMV (mps_ext linear)
    h = moe_gate_up_routed(x, W_gate_up, logits)    softmax, top-k, sort by expert, offsets (moe_route's,
                                                    in each threadgroup) + gather + gate/up + silu(gate) * up
    out = moe_down_combine(h, W_down, weights, ...) down projection and each token's weighted sum
(moe_route's own dispatch before the gate/up product where the routed
kernel does not take the shapes: past 512 experts or 128 token slots, or
rows not 16-byte aligned.)
The shared expert (Qwen3.5/3.6) is expert E of the banks, chosen by every
token with weight sigmoid(router row E). The same expert products are what
F.grouped_mm runs (one dispatch each, no host sync) for model code that
routes with torch ops.

Expert banks are zeros (the counters do not depend on values, and zeros cost
nothing to create); the router weights are random, so routing is.

Besides the layers, moe_experts (the layer's gather + gate/up product) on
its own at a Qwen3-30B-A3B expert's down projection with a 16-byte
misaligned activation (the element-load kernels). The grouped products
(F.grouped_mm, _scaled_grouped_mm) are the grouped_mm family's
(benchmarks/bench_grouped_mm.py); a Gated DeltaNet and a short-convolution
decode step are benchmarks/bench_linear_attention.py and bench_short_conv.py.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_grouped_mm import grouped_case, quantize_rows_zero  # noqa: E402
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


TINY = Model("tiny", 256, 8, 2, 1, 128)


def layer(model: Model, tokens: int, fp8: bool, dtype=torch.bfloat16, seed: int = 0,
          residual: bool = False, add_norm: bool = False) -> Prepared:
    """One MoE layer of `model` for `tokens` tokens, as mps_ext runs it
    (`residual`: with the decoder layer's residual added in its last dispatch;
    `add_norm`: also with the layer's residual add and post-attention norm
    in the router's dispatch, add_rms_norm_moe_layer, x the mixer's output)."""
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
    residual = residual or add_norm
    res = torch.randn(tokens, h, generator=g).to(dtype) if residual else None
    norm_w = torch.ones(h, dtype=dtype)

    def run():
        if add_norm:
            out["out"] = ops.add_rms_norm_moe_layer(x, res, norm_w, 1e-6, "weight", router, w_gu, s_gu, w_d, s_d,
                                                    model.top_k, True, bool(model.shared))[2]
        else:
            out["out"] = ops.moe_layer(x, router, w_gu, s_gu, w_d, s_d, model.top_k, True, bool(model.shared),
                                       residual=res)

    def measures(stats):
        """The layer's figures: from the dispatches and what the run returned."""
        if "gemv" not in stats[0].kernel:  # torch's own one-row GEMV took the router (torch >= 2.15): count it
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


def layer_case(model: Model, tokens: int, fp8: bool, dtype=torch.bfloat16, residual: bool = False,
               add_norm: bool = False) -> Case:
    labels = {"case": "layer", "model": model.name, "experts": "fp8" if fp8 else str(dtype)[6:],
              "activation": str(dtype)[6:], "tokens / rows": str(tokens), "weight": ""}
    id_ = f"layer {model.name} {labels['experts']} tokens={tokens}" + (
        f" {labels['activation']}" if dtype != torch.bfloat16 else "") + (" residual" if residual else "") + (
        " add_norm" if add_norm else "")
    return Case("moe", id_, labels, lambda: layer(model, tokens, fp8, dtype, residual=residual, add_norm=add_norm))


def cases(size: str) -> list[Case]:
    out = []

    def add_layer(model, tokens, fp8, dtype=torch.bfloat16):
        out.append(layer_case(model, tokens, fp8, dtype))

    def add_experts(rows, misaligned):  # moe_experts, the layer's gate/up product, at a grouped product's shape
        out.append(grouped_case("moe_experts", torch.bfloat16, rows, "nk", misaligned, op="moe"))

    if size == "tiny":
        add_layer(TINY, 2, False)
        add_layer(TINY, 2, True)
        return out
    for model in MODELS:
        for fp8 in (False, True):
            for tokens in (1, 2, 4, 8) if size == "full" else (1, 8):
                add_layer(model, tokens, fp8)
    for dtype in (torch.float32, torch.float16):  # the route and combine kernels of other activation dtypes
        add_layer(MODELS[0], 1, False, dtype)
    add_experts(64, misaligned=1)
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
