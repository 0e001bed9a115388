// What the op files share when they choose a kernel: a dtype's name in
// kernel names, torch's scale recipe codes, the index width, when 16-byte
// loads are safe, and how the decode kernels spread N outputs over
// threadgroups.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <algorithm>
#include <cstdint>

namespace mps_ext {

// Decode kernels take 1 to 8 activation rows, in variants for 1, 2, 4, 8.
constexpr int64_t kMaxDecodeRows = 8;

// Threadgroups a launch aims at: 4 per core of an 80-core M3 Ultra (several
// per core keep every core streaming).
constexpr int64_t kTargetThreadgroups = 4 * 80;

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

// Index width. Apple GPUs have native 32-bit integer arithmetic; 64-bit
// multiplies take several instructions and 64-bit divides are a software
// loop. So kernels come in a 32-bit variant, used whenever every index and
// offset they compute fits in 31 bits, and a 64-bit variant for bigger
// tensors and views.
// The largest value a 32-bit variant may compute: 2^31 - 1, unless a test
// lowered it (set_index_limit) to run the 64-bit variants on small tensors.
int64_t index_limit();
// Test hook; a limit <= 0 restores 2^31 - 1.
void set_index_limit(int64_t limit);

inline bool fits_32bit(int64_t largest) { return largest <= index_limit(); }

// 16-byte loads need the address the kernel sees 16-byte aligned, as well as
// the stride (in elements; 0: a single row). That address is, on CPU, the
// memory itself (torch.frombuffer, numpy arrays and memory-mapped
// checkpoints can be 8-byte aligned); on MPS, the buffer (which Metal
// aligns) plus the storage offset it is bound at.
inline bool base_aligned16(const at::Tensor& t) {
  const uint64_t base = t.is_cpu() ? reinterpret_cast<uintptr_t>(t.data_ptr()) : t.storage_offset() * t.itemsize();
  return base % 16 == 0;
}
inline bool aligned16(const at::Tensor& t, int64_t stride) {
  return base_aligned16(t) && (stride * t.itemsize()) % 16 == 0;
}

// Decode geometry (fp8_mm.metal's fp8_gemv; gemv.metal's gemv_rows has its
// own, linear.cpp): a threadgroup of 1 or 2 simdgroups computes `outputs`
// outputs, N / kTargetThreadgroups rounded down to a power of two and
// clamped to 1 .. 2 * max_per_simdgroup, so that N >= 2048 gives at least
// kTargetThreadgroups threadgroups.
struct DecodeGeometry {
  int64_t threadgroups, simdgroups, outputs_per_simdgroup;
};
inline DecodeGeometry decode_geometry(int64_t n, int64_t max_per_simdgroup) {
  int64_t outputs = 1;
  while (outputs * 2 <= std::min(n / kTargetThreadgroups, 2 * max_per_simdgroup)) outputs *= 2;
  const int64_t simdgroups = outputs >= 2 ? 2 : 1;
  return {ceil_div(n, outputs), simdgroups, outputs / simdgroups};
}

}  // namespace mps_ext
