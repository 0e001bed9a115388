// The CPU Metal executor's engine: loads a shader library built by
// executor/mps_ext_executor/_compiler.py and runs dispatches of its kernels on the
// CPU with Metal's execution model, checked. Plain C++ (no torch), so that
// both the Python binding and the op layer's executor backend call it.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "mx_abi.h"

namespace cpu_metal {

// Errors a kernel makes while it runs. All derive from KernelError.
struct KernelError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct OutOfBoundsError : KernelError {
  using KernelError::KernelError;
};
struct MisalignedAccessError : KernelError {
  using KernelError::KernelError;
};
struct BarrierDivergenceError : KernelError {
  using KernelError::KernelError;
};
struct RaceError : KernelError {
  using KernelError::KernelError;
};
// A dispatch that Metal would refuse: wrong arguments, bad grid, too much
// threadgroup memory.
struct DispatchError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

// What one [[buffer(i)]] is bound to.
struct Binding {
  enum class Kind { kNone, kMemory, kBytes };
  Kind kind = Kind::kNone;
  void* data = nullptr;        // kMemory: the caller's memory; the kernel writes it
  uint64_t size = 0;           // kMemory: bytes from data to the end of the storage
  std::vector<uint8_t> bytes;  // kBytes: constant data (setBytes)
  // kMemory: bytes from the start of the storage (a tensor's storage offset)
  // to data. A GPU buffer starts page-aligned, so the 128-byte cache lines
  // of the coalescing counter are counted from data - origin.
  uint64_t origin = 0;

