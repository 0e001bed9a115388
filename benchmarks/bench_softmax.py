"""Softmax: traffic and dispatches from the CPU Metal executor everywhere; on a
Mac also the median time of stock torch against mps_ext.

    python benchmarks/bench_softmax.py
"""

import torch

import mps_ext  # noqa: F401
from common import mac_times, table, traffic

CASES = [  # (shape, dtype, dim)
    ((1, 128256), torch.float32, -1),   # one decode step's logits (Llama 3 vocabulary)
    ((8, 151936), torch.bfloat16, -1),  # a batch of Qwen3 logits
    ((4096, 4096), torch.float16, -1),  # attention scores
    ((32, 1024, 16), torch.float32, 1), # a softmax over a middle dimension
]


def main():
    rows = []
    for shape, dtype, dim in CASES:
        x = torch.randn(shape).to(dtype)
        t = traffic(lambda: torch.ops.mps_ext._softmax(x, dim, False))
        minimum = 2 * x.nbytes  # read the input once, write the output once
        row = {"shape": "x".join(map(str, shape)), "dtype": str(dtype)[6:], "dispatches": t["dispatches"],
               "threadgroups": t["threadgroups"], "bytes/min": f"{t['memory_bytes'] / minimum:.3f}",
               "16B": f"{t['wide_share']:.0%}", "kernels": ", ".join(t["kernels"])}
        times = None
        if torch.backends.mps.is_available():
            xm = x.to("mps")
            times = mac_times(lambda: torch._softmax(xm, dim, False), lambda: torch._softmax(xm, dim, False))
        row["stock us"], row["mps_ext us"], row["speedup"] = (
            (f"{times[0] * 1e6:.1f}", f"{times[1] * 1e6:.1f}", f"{times[0] / times[1]:.2f}x") if times else ("-",) * 3)
        rows.append(row)
    print(table(rows, [("shape", "shape"), ("dtype", "dtype"), ("dispatches", "dispatches"),
                       ("threadgroups", "threadgroups"), ("bytes/min", "bytes / minimum"),
                       ("16B", "16-byte accesses"), ("stock us", "stock (us)"), ("mps_ext us", "mps_ext (us)"),
                       ("speedup", "speedup"), ("kernels", "kernels")]))
    print("bytes / minimum: bytes read and written over tensor buffers, against reading the input once and "
          "writing the output once (a split row is read twice). 16-byte accesses: share of those bytes moved by "
          "16-byte loads and stores. Times only on a Mac.")


if __name__ == "__main__":
    main()
