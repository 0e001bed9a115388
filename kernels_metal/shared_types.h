// Included by the Metal kernels and by the C++ ops (csrc/ops), so that a
// parameter struct has one definition, compiled by both compilers. Only
// fixed-width types here: their size and alignment are the same in MSL and
// in C++ on arm64 and x86-64.
#pragma once

#ifdef __METAL_VERSION__
#include <metal_stdlib>
#else
#include <cstdint>
#endif

// Most dimensions a kernel's index arithmetic handles; ops with more fall
// back to the stock kernel.
#define MPS_EXT_MAX_DIMS 8
