// Which index width a kernel variant computes in. Apple GPUs have native
// 32-bit integer arithmetic; 64-bit multiplies take several instructions and
// 64-bit divides are a software loop. So kernels come in a 32-bit variant,
// used whenever every index and offset they compute fits in 31 bits, and a
// 64-bit variant for bigger tensors and views.
#pragma once

#include <cstdint>

namespace mps_ext {

// The largest value a 32-bit variant may compute: 2^31 - 1, unless a test
// lowered it (set_index_limit) to run the 64-bit variants on small tensors.
int64_t index_limit();
// Test hook; a limit <= 0 restores 2^31 - 1.
void set_index_limit(int64_t limit);

inline bool fits_32bit(int64_t largest) { return largest <= index_limit(); }

}  // namespace mps_ext
