// FP8 on the Mac (csrc/ops/fp8.cpp, csrc/ops/fp8_mm.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

namespace mps_ext {

bool is_fp8(c10::ScalarType t);

// dst = src converted, on one device, through kernels_metal/fp8.metal.
// Both dtypes are float32, float16, bfloat16, float8_e4m3fn or float8_e5m2
// and at least one is fp8; src has dst's shape (expand it first) and does
// not overlap dst. Returns false (and does nothing) if the layout has more
// dimensions than the kernels index after merging contiguous ones.
bool fp8_convert(const at::Tensor& dst, const at::Tensor& src);

// Torch releases from 2.15 have float8_e4m3fn tensors and tensor-wise and
// row-wise scaled_mm on MPS themselves; then mps_ext leaves those to torch
// (mps_ext/_policy.py) and keeps float8_e5m2 and the block-wise recipes.
void set_fp8_e4m3_native(bool native);
bool fp8_e4m3_native();

}  // namespace mps_ext