  static Binding memory(void* data, uint64_t size, uint64_t origin = 0) {
    Binding b;
    b.kind = Kind::kMemory;
    b.data = data;
    b.size = size;
    b.origin = origin;
    return b;
  }
  static Binding constant_bytes(const void* data, uint64_t size) {
    Binding b;
    b.kind = Kind::kBytes;
    b.bytes.assign(static_cast<const uint8_t*>(data), static_cast<const uint8_t*>(data) + size);
    b.size = size;
    return b;
  }
};

using Size3 = std::array<uint32_t, 3>;

struct Dispatch {
  std::vector<Binding> buffers;  // index i binds [[buffer(i)]]
  // dispatchThreadgroups: `threadgroups`; dispatchThreads: `threads` (then
  // `use_threads` and non-uniform edge threadgroups).
  Size3 threadgroups{1, 1, 1};
  Size3 threads{1, 1, 1};
  bool use_threads = false;
  Size3 threads_per_threadgroup{1, 1, 1};
  std::vector<uint64_t> threadgroup_memory;  // bytes of [[threadgroup(i)]]
  uint64_t seed = 0;                         // order in which threads of a threadgroup run
  // Run on copies of the buffers placed far apart in memory, so that any
  // out-of-bounds access is caught and attributed to its buffer. Off, the
  // kernel runs on the caller's memory and bounds are checked only near each
  // buffer (for tensors too large to copy).
  bool isolate = true;
  // Measure coalescing and threadgroup-memory bank conflicts (slower; also
  // on for every dispatch while a recorder that asks for them is active).
  bool counters = false;
};

// What a kernel costs a GPU, from its optimised IR (executor/mps_ext_executor/_analysis.py).
struct KernelInfo {
  uint32_t registers = 0;            // 32-bit registers live per thread at the peak
  uint32_t uniform_registers = 0;    // values the same for the whole dispatch
  uint32_t private_bytes = 0;        // thread-private arrays that stay in stack memory
  uint32_t loads_in_flight = 0;      // independent device loads per iteration of the hot loop
  std::string hot_loop;              // its source position, "" if none
  uint32_t loads_after_barrier = 0;  // device loads of a loop's iteration waiting behind a threadgroup barrier
};

struct Stats {
  std::string kernel;
  Size3 threadgroups{};
  Size3 threads_per_threadgroup{};
  uint64_t threads = 0;
  uint64_t barriers = 0;                // threadgroup barriers completed (per threadgroup)
  uint64_t simdgroup_barriers = 0;      // simdgroup barriers completed (per simdgroup)
  uint64_t simd_operations = 0;         // simd functions completed (per simdgroup)
  std::vector<uint64_t> bytes_read;     // per buffer index
  std::vector<uint64_t> bytes_written;  // per buffer index
  // per buffer index: access width in bytes -> number of accesses
  std::vector<std::map<uint32_t, uint64_t>> read_widths, write_widths;
  uint64_t threadgroup_bytes_read = 0, threadgroup_bytes_written = 0;
  std::vector<bool> bound_from_bytes;     // per buffer index: constant data, not memory
  std::vector<std::string> buffer_names;  // per buffer index: the kernel's parameter name
  KernelInfo kernel_info;
  // 64-bit integer work the threads executed (see count_int64 in
  // _instrument.py): totals, and the most one thread did.
  uint64_t int64_divisions = 0, int64_multiplications = 0;
  uint64_t max_int64_divisions = 0, max_int64_multiplications = 0;
  // 32-bit (and narrower) integer divisions and remainders by a run-time
  // value, and IEEE float divisions: totals and the most one thread did.
  uint64_t int32_divisions = 0, float_divisions = 0;
  uint64_t max_int32_divisions = 0, max_float_divisions = 0;
  // The most threadgroup memory (bytes) one threadgroup allocated: the
  // [[threadgroup(i)]] buffers and the kernel's threadgroup variables.
  uint64_t threadgroup_memory = 0;
  // Compute (always counted; docs/dev/contributing.md, "Compute efficiency"):
  // IR instructions of the shader's own code the threads executed (total,
  // and the most one thread did), and the simdgroup_matrix operations the
  // simdgroups completed: 8x8x8 multiply-accumulates (those with 32-bit
  // operands also in simdgroup_mmas_32), and loads and stores by the memory
  // they move between the matrix and threadgroup or device memory.
  uint64_t instructions = 0, max_instructions = 0;
  uint64_t simdgroup_mmas = 0, simdgroup_mmas_32 = 0;
  uint64_t matrix_loads_threadgroup = 0, matrix_loads_device = 0;
  uint64_t matrix_stores_threadgroup = 0, matrix_stores_device = 0;
  // Measured only with Dispatch::counters (or a recorder asking for them):
  bool counters = false;
  // per buffer index: 128-byte lines the memory instructions of each
  // simdgroup touched, and the fewest lines their bytes could have taken
  std::vector<uint64_t> cache_lines, cache_lines_minimum;
  uint64_t threadgroup_memory_instructions = 0;  // executed by a simdgroup
  uint64_t bank_conflict_cycles = 0;             // extra cycles of those over conflict-free
  // per buffer index: the distinct bytes each threadgroup read, summed over
  // threadgroups (re-reads by other threadgroups count, by the same one not),
  // and the distinct bytes read by the whole dispatch
  std::vector<uint64_t> threadgroup_bytes_read_distinct, unique_bytes_read;
};

class Library {
 public:
  // dlopen a library built by _compiler.py.
  static std::shared_ptr<Library> load(const std::string& path);
  ~Library();

  std::vector<std::string> function_names() const;
  const mx_kernel& kernel(const std::string& name) const;  // throws DispatchError
  const std::string& path() const { return path_; }

  Stats dispatch(const std::string& name, const Dispatch& dispatch) const;
  KernelInfo kernel_info(const std::string& name) const;  // throws DispatchError

  // Source position ("file:line:col") of an instrumented access.
  std::string site(uint32_t index) const;

 private:
  Library() = default;
  void* handle_ = nullptr;
  std::string path_;
  const mx_kernel* kernels_ = nullptr;
  uint32_t kernel_count_ = 0;
  const char* const* sites_ = nullptr;
  uint32_t site_count_ = 0;
  const mx_u64* frames_ = nullptr;  // per kernel: thread-private bytes it may need
  uint32_t frame_count_ = 0;
  const mx_kernel_info* infos_ = nullptr;  // per kernel: static costs
  uint32_t info_count_ = 0;
};

// Every dispatch made while a recorder is active is appended to it
// (`with cpu_metal.record()`), from Python or C++ alike. A recorder that
// asks for counters turns on Dispatch::counters for every dispatch while it
// is active.
struct Recorder {
  bool counters = false;
  std::vector<Stats> dispatches;
};
void start_recording(const std::shared_ptr<Recorder>& recorder);
void stop_recording(const std::shared_ptr<Recorder>& recorder);

// Number of CPU threads that run threadgroups in parallel.
unsigned worker_count();

}  // namespace cpu_metal
