// Included by the Metal kernels and by the C++ ops (csrc/ops), so that a
// parameter struct has one definition, compiled by both compilers. Only
// fixed-width types here: their size and alignment are the same in MSL and
// in C++ on arm64 and x86-64.
#pragma once

#ifdef __METAL_VERSION__
#include <metal_stdlib>
// A thread's small arrays (the elements it holds, its accumulators) stay in
// registers only if every index into them is known at compile time: so the
// helpers that take them are always inlined (Apple's own headers declare
// their functions so, METAL_FUNC) and the loops over them fully unrolled.
// Otherwise the array lives in stack memory.
#define MPS_EXT_INLINE inline __attribute__((__always_inline__))
#define MPS_EXT_UNROLL _Pragma("clang loop unroll(full)")
#else
#include <cstdint>
#endif

// Most dimensions a kernel's index arithmetic handles; ops with more fall
// back to the stock kernel.
#define MPS_EXT_MAX_DIMS 8
