"""Softmax forward and backward: the cases of `python -m benchmarks softmax`.

    python benchmarks/bench_softmax.py [--quick | --tiny]   (the same)

Every forward case has its backward (_softmax_backward_data, which mps_ext
keeps on every torch release). Between them they reach each softmax kernel
shape: segment (rows up to 128), block (up to 8192), split (longer: partial
then finish), strided (a softmax over a dimension that is not the last), in
every dtype pair (half_to_float: fp16 in, fp32 out) with 16-byte accesses,
and with element accesses where rows are not 16-byte aligned.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import Case, Prepared, run_as_script  # noqa: E402

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
CASES = [  # (shape, dtype, dim, half_to_float, what, sizes it runs at)
    ((1, 128256), F32, -1, False, "one decode step's logits (Llama 3 vocabulary)", ("full", "quick")),
    ((8, 151936), BF16, -1, False, "a batch of Qwen3 logits", ("full", "quick")),
    ((1, 248320), F16, -1, False, "Qwen3.5 logits", ("full", "quick")),
    ((1, 128256), F16, -1, True, "fp16 logits sampled in fp32", ("full", "quick")),
    ((4096, 4096), F16, -1, False, "attention scores", ("full",)),
    ((1, 32, 1, 4096), F32, -1, False, "decode attention, 32 heads over 4096 keys", ("full", "quick")),
    ((1, 32, 1, 4096), F16, -1, False, "decode attention in fp16", ("full", "quick")),
    ((1, 32, 1, 4096), F16, -1, True, "decode attention in fp32 from fp16 scores", ("full", "quick")),
    ((4096, 256), BF16, -1, False, "MoE router, 256 experts (Qwen3.5)", ("full", "quick")),
    ((32, 1024, 16), F32, 1, False, "over a middle dimension", ("full", "quick")),
    ((4096, 128), BF16, -1, False, "MoE router, 128 experts (Qwen3)", ("full", "quick")),
    # Rows whose starts are not 16-byte aligned take the element-access
    # kernels (the others here take 16-byte accesses).
    ((4096, 60), BF16, -1, False, "MoE router, 60 experts (Qwen1.5-MoE): unaligned rows", ("full", "quick")),
    ((1, 32, 1, 4097), F16, -1, False, "decode attention over 4097 keys: unaligned rows", ("full", "quick")),
    ((8, 50257), F32, -1, False, "GPT-2 logits, 8 rows: unaligned rows", ("full", "quick")),
    ((8, 512, 64), BF16, 1, False, "over a middle dimension in bf16", ("full", "quick")),
    ((4096, 128), F16, -1, True, "MoE router in fp32 from fp16 logits", ("full", "quick")),
    ((4096, 32), F32, -1, False, "MoE router, 32 experts (LFM2)", ("full", "quick")),
    ((1, 32, 128, 128), F16, -1, False, "attention over a 128-token prompt", ("full", "quick")),
    ((4, 1000), F32, -1, False, "tiny: block", ("tiny",)),
    ((64, 100), F16, -1, True, "tiny: segment", ("tiny",)),
]
NOTES = "Backward: grad_output and the forward's output in, grad_input out (the minimum)."


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype)[6:]


def forward(shape, dtype, dim, half_to_float) -> Prepared:
    x = torch.randn(shape).to(dtype)
    out_bytes = x.numel() * (4 if half_to_float else x.element_size())

    def mac():
        xm = x.to("mps")
        ours = lambda: torch._softmax(xm, dim, half_to_float)  # noqa: E731
        # Stock torch has no half_to_float on MPS: a user converts first.
        return (lambda: torch.softmax(xm, dim, dtype=torch.float32)) if half_to_float else ours, ours

    return Prepared(lambda: torch.ops.mps_ext._softmax(x, dim, half_to_float), x.nbytes + out_bytes, mac)


def backward(shape, dtype, dim, half_to_float) -> Prepared:
    out_dtype = torch.float32 if half_to_float else dtype
    y = torch.randn(shape, dtype=torch.float32).softmax(dim).to(out_dtype)
    g = torch.randn(shape).to(out_dtype)
    grad_input_bytes = y.numel() * torch.tensor([], dtype=dtype).element_size()

    def mac():
        ym, gm = y.to("mps"), g.to("mps")
        fn = lambda: torch._softmax_backward_data(gm, ym, dim, dtype)  # noqa: E731
        return fn, fn

    return Prepared(lambda: torch.ops.mps_ext._softmax_backward_data(g, y, dim, dtype),
                    g.nbytes + y.nbytes + grad_input_bytes, mac)


def cases(size: str) -> list[Case]:
    out = []
    for shape, dtype, dim, half_to_float, what, sizes in CASES:
        if size not in sizes:
            continue
        types = dtype_name(dtype) + ("->float32" if half_to_float else "")
        for direction, prepare in (("forward", forward), ("backward", backward)):
            labels = {"shape": "x".join(map(str, shape)), "dim": str(dim), "dtype": types,
                      "pass": direction, "what": what}
            out.append(Case("softmax", f"{labels['shape']} dim {dim} {types} {direction}", labels,
                            lambda p=prepare, a=(shape, dtype, dim, half_to_float): p(*a)))
    return out


if __name__ == "__main__":
    run_as_script("softmax")
