// FP8 on the Mac (csrc/ops/fp8.cpp, csrc/ops/scaled_mm.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/DispatchKey.h>

#include <cstdint>
#include <string>

#include "dispatch/registration.h"

namespace torch {
class Library;
}

namespace mps_ext {

bool is_fp8(c10::ScalarType t);

// dst = src converted, on one device, through kernels_metal/fp8.metal.
// Both dtypes are float32, float16, bfloat16, float8_e4m3fn or float8_e5m2
// and at least one is fp8; src has dst's shape (expand it first) and does
// not overlap dst. Returns false (and does nothing) if the layout has more
// dimensions than the kernels index after merging contiguous ones.
bool fp8_convert(const at::Tensor& dst, const at::Tensor& src);

// The float8 code torch's CPU fill_ writes into a `dtype` tensor for `value`
// (its rounding, saturation and overflow error).
uint8_t fp8_code(c10::ScalarType dtype, const c10::Scalar& value);

// The fp8 family's ops beyond moves and conversions (csrc/ops/fp8_ops.cpp):
// indexing, comparisons, .item(); registered by fp8.cpp's register_fp8.
template <c10::DispatchKey K>
void register_fp8_tensor_ops(FamilyOps& ops);

// Wraps torch's kernel of every aten op on `key` that mps_ext does not
// override so that an error about a float8 dtype names the op and says to
// cast first (fp8_errors.cpp); once per key, returning the number of ops
// wrapped. On MPS, mps_ext/__init__.py calls it at import, with the
// overrides; tests call it for CPU, in a process of their own.
int64_t name_float8_errors(c10::DispatchKey key);

}  // namespace mps_ext
