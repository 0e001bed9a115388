"""Meta kernels (shapes and dtypes) of the torch.ops.mps_ext ops that do not
take the aten op's own: fp8_linear (no aten op) and the scaled_mm family,
whose aten meta functions check CUDA's layout rules (mat2 column-major,
dimensions multiples of 16) that mps_ext does not need, so a traced model
would fail where the eager one runs. In Python so that symbolic shapes
(torch.compile(dynamic=True)) pass through. The real kernels check the
arguments when the compiled code runs."""

from __future__ import annotations

import torch


def _product(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, op: str) -> torch.Tensor:
    torch._check(a.dim() == 2 and b.dim() == 2, lambda: f"{op}: self and mat2 must be matrices")
    torch._check(a.shape[1] == b.shape[0], lambda: f"{op}: self and mat2 shapes cannot be multiplied "
                 f"({a.shape[0]}x{a.shape[1]} and {b.shape[0]}x{b.shape[1]})")
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


def _scaled_mm(self, mat2, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False):
    return _product(self, mat2, out_dtype or self.dtype, "_scaled_mm")


def _scaled_mm_v2(self, mat2, scale_a, recipe_a, swizzle_a, scale_b, recipe_b, swizzle_b, bias, out_dtype,
                  contraction_dim=(), use_fast_accum=False):
    return _product(self, mat2, out_dtype or torch.bfloat16, "_scaled_mm_v2")  # bf16: torch's default for v2


def _fp8_linear(input, weight, weight_scale, granularity, bias=None):
    torch._check(weight.dim() == 2, lambda: "mps_ext fp8_linear: weight must be a 2-D float8 tensor")
    torch._check(input.dim() >= 1 and input.shape[-1] == weight.shape[1],
                 lambda: "mps_ext fp8_linear: input's last dimension must equal the weight's K")
    return input.new_empty((*input.shape[:-1], weight.shape[0]))


def register() -> None:
    for name, fn in [("_scaled_mm", _scaled_mm), ("_scaled_mm_v2", _scaled_mm_v2), ("fp8_linear", _fp8_linear)]:
        torch.library.register_fake(f"mps_ext::{name}", fn)
