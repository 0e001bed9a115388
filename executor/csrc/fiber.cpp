#include "fiber.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>

#if defined(__APPLE__)
#define MX_SYM(name) "_" #name
#define MX_FUNC_TYPE(name)
#else
#define MX_SYM(name) #name
#define MX_FUNC_TYPE(name) ".type " #name ",@function\n"
#endif

// mx_fiber_switch(void** save, void* to): push the callee-saved registers,
// store the stack pointer in *save, load `to`, pop and return into the other
// context. mx_fiber_entry is where a prepared context first "returns" to: it
// calls fn(arg) with fn and arg parked in callee-saved registers.
#if defined(__x86_64__)
asm(".text\n"
    ".globl " MX_SYM(mx_fiber_switch) "\n" MX_FUNC_TYPE(mx_fiber_switch)
        MX_SYM(mx_fiber_switch) ":\n"
                                "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
                                "  subq $8, %rsp\n  stmxcsr (%rsp)\n  fnstcw 4(%rsp)\n"
                                "  movq %rsp, (%rdi)\n"
                                "  movq %rsi, %rsp\n"
                                "  ldmxcsr (%rsp)\n  fldcw 4(%rsp)\n  addq $8, %rsp\n"
                                "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n"
                                "  ret\n"
                                ".globl " MX_SYM(mx_fiber_entry) "\n" MX_FUNC_TYPE(mx_fiber_entry)
                                    MX_SYM(mx_fiber_entry) ":\n"
                                                           "  movq %r12, %rdi\n"
                                                           "  callq *%r13\n"
                                                           "  ud2\n");
#elif defined(__aarch64__)
asm(".text\n"
    ".globl " MX_SYM(mx_fiber_switch) "\n" MX_FUNC_TYPE(mx_fiber_switch) ".p2align 2\n" MX_SYM(
        mx_fiber_switch) ":\n"
                         "  sub sp, sp, #160\n"
                         "  stp x19, x20, [sp, #0]\n  stp x21, x22, [sp, #16]\n  stp x23, x24, [sp, #32]\n"
                         "  stp x25, x26, [sp, #48]\n  stp x27, x28, [sp, #64]\n  stp x29, x30, [sp, #80]\n"
                         "  stp d8, d9, [sp, #96]\n  stp d10, d11, [sp, #112]\n  stp d12, d13, [sp, #128]\n"
                         "  stp d14, d15, [sp, #144]\n"
                         "  mov x9, sp\n  str x9, [x0]\n"
                         "  mov sp, x1\n"
                         "  ldp x19, x20, [sp, #0]\n  ldp x21, x22, [sp, #16]\n  ldp x23, x24, [sp, #32]\n"
                         "  ldp x25, x26, [sp, #48]\n  ldp x27, x28, [sp, #64]\n  ldp x29, x30, [sp, #80]\n"
                         "  ldp d8, d9, [sp, #96]\n  ldp d10, d11, [sp, #112]\n  ldp d12, d13, [sp, #128]\n"
                         "  ldp d14, d15, [sp, #144]\n"
                         "  add sp, sp, #160\n"
                         "  ret\n"
                         ".globl " MX_SYM(mx_fiber_entry) "\n" MX_FUNC_TYPE(mx_fiber_entry) ".p2align 2\n" MX_SYM(
                             mx_fiber_entry) ":\n"
                                             "  mov x0, x19\n"
                                             "  blr x20\n"
                                             "  brk #1\n");
#else
#error "the CPU Metal executor supports x86-64 and arm64"
#endif

extern "C" void mx_fiber_entry();

namespace cpu_metal {

void* fiber_prepare(void* base, size_t size, void (*fn)(void*), void* arg) {
  uintptr_t top = (reinterpret_cast<uintptr_t>(base) + size) & ~uintptr_t(15);
#if defined(__x86_64__)
  // Popped by mx_fiber_switch, low to high: mxcsr|fpcw, r15, r14, r13, r12,
  // rbx, rbp, return address. After the ret the stack is 16-byte aligned, as
  // mx_fiber_entry's call expects.
  uint64_t* sp = reinterpret_cast<uint64_t*>(top - 80);
  uint32_t mxcsr;
  uint16_t fpcw;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  asm volatile("fnstcw %0" : "=m"(fpcw));
  std::memset(sp, 0, 80);
  std::memcpy(&sp[0], &mxcsr, 4);
  std::memcpy(reinterpret_cast<char*>(&sp[0]) + 4, &fpcw, 2);
  sp[3] = reinterpret_cast<uint64_t>(fn);   // r13
  sp[4] = reinterpret_cast<uint64_t>(arg);  // r12
  sp[7] = reinterpret_cast<uint64_t>(&mx_fiber_entry);
  return sp;
#else
  uint64_t* sp = reinterpret_cast<uint64_t*>(top - 160);
  std::memset(sp, 0, 160);
  sp[0] = reinterpret_cast<uint64_t>(arg);               // x19
  sp[1] = reinterpret_cast<uint64_t>(fn);                // x20
  sp[11] = reinterpret_cast<uint64_t>(&mx_fiber_entry);  // x30
  return sp;
#endif
}

FiberStack FiberStack::allocate(size_t size) {
  size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  size = (size + page - 1) / page * page;
  // Reserved, not committed: a kernel with large private arrays gets large
  // stacks, of which only the pages it touches cost memory.
  void* p = mmap(nullptr, size + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) throw std::runtime_error("CPU Metal executor: cannot allocate a fiber stack");
  mprotect(p, page, PROT_NONE);  // overflow faults instead of corrupting
  FiberStack s;
  s.base = static_cast<char*>(p) + page;
  s.size = size;
  return s;
}

void FiberStack::release() {
  if (!base) return;
  size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  munmap(static_cast<char*>(base) - page, size + page);
  base = nullptr;
}

}  // namespace cpu_metal
