// The interface between the CPU Metal executor's engine (csrc/cpu_metal, part
// of the Python extension) and a shader library (a shared object built from MSL
// by executor/mps_ext_executor/_compiler.py).
//
// Included by both sides: by the engine as C++, and by every shader translation
// unit, which is compiled freestanding (no system headers), hence the plain
// integer typedefs. Bump MX_ABI_VERSION whenever a layout here changes; the
// compiler folds this file into its cache key and the engine refuses a library
// built against another version.
#ifndef MX_ABI_H
#define MX_ABI_H

#define MX_ABI_VERSION 8u

typedef unsigned int mx_u32;
typedef unsigned long long mx_u64;
typedef long long mx_i64;

enum {
  MX_MAX_BUFFERS = 31,     // Metal's buffer argument table has 31 entries
  MX_MAX_TG_BUFFERS = 31,
  MX_SIMD_WIDTH = 32,
};

// Flags of one instrumented memory access (__mx_access). The instrumenter
// (_instrument.py) writes these bits; keep the two in step.
enum {
  MX_ACC_READ = 1u,
  MX_ACC_WRITE = 2u,
  MX_ACC_ATOMIC = 4u,
  MX_ACC_ALIGN_SHIFT = 4,  // bits 4..7: log2 of the alignment the code assumed
  MX_ACC_SITE_SHIFT = 8,   // bits 8..31: index into the library's site table
};

// Scopes of __mx_api->barrier.
enum { MX_SCOPE_THREADGROUP = 0u, MX_SCOPE_SIMDGROUP = 1u };
// Bits of the mem_flags argument of a barrier (values of metal::mem_flags).
enum { MX_MEM_DEVICE = 1u, MX_MEM_THREADGROUP = 2u };

// Flags of a simd operation.
enum {
  MX_SIMD_UNIFORM = 1u,  // every lane of the simdgroup must take part
                         // (simdgroup_matrix operations, simdgroup_barrier)
  MX_SIMD_MATRIX = 2u,   // a simdgroup_matrix operation: needs 32 lanes
  // Which simdgroup_matrix operation, for the engine's compute counters
  // (Stats::matrix_*): a load or store passes the address of the memory as
  // `arg` (the engine tells threadgroup from device memory by it); an
  // MMA says whether its operands are 32-bit (they take longer to issue).
  MX_SIMD_MATRIX_LOAD = 4u,
  MX_SIMD_MATRIX_STORE = 8u,
  MX_SIMD_MATRIX_MMA = 16u,
  MX_SIMD_MATRIX_MMA_32 = 32u,
};

// Flags of a float-to-integer conversion check (__mx_convert_check): the
// integer's width and signedness, and the site of the conversion.
enum {
  MX_CONV_SIGNED = 0x80u,    // bits 0..6: the integer's width in bits
  MX_CONV_SITE_SHIFT = 8,    // bits 8..31: index into the site table
};

// What an integer division or remainder of shader code did wrong
// (__mx_arith_check); the flags are laid out as MX_CONV_*.
enum {
  MX_ARITH_DIVIDE_BY_ZERO = 0u,
  MX_ARITH_OVERFLOW = 1u,           // the smallest signed value divided by -1
  MX_ARITH_NEGATIVE_REMAINDER = 2u,  // `%` with a negative operand
};

typedef struct mx_uint3 { mx_u32 x, y, z; } mx_uint3;

// What one kernel invocation (one Metal thread) sees. The cost analysis
// (_analysis.py, _INFO_TABLES and _INFO_UNIFORM) knows the byte offsets of
// the tables and of the grid-wide fields: keep it in step.
typedef struct mx_thread_info {
  void* const* buffers;     // [MX_MAX_BUFFERS] [[buffer(i)]] base addresses
  void* const* tg_buffers;  // [MX_MAX_TG_BUFFERS] [[threadgroup(i)]] addresses
  mx_uint3 thread_position_in_grid;
  mx_uint3 thread_position_in_threadgroup;
  mx_uint3 threadgroup_position_in_grid;
  mx_uint3 threads_per_threadgroup;           // this threadgroup's actual size
  mx_uint3 dispatch_threads_per_threadgroup;  // the size asked for at dispatch
  mx_uint3 threadgroups_per_grid;
  mx_uint3 threads_per_grid;
  mx_u32 thread_index_in_threadgroup;
  mx_u32 thread_index_in_simdgroup;
  mx_u32 simdgroup_index_in_threadgroup;
  mx_u32 simdgroups_per_threadgroup;
} mx_thread_info;

// One lane's part in a simd operation. `in` is null for a lane that is not
// active in the operation (exited, or elsewhere in divergent code).
typedef struct mx_simd_lane {
  const void* in;
  void* out;
  mx_i64 arg;
} mx_simd_lane;

// Computes the results of one simd operation for a whole simdgroup at once:
// reads lanes[i].in and writes lanes[i].out for every active lane i.
// `lane_count` is the simdgroup's size (smaller for a partial last one).
typedef void (*mx_simd_fn)(const mx_simd_lane* lanes, mx_u32 active_mask,
                           mx_u32 lane_count);

