// The CPU Metal executor's engine: loads a shader library built by
// mps_ext/cpu_metal/_compiler.py and runs dispatches of its kernels on the
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
  void* data = nullptr;  // kMemory: the caller's memory; the kernel writes it
  uint64_t size = 0;     // kMemory: bytes from data to the end of the storage
  std::vector<uint8_t> bytes;  // kBytes: constant data (setBytes)

  static Binding memory(void* data, uint64_t size) {
    Binding b;
    b.kind = Kind::kMemory;
    b.data = data;
    b.size = size;
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
  uint64_t seed = 0;  // order in which threads of a threadgroup run
  // Run on copies of the buffers placed far apart in memory, so that any
  // out-of-bounds access is caught and attributed to its buffer. Off, the
  // kernel runs on the caller's memory and bounds are checked only near each
  // buffer (for tensors too large to copy).
  bool isolate = true;
};

struct Stats {
  std::string kernel;
  Size3 threadgroups{};
  Size3 threads_per_threadgroup{};
  uint64_t threads = 0;
  uint64_t barriers = 0;            // threadgroup barriers completed (per threadgroup)
  uint64_t simdgroup_barriers = 0;  // simdgroup barriers completed (per simdgroup)
  uint64_t simd_operations = 0;     // simd functions completed (per simdgroup)
  std::vector<uint64_t> bytes_read;     // per buffer index
  std::vector<uint64_t> bytes_written;  // per buffer index
  // per buffer index: access width in bytes -> number of accesses
  std::vector<std::map<uint32_t, uint64_t>> read_widths, write_widths;
  uint64_t threadgroup_bytes_read = 0, threadgroup_bytes_written = 0;
  std::vector<bool> bound_from_bytes;  // per buffer index: constant data, not memory
  std::vector<std::string> buffer_names;  // per buffer index: the kernel's parameter name
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
};

// Every dispatch made while a recorder is active is appended to it
// (`with cpu_metal.record()`), from Python or C++ alike.
struct Recorder {
  std::vector<Stats> dispatches;
};
void start_recording(const std::shared_ptr<Recorder>& recorder);
void stop_recording(const std::shared_ptr<Recorder>& recorder);

// Number of CPU threads that run threadgroups in parallel.
unsigned worker_count();

}  // namespace cpu_metal
