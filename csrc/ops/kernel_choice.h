// What the op files share when they choose a kernel: a dtype's name in
// kernel names, torch's scale recipe codes, when 16-byte loads are safe, and
// how the decode kernels (gemv.metal's gemv_rows, fp8_mm.metal's fp8_gemv)
// spread N outputs over threadgroups.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <algorithm>
#include <cstdint>

namespace mps_ext {

// Decode kernels take 1 to 8 activation rows, in variants for 1, 2, 4, 8.
constexpr int64_t kMaxDecodeRows = 8;

// The dtype's name in kernel names, or nullptr for a dtype no kernel takes.
inline const char* kernel_type_name(c10::ScalarType t) {
  switch (t) {
    case at::kFloat: return "f32";
    case at::kHalf: return "f16";
    case at::kBFloat16: return "bf16";
    case at::kFloat8_e4m3fn: return "e4m3";
    case at::kFloat8_e5m2: return "e5m2";
    case at::kComplexFloat: return "c64";
    default: return nullptr;
  }
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Recipe codes of torch's ScalingType (F.ScalingType; at::blas::ScalingType
// in ATen/BlasBackend.h from torch 2.10), as the *_v2 scaled products take
// them; the same in torch 2.10-2.15.
enum Recipe : int64_t { kTensorWise = 0, kRowWise = 1, kBlock1x128 = 4, kBlock128x128 = 5 };

// The smallest row variant (1, 2, 4, 8) that holds `rows`.
inline int64_t row_variant(int64_t rows) {
  int64_t r = 1;
  while (r < rows) r *= 2;
  return r;
}

// 16-byte loads need the address the kernel sees 16-byte aligned, as well as
// the stride (in elements; 0: a single row). That address is, on CPU, the
// memory itself (torch.frombuffer, numpy arrays and memory-mapped
// checkpoints can be 8-byte aligned); on MPS, the buffer (which Metal
// aligns) plus the storage offset it is bound at.
inline bool aligned16(const at::Tensor& t, int64_t stride) {
  const uint64_t size = t.itemsize();
  const uint64_t base = t.is_cpu() ? reinterpret_cast<uintptr_t>(t.data_ptr()) : t.storage_offset() * size;
  return base % 16 == 0 && (stride * size) % 16 == 0;
}

// Decode geometry: a threadgroup of 1 or 2 simdgroups computes `outputs`
// outputs, N / 320 rounded down to a power of two and clamped to 1 ..
// 2 * max_per_simdgroup, so that N >= 2048 gives at least 320 threadgroups,
// 4 per core of an 80-core M3 Ultra (several per core keep every core
// streaming).
struct DecodeGeometry {
  int64_t threadgroups, simdgroups, outputs_per_simdgroup;
};
inline DecodeGeometry decode_geometry(int64_t n, int64_t max_per_simdgroup) {
  constexpr int64_t kTargetThreadgroups = 4 * 80;
  int64_t outputs = 1;
  while (outputs * 2 <= std::min(n / kTargetThreadgroups, 2 * max_per_simdgroup)) outputs *= 2;
  const int64_t simdgroups = outputs >= 2 ? 2 : 1;
  return {ceil_div(n, outputs), simdgroups, outputs / simdgroups};
}

}  // namespace mps_ext
