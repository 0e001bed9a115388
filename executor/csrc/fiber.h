// Minimal stackful coroutines for the executor: the threads of one Metal
// threadgroup run as fibers on one CPU thread and hand over at barriers and
// simd operations. A switch saves only the callee-saved registers, so it
// costs a few nanoseconds (ucontext would make a system call per switch).
#pragma once

#include <cstddef>

namespace cpu_metal {

// Save the current context's stack pointer to *save and continue on the
// context whose stack pointer is `to`.
extern "C" void mx_fiber_switch(void** save, void* to);

// Prepare a fresh context on the stack [base, base + size): the first switch
// to the returned stack pointer calls fn(arg), which must never return.
void* fiber_prepare(void* base, size_t size, void (*fn)(void*), void* arg);

// A stack with a guard page below it.
struct FiberStack {
  void* base = nullptr;  // usable memory, above the guard page
  size_t size = 0;
  static FiberStack allocate(size_t size);
  void release();
};

}  // namespace cpu_metal
