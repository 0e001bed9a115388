"""float8 tensors (the fp8 family): every conversion to and from fp8 (the
fp8_convert kernels, `x.to(torch.float8_e4m3fn)` and back on MPS), dense and
through a transposed view; the cases of `python -m benchmarks fp8`.

    python benchmarks/bench_fp8.py [--quick | --tiny]   (the same)

A conversion's minimum is its input read once and its output written once.
On a Mac, stock torch's own conversion (where the release has one) against
mps_ext's. (The fp8 matrix products are the scaled_mm family's:
benchmarks/bench_scaled_mm.py.)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_scaled_mm import E4, E5, EXPERT, name  # noqa: E402
from benchmarks.common import Case, Prepared, run_as_script  # noqa: E402

CONVERSIONS = [(torch.bfloat16, E4), (torch.float32, E4), (E4, torch.bfloat16), (E4, torch.float16)]


def conversion(src, dst, shape, transposed) -> Prepared:
    x = (torch.randn(shape) * 50).to(src)
    if transposed:
        x = x.t()
    y = torch.empty(x.shape, dtype=dst)

    def mac():
        xm = x.to("mps")
        fn = lambda: xm.to(dst)  # noqa: E731
        return fn, fn

    return Prepared(lambda: torch.ops.mps_ext.copy_(y, x), x.nbytes + y.nbytes, mac)


def cases(size: str) -> list[Case]:
    out = []

    def convert(src, dst, shape, transposed):
        labels = {"op": "copy_", "shape": "x".join(map(str, shape)), "layout": "transposed" if transposed else "",
                  "conversion": f"{name(src)} -> {name(dst)}"}
        id_ = f"copy_ {name(src)} -> {name(dst)} {labels['shape']}" + (" transposed" if transposed else "")
        out.append(Case("fp8", id_, labels, lambda: conversion(src, dst, shape, transposed)))

    if size == "tiny":
        convert(torch.bfloat16, E4, (64, 96), False)
        return out
    if size == "full":
        for src, dst in CONVERSIONS:
            convert(src, dst, (4096, 4096), False)
    k, n, _ = EXPERT
    floats = (torch.float32, torch.float16, torch.bfloat16)
    pairs = [(s, d) for s in floats for d in (E4, E5)] + [(s, d) for s in (E4, E5) for d in floats + (E5, E4) if s != d]
    for src, dst in pairs:  # every conversion kernel, at an MoE expert's weight shape
        for transposed in (False, True):
            convert(src, dst, (n, k), transposed)
    return out


if __name__ == "__main__":
    run_as_script("fp8")
