"""constant_pad_nd: the cases of `python -m benchmarks pad`.

    python benchmarks/bench_pad.py [--quick | --tiny]   (the same)

Elements of 1, 2, 4 and 8 bytes. The 64-bit-index kernels (more than 2^31
elements or offsets) are beyond what the executor runs at benchmark cost.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import Case, Prepared, run_as_script  # noqa: E402

CASES = [  # (shape, dtype, pad, value, what, sizes it runs at)
    ((1, 16, 4, 256, 256), torch.float32, [1, 1, 1, 1, 1, 1], 0, "video-VAE latent, for a 3x3x3 conv",
     ("full", "quick")),
    ((1, 320, 64, 64), torch.float32, [1, 1, 1, 1], 0, "UNet activation, for a 3x3 conv", ("full", "quick")),
    ((1, 128, 512, 512), torch.float16, [1, 1, 1, 1], 0, "image-VAE decoder activation", ("full",)),
    ((1, 512, 64, 64), torch.bfloat16, [0, 1, 0, 1], 0, "asymmetric, before a stride-2 conv", ("full", "quick")),
    ((1, 3, 1024, 1024), torch.uint8, [16, 16, 16, 16], 0, "an 8-bit image, bordered", ("full", "quick")),
    ((8, 4000), torch.int64, [0, 96], 128001, "token ids to a common length", ("full", "quick")),
    ((2, 3, 30, 40), torch.float32, [1, 1, 1, 1], 0, "tiny", ("tiny",)),
    ((16, 100), torch.int64, [0, 28], 5, "tiny", ("tiny",)),
]


def prepare(shape, dtype, pad, value) -> Prepared:
    x = (torch.randn(shape) * 100).to(dtype)
    out_bytes = (
        torch.constant_pad_nd(torch.empty(shape, dtype=dtype, device="meta"), pad, value).numel() * x.element_size()
    )

    def mac():
        xm = x.to("mps")
        fn = lambda: torch.constant_pad_nd(xm, pad, value)  # noqa: E731
        return fn, fn

    return Prepared(lambda: torch.ops.mps_ext.constant_pad_nd(x, pad, value), x.nbytes + out_bytes, mac)


def cases(size: str) -> list[Case]:
    out = []
    for shape, dtype, pad, value, what, sizes in CASES:
        if size not in sizes:
            continue
        labels = {"shape": "x".join(map(str, shape)), "dtype": str(dtype)[6:], "pad": str(pad), "what": what}
        out.append(Case("pad", f"{labels['shape']} {labels['dtype']} {pad}", labels,
                        lambda a=(shape, dtype, pad, value): prepare(*a)))
    return out


if __name__ == "__main__":
    run_as_script("pad")
