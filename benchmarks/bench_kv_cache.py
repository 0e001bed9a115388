"""The KV cache append (torch.ops.mps_ext.kv_append, the kv_cache family):
a decode token's new key and value rows written into the cache's spare
capacity, where transformers' DynamicLayer.update copies the whole cache
twice with torch.cat; and a decoded token's attention over the cache
(torch.ops.mps_ext.kv_decode_attention), each key and value row read once
for the query heads sharing it; the cases of `python -m benchmarks kv_cache`.

    python benchmarks/bench_kv_cache.py [--quick | --tiny]   (the same)

The append's minimum is the new rows read once and written once; the
attention's the query, the filled keys and values and the output, once
each. On a Mac, the two torch.cat calls against the one dispatch, and
F.scaled_dot_product_attention (enable_gqa) against kv_decode_attention.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import Case, Prepared, run_as_script  # noqa: E402

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
KV_CASES = [  # (kv heads, head_dim, cached positions, dtype, what, sizes)
    (2, 256, 1000, BF16, "Qwen3.6-35B-A3B decode: 2 KV heads of 256 after 1000 tokens", ("full", "quick")),
    (4, 128, 1000, F16, "Qwen3-30B-A3B decode in fp16: 4 KV heads of 128", ("full", "quick")),
    (8, 64, 1000, F32, "LFM2.5-8B-A1B decode in float32: 8 KV heads of 64", ("full", "quick")),
    (2, 16, 7, F32, "tiny", ("tiny",)),
]


def prepare_kv(h, d, n, dtype) -> Prepared:
    cap = -(-(n + 1) // 256) * 256
    k_cache, v_cache = torch.zeros(1, h, cap, d, dtype=dtype), torch.zeros(1, h, cap, d, dtype=dtype)
    k = torch.randn(1, h, 1, d).to(dtype)
    v = torch.randn(1, 1, h, d).to(dtype).transpose(1, 2)  # v_proj's output viewed as heads

    def mac():
        kc, vc, km, vm = (x.to("mps") for x in (k_cache, v_cache, k, v))
        kn, vn = kc[:, :, :n], vc[:, :, :n]
        return (lambda: (torch.cat([kn, km], dim=-2), torch.cat([vn, vm], dim=-2)),
                lambda: torch.ops.mps_ext.kv_append(kc, vc, km, vm, n))

    return Prepared(lambda: torch.ops.mps_ext.kv_append(k_cache, v_cache, k, v, n), 4 * k.nbytes, mac)


DECODE_CASES = [  # (q heads, kv heads, head_dim, keys, dtype, what, sizes)
    (32, 4, 128, 1024, BF16, "Qwen3-30B-A3B: 32 query heads on 4 KV heads of 128, 1k keys", ("full", "quick")),
    (16, 2, 256, 4096, BF16, "Qwen3.6-35B-A3B: 16 query heads on 2 KV heads of 256, 4k keys", ("full",)),
    (16, 2, 256, 1000, F16, "Qwen3.6-35B-A3B in fp16, 1000 keys", ("full", "quick")),
    (32, 8, 64, 1000, F32, "LFM2.5-8B-A1B in float32: 32 query heads on 8 KV heads of 64", ("full", "quick")),
    (8, 2, 64, 77, F32, "tiny", ("tiny",)),
]


def prepare_decode(hq, hk, d, n, dtype) -> Prepared:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, hq, 1, d, generator=g).to(dtype)
    k, v = (torch.randn(1, hk, n, d, generator=g).to(dtype) for _ in range(2))
    scale = d ** -0.5

    def mac():
        qm, km, vm = (x.to("mps") for x in (q, k, v))
        return (lambda: torch.nn.functional.scaled_dot_product_attention(qm, km, vm, scale=scale, enable_gqa=True),
                lambda: torch.ops.mps_ext.kv_decode_attention(qm, km, vm, scale))

    return Prepared(lambda: torch.ops.mps_ext.kv_decode_attention(q, k, v, scale),
                    2 * q.nbytes + k.nbytes + v.nbytes, mac)


def cases(size: str) -> list[Case]:
    out = []
    for h, d, n, dtype, what, sizes in KV_CASES:
        if size not in sizes:
            continue
        labels = {"shape": f"k{h} d{d} n{n}", "dtype": str(dtype)[6:], "variant": "", "what": what}
        out.append(Case("kv_cache", f"kv_append {labels['shape']} {labels['dtype']}", labels,
                        lambda a=(h, d, n, dtype): prepare_kv(*a)))
    for hq, hk, d, n, dtype, what, sizes in DECODE_CASES:
        if size not in sizes:
            continue
        labels = {"shape": f"q{hq} k{hk} d{d} n{n}", "dtype": str(dtype)[6:], "variant": "", "what": what}
        out.append(Case("kv_cache", f"kv_decode_attention {labels['shape']} {labels['dtype']}", labels,
                        lambda a=(hq, hk, d, n, dtype): prepare_decode(*a)))
    return out


if __name__ == "__main__":
    run_as_script("kv_cache")