// Services of the engine, called by shader code. Each blocking call returns
// once every thread it waits for has arrived; an error never returns.
//
// Where a thread is, for matching the threads of a simd operation or barrier
// (the SIMT position): the instrumenter (_instrument.py) brackets every call
// of shader code that can reach one with enter/leave, and calls `loop` at the
// header of every loop that contains such a call. `key` orders the calls and
// loops of one function as control flow does; `site` indexes the site table;
// `depth` is how many such loops of the function enclose the call or loop.
typedef struct mx_engine_api {
  mx_u32 abi_version;
  void (*access)(const void* address, mx_u64 size, mx_u32 flags);
  void (*barrier)(mx_u32 scope, mx_u32 mem_flags);
  void (*simd)(mx_simd_fn fn, const void* in, void* out, mx_i64 arg,
               mx_u32 flags);
  // Storage of a `threadgroup` variable declared inside a function; `key`
  // tells the declarations apart.
  void* (*threadgroup_variable)(const void* key, mx_u64 size, mx_u64 align);
  void (*fail)(const char* message);
  // The thread (fiber) running right now.
  const mx_thread_info* (*current_thread)(void);
  void (*enter)(mx_u32 key, mx_u32 site, mx_u32 depth);
  void (*leave)(void);
  void (*loop)(mx_u32 key, mx_u32 site, mx_u32 depth);
  // A float-to-integer conversion of a NaN or out-of-range value. `flags`
  // are MX_CONV_*; the place is the site in the flags (instrumented shader
  // code) or, if `file` is not null, file:line:col (a vector constructor).
  void (*conversion_error)(mx_u32 flags, const char* file, mx_u32 line, mx_u32 col);
  // atomic_thread_fence: a fence over the given memory (mem_flags bits).
  void (*fence)(mx_u32 mem_flags);
  // The running thread's counters of arithmetic work (MX_OPS_*), which
  // the instrumenter increments (_instrument.py, count_int64).
  mx_u64* (*op_counts)(void);
  // An integer division or remainder whose result Metal leaves unspecified
  // or undefined: `kind` is MX_ARITH_*, `flags` as for conversion_error.
  void (*arithmetic_error)(mx_u32 kind, mx_u32 flags);
} mx_engine_api;

// Indices into op_counts().
enum {
  MX_OPS_INT64_DIVISIONS = 0,  // sdiv/udiv/srem/urem of 64-bit integers by a run-time value
  MX_OPS_INT64_MULTIPLICATIONS = 1,  // mul of 64-bit integers, and divisions by a constant
  MX_OPS_INT32_DIVISIONS = 2,  // sdiv/udiv/srem/urem of 32-bit (or narrower) integers by a run-time value
  MX_OPS_FLOAT_DIVISIONS = 3,  // fdiv of float or half without fast-math flags (IEEE-rounded)
  MX_OPS_INSTRUCTIONS = 4,  // IR instructions of shader code executed (count_ops: the issue-slot estimate)
  MX_OPS_COUNT = 5,
};

// Parameter descriptions generated for each kernel.
enum {
  MX_PARAM_BUFFER = 1u,
  MX_PARAM_THREADGROUP = 2u,
  MX_PARAM_BUILTIN = 3u,
};
enum {
  MX_PARAM_REFERENCE = 1u,  // `constant T& p [[buffer(i)]]`
  MX_PARAM_READONLY = 2u,   // constant address space, or pointer to const
};
enum {
  MX_AS_NONE = 0u,
  MX_AS_DEVICE = 1u,
  MX_AS_CONSTANT = 2u,
  MX_AS_THREADGROUP = 3u,
};

typedef struct mx_param {
  const char* name;
  mx_u32 kind;           // MX_PARAM_*
  mx_u32 index;          // buffer or threadgroup index
  mx_u32 address_space;  // MX_AS_*
  mx_u32 flags;          // MX_PARAM_REFERENCE | MX_PARAM_READONLY
  mx_u64 pointee_size;   // sizeof the pointed-to or referenced type
} mx_param;

typedef struct mx_kernel {
  const char* name;  // host name
  void (*entry)(const mx_thread_info*);
  const mx_param* params;
  mx_u32 param_count;
  mx_u32 max_total_threads_per_threadgroup;  // 0: no attribute
} mx_kernel;

// Static costs of one kernel (see _analysis.py).
typedef struct mx_kernel_info {
  mx_u32 registers;          // 32-bit registers live per thread at the peak
  mx_u32 uniform_registers;  // values the same for the whole dispatch, at their peak
  mx_u32 private_bytes;      // thread-private arrays that stay in (stack) memory
  mx_u32 loads_in_flight;    // independent device loads per iteration of the hot loop
  const char* hot_loop;      // "file:line:col" of that loop, "" if none
  mx_u32 loads_after_barrier;  // device loads of a loop's iteration that wait behind a threadgroup barrier
} mx_kernel_info;

// Symbols every shader library exports (extern "C").
#define MX_LIBRARY_ABI_SYMBOL "mx_library_abi"          // mx_u32 (void)
#define MX_LIBRARY_BIND_SYMBOL "mx_library_bind"        // void (const mx_engine_api*)
#define MX_LIBRARY_KERNELS_SYMBOL "mx_library_kernels"  // const mx_kernel* (mx_u32*)
#define MX_LIBRARY_SITES_SYMBOL "mx_library_sites"      // const char* const* (mx_u32*)
// Thread-private bytes (an upper bound of the stack) each kernel needs, in
// the order of mx_library_kernels.
#define MX_LIBRARY_FRAMES_SYMBOL "mx_library_frames"    // const mx_u64* (mx_u32*)
// What each kernel costs a GPU, from its optimised IR (_analysis.py), in the
// order of mx_library_kernels.
#define MX_LIBRARY_KERNEL_INFO_SYMBOL "mx_library_kernel_info"  // const mx_kernel_info* (mx_u32*)

#endif
