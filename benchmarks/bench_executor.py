"""How fast the CPU Metal executor itself runs, checks on: a 4096 x 4096 half
matrix-vector product, one simdgroup per row, simd_sum.

    python benchmarks/bench_executor.py
"""

import time
from pathlib import Path

import numpy as np
import torch

import mps_ext_executor as cpu_metal

N = K = 4096


def main():
    path = Path(__file__).parent / "kernels" / "gemv_simdgroup_per_row.metal"
    t = time.perf_counter()
    lib = cpu_metal.compile_library(path.read_text(), filename=path.name)
    print(f"compile (or cache hit): {time.perf_counter() - t:.2f} s")
    W = torch.randn(N, K).half()
    x = torch.randn(K).half()
    y = torch.zeros(N, dtype=torch.float16)
    times = []
    for _ in range(3):
        t = time.perf_counter()
        stats = lib.dispatch("gemv_f16", [y, W, x, np.uint32(K // 4)], threadgroups=N, threads_per_threadgroup=32)
        times.append(time.perf_counter() - t)
    err = (y.float() - W.float() @ x.float()).abs().max().item()
    print(f"{N} x {K} half GEMV through the executor, checks on, {cpu_metal.worker_count()} CPU threads: "
          f"best {min(times):.3f} s of {len(times)} (max |error| {err:.3g})")
    print(f"threads {stats.threads}, simd operations {stats.simd_operations}, "
          f"weight bytes read / size {stats.bytes_read[1] / W.nbytes:.3f}, read widths {stats.read_widths[1]}")


if __name__ == "__main__":
    main()
