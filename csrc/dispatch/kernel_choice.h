// What the op files share when they choose a kernel: the threads a
// kernel's pipeline allows, a dtype's name in kernel names, torch's scale
// recipe codes, the index width, when 16-byte loads are safe, and how the
// decode kernels spread N outputs over threadgroups.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include "backend/launch.h"
#include "decode_params.h"

#include <algorithm>
#include <cstdint>
#include <string>

namespace mps_ext {

// Threads a threadgroup of `kernel` (of `library`) may have on `device`,
// asked before choosing the geometry of a launch that can adapt: its
// pipeline's own limit there, at most `declared` (the kernel's
// [[max_total_threads_per_threadgroup]]), in whole simdgroups. A pipeline's
// maxTotalThreadsPerThreadgroup depends on the kernel's registers and
// threadgroup memory (Apple computes it when the pipeline is built), so it
// can be below the declared count on a real GPU although the executor's
// register estimate fits it. Throws BackendUnavailable when the kernel
// cannot run here: its library or pipeline failed to build, or the pipeline
// allows fewer than `least` threads (a multiple of 32), the fewest the
// launch works with at any shape (route() then remembers the kernel as
// unavailable). docs/dev/contributing.md, "Threadgroup sizes".
inline int64_t thread_budget(const c10::Device& device, const std::string& library, const std::string& kernel,
                             int64_t declared, int64_t least = 32) {
  const uint64_t limit = pipeline(device, library, kernel).max_threads_per_threadgroup;
  const int64_t budget = static_cast<int64_t>(std::min<uint64_t>(limit, static_cast<uint64_t>(declared))) / 32 * 32;
  if (budget < least) throw too_few_threads(library, kernel, limit, "at least " + std::to_string(least));
  return budget;
}

// Decode kernels take 1 to 8 activation rows, in variants for 1, 2, 4, 8.
constexpr int64_t kMaxDecodeRows = 8;

// Threadgroups a launch aims at: 4 per core (several per core keep every
// core streaming).
inline int64_t target_threadgroups(const DeviceProfile& gpu) { return 4 * gpu.cores; }

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

// The geometry of the one decode kernel template (kernels_metal/decode.h:
// gemv_rows, fp8_gemv, gmm_decode_rows): a threadgroup of `simdgroups`
// simdgroups, each owning `outputs_per_simdgroup` outputs (1 or 2: their
// accumulators are R x that many), all sharing one staged copy of the
// activation rows.
// - n: outputs of one chunk of rows; chunks: chunks of rows that work at
//   once (1; a grouped product's groups that can have rows), so that the
//   whole launch aims at target_threadgroups.
// - O, the outputs of a threadgroup: n * chunks / target_threadgroups, and at
//   least `reuse`, the O at which the activation bytes a threadgroup stages
//   equal its weight bytes (rows x activation size / weight size): the
//   activation traffic from the caches stays within the weight's (issue 21).
//   Clamped to 1 .. DECODE_MAX_SIMDGROUPS * q_max. Where n / reuse
//   threadgroups are fewer than the cores, some cores stay idle rather than
//   re-read the activations: the busiest core then streams one threadgroup's
//   (reuse x weight + rows x activation) bytes per element of K, no more than
//   the two smaller threadgroups some cores got when O stopped at n / cores
//   (fp8 weights, 8 rows, N = 768 on 80 cores: 32 instead of 50 bytes per K
//   with bfloat activations, 64 instead of 82 with float; 86 threadgroups
//   over 80 cores meant 6 cores with two), and every core reads 1.8x (bfloat)
//   / 3.6x (float) fewer activation bytes than the weight's from the caches
//   that all cores share. docs/decode.md, "Geometry".
// - outputs per simdgroup: q_max from O >= 2 q_max on (two outputs share each
//   activation word a lane reads), 1 below; `q_fixed` kernels always own q_max.
struct DecodeGeometry {
  int64_t threadgroups, simdgroups, outputs_per_simdgroup;
};
inline DecodeGeometry decode_geometry(const DeviceProfile& gpu, int64_t n, int64_t chunks, int64_t q_max, bool q_fixed,
                                      int64_t reuse) {
  const int64_t work = n * std::max<int64_t>(chunks, 1);
  // reuse up to a power of two: N is a multiple of one in the models, so
  // the last threadgroup is whole too (3 rows with 3 outputs a threadgroup
  // read 1.03 times the weight bytes of N = 64: a last one with 1 output).
  int64_t whole = 1;
  while (whole < reuse) whole *= 2;
  int64_t outputs = std::max(work / target_threadgroups(gpu), whole);
  outputs = std::clamp<int64_t>(outputs, 1, DECODE_MAX_SIMDGROUPS * q_max);
  const int64_t q = q_fixed || outputs >= 2 * q_max ? q_max : 1;
  const int64_t simdgroups = std::clamp<int64_t>(outputs / q, 1, DECODE_MAX_SIMDGROUPS);
  return {ceil_div(n, simdgroups * q), simdgroups, q};
}

// `g` within a threadgroup of at most `max_threads` (thread_budget of the
// kernel it chose, whose name holds g's outputs per simdgroup): fewer
// simdgroups, as many more threadgroups. Each output's sum is its
// simdgroup's alone, so the result does not change, bit for bit; only the
// activations are staged by more threadgroups.
inline DecodeGeometry fit_threads(DecodeGeometry g, int64_t n, int64_t max_threads) {
  g.simdgroups = std::clamp<int64_t>(max_threads / 32, 1, g.simdgroups);
  g.threadgroups = ceil_div(n, g.simdgroups * g.outputs_per_simdgroup);
  return g;
}

// The cols kernel (decode.h, decode_cols: gemv_cols, gmm_decode_cols): the
// columns of a threadgroup, 128 bytes of each weight row with 16-byte loads
// (8 lanes), 32 elements without.
inline int64_t decode_cols_columns(bool vec, int64_t itemsize) { return vec ? 8 * (16 / itemsize) : 32; }

}  // namespace mps_ext
