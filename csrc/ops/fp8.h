// FP8 on the Mac (csrc/ops/fp8.cpp, csrc/ops/fp8_mm.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/DispatchKey.h>

#include <string>

namespace mps_ext {

bool is_fp8(c10::ScalarType t);

// dst = src converted, on one device, through kernels_metal/fp8.metal.
// Both dtypes are float32, float16, bfloat16, float8_e4m3fn or float8_e5m2
// and at least one is fp8; src has dst's shape (expand it first) and does
// not overlap dst. Returns false (and does nothing) if the layout has more
// dimensions than the kernels index after merging contiguous ones.
bool fp8_convert(const at::Tensor& dst, const at::Tensor& src);

}  // namespace mps_ext
