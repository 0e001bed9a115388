"""constant_pad_nd: traffic and dispatches from the CPU Metal executor
everywhere; on a Mac also the median time of stock torch against mps_ext.

    python benchmarks/bench_pad.py
"""

import torch

import mps_ext  # noqa: F401
from common import mac_times, table, traffic

CASES = [  # (shape, dtype, pad)
    ((1, 16, 4, 256, 256), torch.float32, [1, 1, 1, 1, 1, 1]),  # a video-VAE latent, padded for a 3x3x3 conv
    ((1, 128, 512, 512), torch.float16, [1, 1, 1, 1]),          # an image-VAE decoder activation
    ((1, 512, 64, 64), torch.bfloat16, [0, 1, 0, 1]),           # asymmetric pad before a stride-2 conv
]


def main():
    rows = []
    for shape, dtype, pad in CASES:
        x = torch.randn(shape).to(dtype)
        out = torch.constant_pad_nd(x, pad)
        t = traffic(lambda: torch.ops.mps_ext.constant_pad_nd(x, pad, 0))
        minimum = x.nbytes + out.nbytes
        row = {"shape": "x".join(map(str, shape)), "dtype": str(dtype)[6:], "dispatches": t["dispatches"],
               "threadgroups": t["threadgroups"], "bytes/min": f"{t['memory_bytes'] / minimum:.3f}",
               "16B stores": f"{t['wide_store_share']:.0%}", "kernels": ", ".join(t["kernels"])}
        times = None
        if torch.backends.mps.is_available():
            xm = x.to("mps")
            times = mac_times(lambda: torch.constant_pad_nd(xm, pad), lambda: torch.constant_pad_nd(xm, pad))
        row["stock us"], row["mps_ext us"], row["speedup"] = (
            (f"{times[0] * 1e6:.1f}", f"{times[1] * 1e6:.1f}", f"{times[0] / times[1]:.2f}x") if times else ("-",) * 3)
        rows.append(row)
    print(table(rows, [("shape", "shape"), ("dtype", "dtype"), ("dispatches", "dispatches"),
                       ("threadgroups", "threadgroups"), ("bytes/min", "bytes / minimum"),
                       ("16B stores", "16-byte stores"), ("stock us", "stock (us)"),
                       ("mps_ext us", "mps_ext (us)"), ("speedup", "speedup"), ("kernels", "kernel")]))
    print("bytes / minimum: bytes read and written over tensor buffers, against reading the input once and "
          "writing the output once. 16-byte stores: share of the output's bytes stored 16 at a time. "
          "Times only on a Mac.")


if __name__ == "__main__":
    main()
