"""RMSNorm (torch.ops.mps_ext.rms_norm, mps_ext.optimize's norms) and the
attention's q/k norms with the rotary embedding (torch.ops.mps_ext.qk_norm_rope):
the residual add with the norm after it (torch.ops.mps_ext.add_rms_norm);
the cases of `python -m benchmarks norm`.

    python benchmarks/bench_norm.py [--quick | --tiny]   (the same)

A decode token's norms are a few kilobytes: launch and latency decide
their time, not bytes (one dispatch instead of 6 to 8). The minimum is x
and the weight read once and the output written once; the kernel reads the
weight once per team of threads (up to 8 rows a team).

add_rms_norm (a decoder layer's residual add and post-attention norm) has
the minimum x and the residual read once, the sum and the normed rows
written once, the weight read once; two dispatches (add, rms_norm) would
also write the sum and read it back.

qk_norm_rope's minimum is q and k read once, both outputs written once,
the weights once and each token's cos and sin once; the kernel reads cos,
sin and a weight once per threadgroup (decode: one per 8 heads).
qk_norm_rope_append (the same with the KV cache append in its dispatch)
also reads v once and writes the new k and v rows into the cache once;
qk_norm_rope then kv_append would also write k's rows and read them back.

(The attention's other decode pieces are families of their own:
benchmarks/bench_attention_gate.py, benchmarks/bench_kv_cache.py.)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import Case, Prepared, run_as_script  # noqa: E402

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
CASES = [  # (rows, n, dtype, variant, what, sizes it runs at)
    (1, 2048, BF16, "weight", "Qwen3-30B-A3B decode: a layer norm of the hidden state", ("full", "quick")),
    (32, 128, BF16, "weight", "Qwen3-30B-A3B decode: q_norm over 32 heads", ("full", "quick")),
    (1, 2048, BF16, "zero_centred", "Qwen3.6-35B-A3B decode: a layer norm (1 + weight)", ("full", "quick")),
    (16, 256, BF16, "zero_centred", "Qwen3.6-35B-A3B decode: q_norm over 16 heads of 256", ("full", "quick")),
    (1, 2048, F16, "weight", "LFM2.5-8B-A1B decode in fp16", ("full", "quick")),
    (1, 4096, F32, "weight", "a float32 model's layer norm, 4096 wide", ("full", "quick")),
    (512, 2048, BF16, "weight", "a 512-token prefill's layer norm", ("full",)),
    (4, 300, F32, "weight", "tiny", ("tiny",)),
    (3, 64, BF16, "zero_centred", "tiny", ("tiny",)),
]

ADD_CASES = [  # (rows, n, dtype, variant, what, sizes): a decode token's residual add and post-attention norm
    (1, 2048, BF16, "weight", "Qwen3-30B-A3B decode", ("full", "quick")),
    (1, 2048, BF16, "zero_centred", "Qwen3.6-35B-A3B decode", ("full", "quick")),
    (1, 2048, F16, "weight", "LFM2.5-8B-A1B decode in fp16", ("full", "quick")),
    (1, 4096, F32, "weight", "a float32 model's decode, 4096 wide", ("full", "quick")),
    (512, 2048, BF16, "weight", "a 512-token prefill", ("full",)),
    (4, 300, F32, "weight", "tiny", ("tiny",)),
]

QK_CASES = [  # (batch, tokens, q heads, k heads, head_dim, rotary_dim, dtype, variant, what, sizes)
    (1, 1, 32, 4, 128, 128, BF16, "weight", "Qwen3-30B-A3B decode: q_norm, k_norm, RoPE", ("full", "quick")),
    (1, 1, 16, 2, 256, 64, BF16, "zero_centred", "Qwen3.6-35B-A3B decode: partial RoPE (64 of 256)",
     ("full", "quick")),
    (1, 1, 32, 8, 64, 64, F16, "weight", "LFM2-8B-A1B decode in fp16", ("full", "quick")),
    (1, 1, 8, 2, 128, 128, F32, "weight", "a float32 model's decode", ("full", "quick")),
    (1, 512, 32, 4, 128, 128, BF16, "weight", "a 512-token prefill of Qwen3-30B-A3B", ("full",)),
    (1, 1, 4, 2, 64, 64, F32, "weight", "tiny", ("tiny",)),
    (1, 3, 2, 1, 256, 64, BF16, "zero_centred", "tiny", ("tiny",)),
]



def _qk_inputs(b, t, hq, hk, d, r, dtype, variant):
    """q, k, cos, sin and the two norm weights of a QK_CASES case."""
    q, k = torch.randn(b, t, hq, d).to(dtype), torch.randn(b, t, hk, d).to(dtype)
    angles = torch.randn(b, t, r // 2).repeat(1, 1, 2)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    qw, kw = ((torch.randn(d) * 0.1 + (1 if variant == "weight" else 0)).to(dtype) for _ in range(2))
    return q, k, cos, sin, qw, kw


# Rows already in the cache before qk_norm_rope_append's (a short context: the append moves only its own rows).
APPEND_START = 8


def prepare_qk_append(b, t, hq, hk, d, r, dtype, variant) -> Prepared:
    """qk_norm_rope_append: the case's q/k norms and RoPE with v's and the
    new k rows written into a cache at APPEND_START; against it on a Mac,
    qk_norm_rope then kv_append (the two dispatches it replaces)."""
    q, k, cos, sin, qw, kw = _qk_inputs(b, t, hq, hk, d, r, dtype, variant)
    v = torch.randn(b, t, hk, d).to(dtype)
    kc, vc = (torch.zeros(b, hk, APPEND_START + t, d, dtype=dtype) for _ in range(2))

    def mac():
        qm, km, vm, cm, sm, qwm, kwm, kcm, vcm = (x.to("mps") for x in (q, k, v, cos, sin, qw, kw, kc, vc))

        def two():
            _, ko = torch.ops.mps_ext.qk_norm_rope(qm, km, cm, sm, qwm, kwm, 1e-6, variant)
            torch.ops.mps_ext.kv_append(kcm, vcm, ko, vm.transpose(1, 2), APPEND_START)

        return (two, lambda: torch.ops.mps_ext.qk_norm_rope_append(qm, km, vm, cm, sm, qwm, kwm, 1e-6, variant, kcm,
                                                                    vcm, APPEND_START))

    # q, k and v read once, q's output and the new k and v rows written once, the weights, cos and sin once
    minimum = 2 * (q.nbytes + k.nbytes + v.nbytes) + qw.nbytes + kw.nbytes + cos.nbytes + sin.nbytes
    return Prepared(lambda: torch.ops.mps_ext.qk_norm_rope_append(q, k, v, cos, sin, qw, kw, 1e-6, variant, kc, vc,
                                                                   APPEND_START), minimum, mac)


def prepare_qk(b, t, hq, hk, d, r, dtype, variant) -> Prepared:
    q, k, cos, sin, qw, kw = _qk_inputs(b, t, hq, hk, d, r, dtype, variant)

    def mac():
        from mps_ext.passes.norm import rms_norm_reference, rope_reference
        qm, km, cm, sm, qwm, kwm = (x.to("mps") for x in (q, k, cos, sin, qw, kw))
        return (lambda: rope_reference(rms_norm_reference(qm, qwm, 1e-6, variant).transpose(1, 2),
                                       rms_norm_reference(km, kwm, 1e-6, variant).transpose(1, 2), cm, sm),
                lambda: torch.ops.mps_ext.qk_norm_rope(qm, km, cm, sm, qwm, kwm, 1e-6, variant))

    minimum = 2 * (q.nbytes + k.nbytes) + qw.nbytes + kw.nbytes + cos.nbytes + sin.nbytes
    return Prepared(lambda: torch.ops.mps_ext.qk_norm_rope(q, k, cos, sin, qw, kw, 1e-6, variant), minimum, mac)


def prepare(rows, n, dtype, variant) -> Prepared:
    x = torch.randn(rows, n).to(dtype)
    w = (torch.randn(n) * 0.1 + (1 if variant == "weight" else 0)).to(dtype)

    def mac():
        from mps_ext.passes.norm import rms_norm_reference
        xm, wm = x.to("mps"), w.to("mps")
        return (lambda: rms_norm_reference(xm, wm, 1e-6, variant),
                lambda: torch.ops.mps_ext.rms_norm(xm, wm, 1e-6, variant))

    return Prepared(lambda: torch.ops.mps_ext.rms_norm(x, w, 1e-6, variant), 2 * x.nbytes + w.nbytes, mac)


def prepare_add(rows, n, dtype, variant) -> Prepared:
    x, r = torch.randn(rows, n).to(dtype), torch.randn(rows, n).to(dtype)
    w = (torch.randn(n) * 0.1 + (1 if variant == "weight" else 0)).to(dtype)

    def mac():
        from mps_ext.passes.norm import rms_norm_reference
        xm, rm, wm = x.to("mps"), r.to("mps"), w.to("mps")
        return (lambda: rms_norm_reference(xm + rm, wm, 1e-6, variant),
                lambda: torch.ops.mps_ext.add_rms_norm(xm, rm, wm, 1e-6, variant))

    return Prepared(lambda: torch.ops.mps_ext.add_rms_norm(x, r, w, 1e-6, variant), 4 * x.nbytes + w.nbytes, mac)


def cases(size: str) -> list[Case]:
    out = []
    for rows, n, dtype, variant, what, sizes in CASES:
        if size not in sizes:
            continue
        labels = {"shape": f"{rows}x{n}", "dtype": str(dtype)[6:], "variant": variant, "what": what}
        out.append(Case("norm", f"{rows}x{n} {labels['dtype']} {variant}", labels,
                        lambda a=(rows, n, dtype, variant): prepare(*a)))
    for rows, n, dtype, variant, what, sizes in ADD_CASES:
        if size not in sizes:
            continue
        labels = {"shape": f"{rows}x{n}", "dtype": str(dtype)[6:], "variant": variant, "what": what}
        out.append(Case("norm", f"add_rms_norm {rows}x{n} {labels['dtype']} {variant}", labels,
                        lambda a=(rows, n, dtype, variant): prepare_add(*a)))
    for b, t, hq, hk, d, r, dtype, variant, what, sizes in QK_CASES:
        if size not in sizes:
            continue
        shape = f"{b}x{t} q{hq} k{hk} d{d} r{r}"
        labels = {"shape": shape, "dtype": str(dtype)[6:], "variant": variant, "what": what}
        for op, prep in (("qk_norm_rope", prepare_qk), ("qk_norm_rope_append", prepare_qk_append)):
            out.append(Case("norm", f"{op} {shape} {labels['dtype']} {variant}", labels,
                            lambda a=(b, t, hq, hk, d, r, dtype, variant), prep=prep: prep(*a)))
    return out


if __name__ == "__main__":
    run_as_script("norm")
