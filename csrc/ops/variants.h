// What decides between the variants of a kernel, shared by the ops.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace mps_ext {

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

// Alignment. A kernel may use 16-byte loads and stores only where the address
// it sees is 16-byte aligned: on CPU (the executor) that is the memory itself
// (torch.frombuffer, numpy arrays and memory-mapped checkpoints can be
// 8-byte aligned); on MPS, the buffer (which Metal aligns) plus the storage
// offset it is bound at.
inline bool base_aligned16(const at::Tensor& t) {
  const uint64_t base = t.is_cpu() ? reinterpret_cast<uintptr_t>(t.data_ptr()) : t.storage_offset() * t.itemsize();
  return base % 16 == 0;
}
// ... and every step of `stride` elements keeps it so.
inline bool aligned16(const at::Tensor& t, int64_t stride) {
  return base_aligned16(t) && (stride * t.itemsize()) % 16 == 0;
}

}  // namespace mps_ext
