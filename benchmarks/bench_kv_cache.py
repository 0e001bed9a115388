"""The KV cache append (torch.ops.mps_ext.kv_append, the kv_cache family):
a decode token's new key and value rows written into the cache's spare
capacity, where transformers' DynamicLayer.update copies the whole cache
twice with torch.cat; the cases of `python -m benchmarks kv_cache`.

    python benchmarks/bench_kv_cache.py [--quick | --tiny]   (the same)

Its minimum is the new rows read once and written once. On a Mac, the two
torch.cat calls against the one dispatch.
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


def cases(size: str) -> list[Case]:
    out = []
    for h, d, n, dtype, what, sizes in KV_CASES:
        if size not in sizes:
            continue
        labels = {"shape": f"k{h} d{d} n{n}", "dtype": str(dtype)[6:], "variant": "", "what": what}
        out.append(Case("kv_cache", f"kv_append {labels['shape']} {labels['dtype']}", labels,
                        lambda a=(h, d, n, dtype): prepare_kv(*a)))
    return out


if __name__ == "__main__":
    run_as_script("kv_cache")
