// The CPU Metal executor's engine. See engine.h for the interface and
// mx_abi.h for what a shader library provides and calls.
//
// Execution model
// - Threadgroups are spread over a pool of CPU threads ("workers"), started in
//   a seeded random order (a permutation of the grid, computed, not stored).
// - The threads of one threadgroup ("lanes") run as fibers on one worker, in
//   a seeded random order, each until it finishes, blocks at a barrier or a
//   simd operation, or yields at an atomic operation (so that a lane spinning
//   on an atomic lets the others run). A lane gets a stack only when it
//   first runs, and a lane that finishes hands its stack to the next one, so
//   kernels without barriers need one stack per worker. Stacks are as large
//   as the kernel's thread-private memory needs (mx_library_frames).
// - Every lane has a SIMT position: the stack of calls and loop iterations
//   that brought it where it is (the instrumenter reports calls and loop
//   headers that lead to simd operations and barriers; see _instrument.py).
//   Positions compare lexicographically, in control-flow order within a
//   function, then by iteration. When every lane is blocked or done, per
//   simdgroup the lanes at the smallest position form the active set and
//   their simd operation completes, as a GPU runs the lanes on one path
//   together and reconverges them after an if, a loop or a call. A
//   threadgroup barrier opens when every lane that has not finished waits
//   at it at the same position (same call path, same iterations); anything
//   else is a BarrierDivergenceError.
// - A watchdog: a threadgroup in which no lane finishes and no barrier opens
//   for MPS_EXT_EXECUTOR_WATCHDOG_SECONDS (default 60) is an error naming the
//   kernel (a spin-wait that never ends, or one that waits for another
//   threadgroup, which Metal does not promise to run at the same time).
// - Floating point as on Apple GPUs: fp32 (and so bfloat) denormals are
//   flushed to zero, on input and output, while a threadgroup runs (MXCSR
//   FTZ|DAZ on x86-64, FPCR.FZ on arm64); half keeps its denormals (they are
//   normal numbers in float). Evidence: on MPS `nextafter(0, 1) > 0` is false
//   in fp32 (pytorch/pytorch#125051); MLX reduces fp32 and bfloat16 denormals
//   as zeros on Metal even with -fno-fast-math, while float16 is unaffected
//   (ml-explore/mlx#4205). Converting a float denormal to bfloat gives a
//   zero too: "the float -> bfloat convert (a single fptrunc) flushes
//   subnormal results", measured over all inputs on MPS
//   (pytorch/pytorch#193897). The CPU converts by integer rounding, which
//   FTZ does not reach, so the instrumenter flushes its input
//   (_instrument.py). MPS_EXT_EXECUTOR_DENORMALS=keep keeps them, for
//   debugging.
//
// Checks, on every instrumented access (mx_abi.h, _instrument.py)
// - Device buffers are copied into slots of a reserved address range, 64 GiB
//   apart, so an address tells which buffer it belongs to and any access
//   outside a buffer is an OutOfBoundsError naming it; copies go back after.
// - Threadgroup memory is one arena per worker with red zones between the
//   allocations, filled with 0xFF (NaN in every float format) before each
//   threadgroup. A shadow byte map finds two lanes touching the same byte
//   between barriers, one of them writing (RaceError).
// - Device memory that a threadgroup may write (buffers with a writable
//   parameter) gets the same race check among the lanes of the threadgroup,
//   with threadgroup_barrier(mem_flags::mem_device) (or simdgroup_barrier
//   with mem_device, within a simdgroup) as what orders it: a barrier with
//   only mem_threadgroup does not. Its shadow is per worker, for the bytes
//   the threadgroup touched since its last device barrier (Worker::
//   device_races), so read-only inputs cost nothing.
// - An access less aligned than its type needs is a MisalignedAccessError.
// - A read of device memory that another threadgroup of the same dispatch
//   wrote is a RaceError unless the writer made it visible: a device fence
//   (threadgroup_barrier(mem_flags::mem_device) or atomic_thread_fence)
//   after the write, then a device atomic that writes, and after that (in
//   the order the executor ran them) a device atomic of the reader's
//   threadgroup. Metal gives device memory only threadgroup coherence
//   otherwise, so a GPU may return stale data. A shadow of 4 bytes per byte
//   records the writing threadgroup of each byte of a writable buffer copy
//   (isolated mode, buffers up to kShadowLimit).
//
// Cost counters (what a GPU pays beyond bytes; the README lists them)
// - 64-bit integer divisions and multiplications: the instrumented library
//   adds to the running lane's counters (api op_counts, Lane::ops), summed
//   and maxed over lanes when each finishes.
// - With Dispatch::counters (or a recorder that asks for them): coalescing
//   of device accesses and bank conflicts of threadgroup accesses, per
//   memory instruction a simdgroup executes (Worker::track, measure).
// - Static costs of each kernel come with the library (mx_library_kernel_info).
#include "engine.h"

#include <dlfcn.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <random>
#include <sstream>
#include <thread>
#include <unordered_map>

#include "fiber.h"

namespace cpu_metal {
namespace {

constexpr uint32_t kMaxThreads = 1024;
constexpr uint64_t kThreadgroupLimit = 32 * 1024;  // Metal's threadgroup memory limit
constexpr uint64_t kRedZone = 64;
constexpr uint64_t kArenaSize = 2 * kThreadgroupLimit + 64 * kRedZone;
constexpr int kSlotShift = 36;                    // 64 GiB per buffer slot
constexpr uint64_t kSlotMid = uint64_t(1) << 35;  // buffer copies start mid-slot
constexpr uint64_t kDirectSlack = 1 << 20;        // non-isolated: bounds checked this near a buffer

size_t page_size() {
  static size_t p = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return p;
}

// The smallest fiber stack: engine code (error messages) and the spills of
// optimised shader code run on it too.
size_t min_stack_size() {
  static size_t s = [] {
    const char* e = getenv("MPS_EXT_EXECUTOR_STACK_KB");
    size_t kb = e ? static_cast<size_t>(atol(e)) : 256;
    return std::max<size_t>(kb, 64) * 1024;
  }();
  return s;
}
constexpr uint64_t kStackMargin = 128 * 1024;
constexpr uint64_t kMaxThreadPrivate = 64ull << 20;  // per thread: beyond this, an error
constexpr uint64_t kShadowLimit = 256ull << 20;      // buffers larger than this: no visibility check

double watchdog_seconds() {
  const char* e = getenv("MPS_EXT_EXECUTOR_WATCHDOG_SECONDS");
  double s = e ? atof(e) : 60.0;
  return s > 0 ? s : 60.0;
}

bool flush_denormals() {
  const char* e = getenv("MPS_EXT_EXECUTOR_DENORMALS");
  return !(e && std::string(e) == "keep");
}

// The floating-point control register, with fp32 denormals flushed or not.
struct FpControl {
#if defined(__x86_64__)
  uint32_t saved = 0;
  explicit FpControl(bool flush) {
    asm volatile("stmxcsr %0" : "=m"(saved));
    uint32_t csr = flush ? (saved | 0x8040u) : (saved & ~0x8040u);  // FTZ (bit 15), DAZ (bit 6)
    asm volatile("ldmxcsr %0" : : "m"(csr));
  }
  ~FpControl() { asm volatile("ldmxcsr %0" : : "m"(saved)); }
#else
  uint64_t saved = 0;
  explicit FpControl(bool flush) {
    asm volatile("mrs %0, fpcr" : "=r"(saved));
    uint64_t fpcr = flush ? (saved | (1ull << 24)) : (saved & ~(1ull << 24));  // FZ; FZ16 (bit 19) stays off
    asm volatile("msr fpcr, %0" : : "r"(fpcr));
  }
  ~FpControl() { asm volatile("msr fpcr, %0" : : "r"(saved)); }
#endif
  FpControl(const FpControl&) = delete;
  FpControl& operator=(const FpControl&) = delete;
};

uint64_t now_ns() {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
          .count());
}

std::string size3(const Size3& s) {
  std::ostringstream o;
  o << "(" << s[0] << ", " << s[1] << ", " << s[2] << ")";
  return o.str();
}

uint64_t splitmix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// A seeded random permutation of [0, n) without a table: a 4-round Feistel
// network on the smallest even number of bits that covers n, walked until
// it lands inside [0, n) (fewer than 4 steps on average).
class Permutation {
 public:
  Permutation(uint64_t n, uint64_t seed) : n_(n) {
    int bits = 0;
    while (bits < 64 && (uint64_t(1) << bits) < n) ++bits;
    half_ = std::max(1, (bits + 1) / 2);
    mask_ = (uint64_t(1) << half_) - 1;
    for (int r = 0; r < 4; ++r) keys_[r] = splitmix(seed * 4 + r + 0x5eed);
  }
  uint64_t operator()(uint64_t i) const {
    do i = round_trip(i);
    while (i >= n_);
    return i;
  }

 private:
  uint64_t round_trip(uint64_t x) const {
    uint64_t l = x >> half_, r = x & mask_;
    for (int k = 0; k < 4; ++k) {
      uint64_t f = splitmix(r ^ keys_[k]) & mask_;
      uint64_t nl = r;
      r = l ^ f;
      l = nl;
    }
    return (l << half_) | r;
  }
  uint64_t n_;
  int half_;
  uint64_t mask_;
  uint64_t keys_[4];
};

// ------------------------------------------------------------------ slots --
// One reserved range holds the isolated copies of all buffers of a dispatch.
struct SlotRegion {
  char* base = nullptr;
  uint64_t span = 0;
  SlotRegion() {
    span = uint64_t(MX_MAX_BUFFERS + 1) << kSlotShift;
    void* p = mmap(nullptr, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      span = 0;
      return;
    }
    base = static_cast<char*>(p);
  }
};
SlotRegion& slot_region() {
  static SlotRegion r;
  return r;
}

// --------------------------------------------------------------- dispatch --
// A bound buffer as the kernel sees it.
struct Bound {
  int index = -1;
  char* begin = nullptr;  // address the kernel gets
  uint64_t size = 0;
  bool from_bytes = false;
  bool writable = false;      // memory, and the parameter is not read-only
  bool race_checked = false;  // its memory is writable through some argument: races among lanes are checked
  uint64_t origin = 0;        // Binding::origin
  std::string name;           // the kernel parameter's name
};

enum class ErrorKind { kNone, kBounds, kAlign, kDivergence, kRace, kOther };

struct Counters {
  uint64_t read[MX_MAX_BUFFERS] = {};
  uint64_t written[MX_MAX_BUFFERS] = {};
  uint64_t read_width[MX_MAX_BUFFERS][8] = {};  // by log2 of the width (1..128 bytes)
  uint64_t write_width[MX_MAX_BUFFERS][8] = {};
  uint64_t tg_read = 0, tg_written = 0;
  uint64_t threads = 0, barriers = 0, simd_barriers = 0, simd_ops = 0;
  uint64_t ops[MX_OPS_COUNT] = {}, max_ops[MX_OPS_COUNT] = {};          // 64-bit integer work
  uint64_t lines[MX_MAX_BUFFERS] = {}, min_lines[MX_MAX_BUFFERS] = {};  // coalescing
  uint64_t tg_instructions = 0, bank_cycles = 0;                        // bank conflicts
  uint64_t group_read[MX_MAX_BUFFERS] = {};                             // per threadgroup, distinct bytes read, summed
  uint64_t tg_memory = 0;  // the most threadgroup memory one threadgroup allocated
  // simdgroup_matrix operations, per simdgroup (Stats::matrix_*)
  uint64_t mma = 0, mma_32 = 0, matrix_loads_tg = 0, matrix_loads_device = 0, matrix_stores_tg = 0,
           matrix_stores_device = 0;

  void add(const Counters& o) {
    for (int i = 0; i < MX_MAX_BUFFERS; ++i) {
      read[i] += o.read[i];
      written[i] += o.written[i];
      lines[i] += o.lines[i];
      min_lines[i] += o.min_lines[i];
      group_read[i] += o.group_read[i];
      for (int k = 0; k < 8; ++k) {
        read_width[i][k] += o.read_width[i][k];
        write_width[i][k] += o.write_width[i][k];
      }
    }
    for (int k = 0; k < MX_OPS_COUNT; ++k) {
      ops[k] += o.ops[k];
      max_ops[k] = std::max(max_ops[k], o.max_ops[k]);
    }
    tg_instructions += o.tg_instructions;
    bank_cycles += o.bank_cycles;
    tg_memory = std::max(tg_memory, o.tg_memory);
    tg_read += o.tg_read;
    tg_written += o.tg_written;
    threads += o.threads;
    barriers += o.barriers;
    simd_barriers += o.simd_barriers;
    simd_ops += o.simd_ops;
    mma += o.mma;
    mma_32 += o.mma_32;
    matrix_loads_tg += o.matrix_loads_tg;
    matrix_loads_device += o.matrix_loads_device;
    matrix_stores_tg += o.matrix_stores_tg;
    matrix_stores_device += o.matrix_stores_device;
  }
};

// The writing threadgroup of each byte of a buffer copy (isolated mode), for
// the check of reads across threadgroups: tag << 4 | min(releases, 15), where
// tag identifies the threadgroup and `releases` is how many times it had
// made its writes visible before this write (see Worker::device_access).
struct Shadow32 {
  char* at = nullptr;  // the copy
  uint64_t size = 0;
  uint32_t* tags = nullptr;
  std::atomic<bool> written{false};
};
constexpr uint32_t kTagLimit = (1u << 28) - 1;

// uint64 -> uint32, cleared in O(1) (entries of an older generation are
// empty), for the counters that match accesses of the lanes of a simdgroup.
class FlatMap {
 public:
  // The value of `key`, inserted as `fresh` if absent. The reference is
  // valid until the next call.
  uint32_t& at(uint64_t key, uint32_t fresh) {
    if ((size_ + 1) * 2 > table_.size()) grow();
    size_t mask = table_.size() - 1;
    for (size_t i = slot(key);; i = (i + 1) & mask) {
      Entry& e = table_[i];
      if (e.gen != gen_) {
        e = Entry{key, fresh, gen_};
        ++size_;
        return e.value;
      }
      if (e.key == key) return e.value;
    }
  }
  // f(key, value) for every entry.
  template <class F>
  void each(F f) const {
    for (const Entry& e : table_)
      if (e.gen == gen_) f(e.key, e.value);
  }
  void clear() {
    if (++gen_ == 0) {
      std::fill(table_.begin(), table_.end(), Entry{});
      gen_ = 1;
    }
    size_ = 0;
  }

 private:
  struct Entry {
    uint64_t key = 0;
    uint32_t value = 0;
    uint32_t gen = 0;
  };
  size_t slot(uint64_t key) const { return static_cast<size_t>((key * 0x9e3779b97f4a7c15ull) >> shift_); }
  void grow() {
    std::vector<Entry> old;
    old.swap(table_);
    size_t cap = std::max<size_t>(1024, old.size() * 2);
    table_.assign(cap, Entry{});
    shift_ = 64 - __builtin_ctzll(cap);
    uint32_t g = gen_;
    gen_ = 1;
    size_ = 0;
    for (const Entry& e : old)
      if (e.gen == g) at(e.key, e.value);
  }
  std::vector<Entry> table_;
  size_t size_ = 0;
  int shift_ = 64;
  uint32_t gen_ = 1;
};

struct DispatchState {
  const Library* library = nullptr;
  const mx_kernel* kernel = nullptr;
  const Dispatch* dispatch = nullptr;
  void* buffer_table[MX_MAX_BUFFERS] = {};
  std::vector<Bound> bound;                               // every bound buffer
  std::vector<std::vector<int>> slot_members;             // isolated: slot -> indices into `bound`
  std::vector<std::pair<uint64_t, uint64_t>> tg_buffers;  // [[threadgroup(i)]]: (offset, size)
  std::vector<std::string> tg_names;
  Size3 groups{}, tpt{}, grid{};
  uint64_t group_count = 0;
  bool isolated = true;
  uintptr_t slot_base = 0;  // isolated: the reserved range of buffer copies
  uint64_t slot_span = 0;
  size_t stack_bytes = 0;
  bool flush_denormals = true;
  bool counters = false;  // measure coalescing and bank conflicts
  uint64_t watchdog_ns = 0;
  std::unique_ptr<Permutation> order;

  // Cross-threadgroup visibility (isolated mode).
  Shadow32 shadows[MX_MAX_BUFFERS + 1];
  std::atomic<uint64_t> atomic_seq{0};  // device atomics, in the order they ran
  std::mutex release_mutex;
  // threadgroup tag -> atomic_seq of its 1st, 2nd, ... release (a device
  // atomic write after a device fence that followed device writes)
  std::unordered_map<uint32_t, std::vector<uint64_t>> releases;

  std::atomic<uint64_t> next_group{0};
  std::atomic<bool> failed{false};
  std::mutex mutex;
  ErrorKind error = ErrorKind::kNone;
  std::string message;
  Counters totals;
  // With counters: the bytes of device buffers any threadgroup read, as
  // Worker::read_granules (merged from the workers under `mutex`).
  FlatMap unique_reads;

  void fail(ErrorKind kind, const std::string& msg) {
    std::lock_guard<std::mutex> g(mutex);
    if (error == ErrorKind::kNone) {
      error = kind;
      message = msg;
    }
    failed = true;
  }
};

// ----------------------------------------------------------------- lanes --
enum class LaneState : uint8_t { kUnstarted, kRunnable, kRunning, kBarrier, kSimd, kDone };

// One level of a lane's SIMT position: a call (by the shader, of a function
// that reaches a simd operation or barrier) or an iteration of a loop that
// contains such a call. `key` orders the calls and loops of one function.
struct Frame {
  uint32_t key;
  uint32_t iteration;        // loops
  uint32_t site;             // index into the library's site table
  uint32_t saved_base : 31;  // calls: the caller's base
  uint32_t loop : 1;
  uint64_t hash;  // of frames[0, this one]: the position, for the cost counters (when measuring)
};
constexpr uint32_t kMaxFrames = 48;

struct Lane {
  mx_thread_info info;
  uint32_t index = 0;  // thread_index_in_threadgroup
  LaneState state = LaneState::kUnstarted;
  void* sp = nullptr;
  int stack = -1;
  uint32_t flags = 0;  // barrier: mem flags; simd: MX_SIMD_*
  bool simd_barrier = false;
  mx_simd_fn fn = nullptr;
  const void* in = nullptr;
  void* out = nullptr;
  int64_t arg = 0;
  // The SIMT position: frames[0, depth); the current function's loop frames
  // start at `base`.
  uint32_t depth = 0, base = 0;
  Frame frames[kMaxFrames];
  mx_u64 ops[MX_OPS_COUNT] = {};  // 64-bit integer work (api op_counts)
  // A device atomic's hook ran but its operation may not have: the
  // threadgroup's `acquired` is read at this lane's next event (Worker::settle).
  bool acquire_due = false;

  void reset() {
    state = LaneState::kUnstarted;
    sp = nullptr;
    stack = -1;
    flags = 0;
    simd_barrier = false;
    fn = nullptr;
    in = nullptr;
    out = nullptr;
    arg = 0;
    depth = base = 0;
    for (mx_u64& o : ops) o = 0;
    acquire_due = false;
  }
};

// -1, 0, 1 as a's position comes before, equals or follows b's.
int compare_positions(const Lane& a, const Lane& b) {
  uint32_t n = std::min(a.depth, b.depth);
  for (uint32_t i = 0; i < n; ++i) {
    const Frame &x = a.frames[i], &y = b.frames[i];
    if (x.key != y.key) return x.key < y.key ? -1 : 1;
    if (x.iteration != y.iteration) return x.iteration < y.iteration ? -1 : 1;
  }
  return a.depth < b.depth ? -1 : a.depth > b.depth ? 1 : 0;
}

// Shadow state of one byte of threadgroup memory, for race detection.
struct Shadow {
  uint32_t epoch;      // threadgroup-barrier epoch this entry belongs to
  uint16_t writer;     // lane + 1, 0 = none
  uint16_t reader;     // lane + 1, 0 = none, kMany = several lanes
  uint16_t reader_sg;  // simdgroup of the readers, kMany if several
  uint16_t pad;
  uint32_t writer_sg_epoch;
  uint32_t reader_sg_epoch;
};
constexpr uint16_t kMany = 0xffff;

// One memory instruction executed by (the lanes of) a simdgroup.
struct Instance {
  int32_t buffer;       // device buffer index; -1: threadgroup memory
  uint32_t size;        // bytes per lane
  uint32_t lanes;       // lanes recorded
  uint64_t offset[32];  // per lane: bytes from the buffer's storage start, or from the threadgroup arena
};
constexpr uint32_t kNoInstance = ~0u;

struct Worker {
  DispatchState* ds = nullptr;
  Lane lanes[kMaxThreads];
  uint32_t lane_count = 0;
  uint32_t simdgroup_count = 0;
  std::vector<uint32_t> runq;
  std::vector<uint32_t> yieldq;  // lanes that yielded at an atomic
  std::vector<FiberStack> stacks;
  size_t stack_bytes = 0;  // of every stack in `stacks`
  std::vector<int> free_stacks;
  void* scheduler_sp = nullptr;
  Lane* current = nullptr;
  bool aborted = false;
  std::mt19937_64 rng;
  Counters counters;
  mx_u64 ops_sink[MX_OPS_COUNT] = {};  // op_counts of shader code run outside a lane
  mx_uint3 group_pos{};
  uint64_t group_linear = 0;

  // watchdog
  uint64_t last_progress = 0;  // ns: a lane finished or a barrier opened
  uint32_t access_ticks = 0, loop_ticks = 0, yield_ticks = 0;

  // this threadgroup's device writes, for the cross-threadgroup check
  uint32_t tag = 0;      // identifies the threadgroup in the shadow
  bool dirty = false;    // device writes since the last device fence
  bool pending = false;  // fenced writes not yet released by a device atomic
  uint32_t releases = 0;
  uint64_t acquired = 0;  // atomic_seq after this threadgroup's latest device atomic ran
  uint32_t verified = 0;  // the last shadow value found visible

  // threadgroup memory
  char* arena = nullptr;
  uint8_t region[kArenaSize];  // 0: red zone / unallocated, else region id
  std::vector<std::string> region_names;
  std::vector<std::pair<const void*, uint64_t>> statics;  // key -> offset
  uint64_t arena_top = 0, arena_used = 0;
  void* tg_table[MX_MAX_TG_BUFFERS] = {};
  std::vector<Shadow> shadow;
  uint32_t epoch = 0;
  uint32_t sg_epoch[kMaxThreads / 32] = {};

  // device memory touched by this threadgroup since its last device barrier,
  // for races among its lanes: 16-byte granules (address >> 4) -> shadows
  struct DeviceGranule {
    Shadow bytes[16];
  };
  static constexpr size_t kMaxDeviceGranules = size_t(1) << 16;  // 20 MiB; beyond, new granules go unchecked
  FlatMap device_index;
  std::vector<DeviceGranule> device_granules;
  uint32_t dsg_epoch[kMaxThreads / 32] = {};  // simdgroup_barrier(mem_device)s per simdgroup
  uint16_t plain_barriers = 0;                // threadgroup barriers without mem_device since the last with it

  Worker() {
    arena = static_cast<char*>(mmap(nullptr, kArenaSize, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    if (arena == MAP_FAILED) throw std::runtime_error("CPU Metal executor: cannot allocate threadgroup memory");
    shadow.assign(kArenaSize, Shadow{});
    runq.reserve(kMaxThreads);
  }
  ~Worker() {
    munmap(arena, kArenaSize);
    for (auto& s : stacks) s.release();
  }

  int take_stack() {
    if (free_stacks.empty()) {
      stacks.push_back(FiberStack::allocate(stack_bytes));
      return static_cast<int>(stacks.size()) - 1;
    }
    int s = free_stacks.back();
    free_stacks.pop_back();
    return s;
  }

  // ------------------------------------------------------------- errors --
  [[noreturn]] void fail(ErrorKind kind, const std::string& msg) {
    ds->fail(kind, msg);
    aborted = true;
    void* dead;
    mx_fiber_switch(&dead, scheduler_sp);
    __builtin_unreachable();
  }

  std::string thread_name(const Lane& l) const {
    std::ostringstream o;
    o << "thread " << l.index << " (position "
      << size3({l.info.thread_position_in_threadgroup.x, l.info.thread_position_in_threadgroup.y,
                l.info.thread_position_in_threadgroup.z})
      << ") of threadgroup " << size3({group_pos.x, group_pos.y, group_pos.z});
    return o.str();
  }

  std::string at_site(uint32_t flags) const {
    std::string s = ds->library->site(flags >> MX_ACC_SITE_SHIFT);
    return s.empty() ? std::string() : " at " + s;
  }

  // ---------------------------------------------------- threadgroup memory --
  uint64_t allocate(uint64_t size, uint64_t align, const std::string& name) {
    align = std::max<uint64_t>(align, 16);
    uint64_t off = (arena_top + kRedZone + align - 1) / align * align;
    if (arena_used + size > kThreadgroupLimit || off + size + kRedZone > kArenaSize) {
      std::ostringstream o;
      o << "kernel '" << ds->kernel->name << "' uses more than Metal's 32 KiB of threadgroup memory: " << arena_used
        << " bytes allocated, and '" << name << "' asks for " << size << " more";
      fail(ErrorKind::kOther, o.str());
    }
    region_names.push_back(name);
    uint8_t id = static_cast<uint8_t>(region_names.size());
    std::memset(arena + off, 0xff, size);
    std::memset(region + off, id, size);
    arena_top = off + size;
    arena_used += size;
    return off;
  }

  void reset_threadgroup_memory() {
    std::memset(region, 0, std::min<uint64_t>(arena_top + kRedZone, kArenaSize));
    region_names.clear();
    statics.clear();
    arena_top = 0;
    arena_used = 0;
    if (++epoch == 0) {  // wrapped: forget every shadow entry
      std::fill(shadow.begin(), shadow.end(), Shadow{});
      epoch = 1;
    }
    std::fill(std::begin(sg_epoch), std::end(sg_epoch), 0u);
    for (size_t i = 0; i < ds->tg_buffers.size(); ++i) {
      uint64_t size = ds->tg_buffers[i].second;
      tg_table[i] = size ? arena + allocate(size, 16, ds->tg_names[i]) : nullptr;
    }
  }

  void* threadgroup_variable(const void* key, uint64_t size, uint64_t align) {
    for (auto& s : statics)
      if (s.first == key) return arena + s.second;
    // The translator names each key after its variable.
    std::string name = std::string("threadgroup variable '") + static_cast<const char*>(key) + "'";
    uint64_t off = allocate(size, align, name);
    statics.push_back({key, off});
    return arena + off;
  }

  void check_threadgroup_access(uint64_t off, uint64_t size, uint32_t flags) {
    uint8_t id = region[off];
    uint64_t last = off + (size ? size - 1 : 0);
    if (id == 0 || last >= kArenaSize || region[last] != id) threadgroup_out_of_bounds(off, size, flags);
    if (flags & MX_ACC_WRITE) counters.tg_written += size;
    else counters.tg_read += size;
    if (flags & MX_ACC_ATOMIC) return;
    check_races(off, size, flags);
  }

  [[noreturn, gnu::noinline, gnu::cold]] void threadgroup_out_of_bounds(uint64_t off, uint64_t size, uint32_t flags) {
    uint8_t id = region[off];
    uint64_t last = off + (size ? size - 1 : 0);
    uint8_t near =
        id ? id : (off >= 1 && region[off - 1] ? region[off - 1] : (last + 1 < kArenaSize ? region[last + 1] : 0));
    std::ostringstream o;
    o << "out-of-bounds " << ((flags & MX_ACC_WRITE) ? "write" : "read") << " of " << size
      << " bytes of threadgroup memory";
    if (near) o << " next to " << region_names[near - 1];
    o << " by " << thread_name(*current) << " in kernel '" << ds->kernel->name << "'" << at_site(flags);
    fail(ErrorKind::kBounds, o.str());
  }

  [[gnu::noinline]] void check_races(uint64_t off, uint64_t size, uint32_t flags) {
    uint16_t conflict = 0;
    const char* what = nullptr;
    uint64_t i = scan_races(&shadow[off], size, epoch, sg_epoch, 0, flags, &conflict, &what);
    if (i < size) race(off, off + i, conflict, what, flags);
  }

  // The race rule of threadgroup and device memory alike: two lanes touch a
  // byte between barriers (`ep`), one of them writing, unless both are in
  // one simdgroup with a simdgroup barrier (`sg_ep`) between them. Records
  // the access in the bytes' shadows s[0, size) (`stamp` in Shadow::pad)
  // and returns the index of the first conflicting byte, or size.
  uint64_t scan_races(Shadow* shadows, uint64_t size, uint32_t ep, const uint32_t* sg_ep, uint16_t stamp,
                      uint32_t flags, uint16_t* conflict_out, const char** what_out) {
    const Lane& l = *current;
    uint16_t me = static_cast<uint16_t>(l.index + 1);
    uint16_t sg = static_cast<uint16_t>(l.index / 32);
    uint32_t sgep = sg_ep[sg];
    auto ordered = [&](uint16_t other, uint32_t other_sgep) {
      return other == me || ((other - 1) / 32 == sg && other_sgep < sgep);
    };
    for (uint64_t b = 0; b < size; ++b) {
      Shadow& s = shadows[b];
      if (s.epoch != ep) s = Shadow{ep, 0, 0, 0, 0, 0, 0};
      uint16_t conflict = 0;
      const char* what = nullptr;
      if (flags & MX_ACC_WRITE) {
        if (s.writer && !ordered(s.writer, s.writer_sg_epoch)) {
          conflict = s.writer;
          what = "wrote";
        } else if (s.reader == kMany && !(s.reader_sg == sg && s.reader_sg_epoch < sgep)) {
          conflict = kMany;
          what = "read";
        } else if (s.reader && s.reader != kMany && !ordered(s.reader, s.reader_sg_epoch)) {
          conflict = s.reader;
          what = "read";
        }
        if (!conflict) {
          s.writer = me;
          s.writer_sg_epoch = sgep;
          s.reader = 0;
          s.pad = stamp;
        }
      } else {
        if (s.writer && !ordered(s.writer, s.writer_sg_epoch)) {
          conflict = s.writer;
          what = "wrote";
        } else if (s.reader == 0) {
          s.reader = me;
          s.reader_sg = sg;
          s.reader_sg_epoch = sgep;
          s.pad = stamp;
        } else if (s.reader != me) {
          if (s.reader_sg != sg) s.reader_sg = kMany;
          s.reader = kMany;
          s.reader_sg_epoch = std::max(s.reader_sg_epoch, sgep);
          s.pad = stamp;
        }
      }
      if (conflict) {
        *conflict_out = conflict;
        *what_out = what;
        return b;
      }
    }
    return size;
  }

  [[noreturn, gnu::noinline, gnu::cold]] void race(uint64_t off, uint64_t b, uint16_t conflict, const char* what,
                                                   uint32_t flags) {
    uint8_t id = region[b];
    std::ostringstream o;
    o << "data race on threadgroup memory in kernel '" << ds->kernel->name << "': ";
    if (conflict == kMany) o << "several threads";
    else o << "thread " << (conflict - 1);
    o << " " << what << " byte " << (b - off) << " of " << (id ? region_names[id - 1] : "threadgroup memory")
      << " and thread " << current->index << " " << ((flags & MX_ACC_WRITE) ? "writes" : "reads") << " it"
      << at_site(flags) << " with no threadgroup_barrier(mem_flags::mem_threadgroup) between them"
      << " (threadgroup " << size3({group_pos.x, group_pos.y, group_pos.z}) << ")";
    fail(ErrorKind::kRace, o.str());
  }

  // ------------------------------------------------------- device memory --
  // Memory a kernel reaches that is neither a buffer nor threadgroup memory.
  // Only needed without isolation, where buffers are anywhere in the heap.
  bool is_engine_memory(uintptr_t a) const {
    auto inside = [a](const void* p, size_t n) { return a - reinterpret_cast<uintptr_t>(p) < n; };
    if (inside(this, sizeof(Worker)) || inside(ds, sizeof(DispatchState))) return true;
    if (current && current->stack >= 0) {
      const FiberStack& st = stacks[current->stack];
      if (inside(st.base, st.size)) return true;
    }
    return false;
  }

  const Bound* find_bound(uintptr_t a, uint64_t size, const Bound** nearest) {
    DispatchState& d = *ds;
    const Bound* best = nullptr;
    uint64_t best_dist = ~uint64_t(0);
    auto consider = [&](const Bound& b) -> bool {
      uintptr_t lo = reinterpret_cast<uintptr_t>(b.begin), hi = lo + b.size;
      if (a >= lo && a + size <= hi) return true;
      uint64_t dist = a < lo ? lo - a : a + size - hi;
      if (dist < best_dist) {
        best_dist = dist;
        best = &b;
      }
      return false;
    };
    if (d.isolated) {
      uint64_t slot = (a - d.slot_base) >> kSlotShift;
      if (slot < d.slot_members.size())
        for (int m : d.slot_members[slot])
          if (consider(d.bound[m])) return &d.bound[m];
      if (!best)  // a slot no buffer uses: blame the nearest buffer anywhere
        for (const Bound& b : d.bound) consider(b);
    } else {
      for (const Bound& b : d.bound)
        if (consider(b)) return &b;
      if (best_dist > kDirectSlack) best = nullptr;  // not near a buffer: private memory
    }
    *nearest = best;
    return nullptr;
  }

  // Every instrumented access. The common case stays short: error messages
  // and the rarer work are in functions of their own.
  void access(uintptr_t a, uint64_t size, uint32_t flags) {
    uint64_t align = uint64_t(1) << ((flags >> MX_ACC_ALIGN_SHIFT) & 15);
    if (__builtin_expect(++access_ticks == 1u << 16, 0)) {
      access_ticks = 0;
      watchdog();
    }
    uint64_t toff = a - reinterpret_cast<uintptr_t>(arena);
    if (toff < kArenaSize) {
      if (a & (align - 1)) misaligned(a, size, flags, "threadgroup memory", toff);
      check_threadgroup_access(toff, size, flags);
      if (measuring) track(-1, toff, size, flags);
      if (flags & MX_ACC_ATOMIC) yield(flags);
      return;
    }
    DispatchState& d = *ds;
    if (d.isolated) {
      if (a - d.slot_base >= d.slot_span) return;  // thread-private memory
    } else if (is_engine_memory(a)) {
      return;  // the lane's stack, its mx_thread_info, the buffer table
    }
    const Bound* nearest = nullptr;
    const Bound* b = find_bound(a, size, &nearest);
    if (!b) {
      if (!nearest && !d.isolated) return;  // thread-private memory
      out_of_bounds(a, size, flags, nearest);
    }
    if (a & (align - 1)) misaligned(a, size, flags, b->name.c_str(), a - reinterpret_cast<uintptr_t>(b->begin));
    int i = b->index;
    int w = std::min(63 - __builtin_clzll(size ? size : 1), 7);
    if (flags & MX_ACC_WRITE) {
      if (b->from_bytes) write_to_constant(*b, flags);
      counters.written[i] += size;
      counters.write_width[i][w]++;
    }
    if (flags & MX_ACC_READ) {
      counters.read[i] += size;
      counters.read_width[i][w]++;
    }
    if (measuring) {
      uint64_t offset = a - reinterpret_cast<uintptr_t>(b->begin) + b->origin;
      track(i, offset, size, flags);
      if (flags & MX_ACC_READ) note_read(i, offset, size);
    }
    if (b->race_checked && !(flags & MX_ACC_ATOMIC)) device_races(*b, a, size, flags);
    if (d.isolated && ((flags & MX_ACC_ATOMIC) || d.shadows[(a - d.slot_base) >> kSlotShift].tags))
      device_visibility(*b, a, size, flags);
    if (flags & MX_ACC_ATOMIC) yield(flags);
  }

  [[noreturn, gnu::noinline, gnu::cold]] void out_of_bounds(uintptr_t a, uint64_t size, uint32_t flags,
                                                            const Bound* nearest) {
    std::ostringstream o;
    if (!nearest) {
      o << "access to device memory outside every bound buffer in kernel '" << ds->kernel->name << "' by "
        << thread_name(*current) << at_site(flags);
      fail(ErrorKind::kBounds, o.str());
    }
    int64_t off = static_cast<int64_t>(a - reinterpret_cast<uintptr_t>(nearest->begin));
    o << "out-of-bounds " << ((flags & MX_ACC_WRITE) ? "write" : "read") << " of " << size << " bytes at byte offset "
      << off << " of buffer " << nearest->index << " ('" << nearest->name << "', " << nearest->size
      << " bytes bound) in kernel '" << ds->kernel->name << "' by " << thread_name(*current) << at_site(flags);
    fail(ErrorKind::kBounds, o.str());
  }

  [[noreturn, gnu::noinline, gnu::cold]] void write_to_constant(const Bound& b, uint32_t flags) {
    std::ostringstream o;
    o << "kernel '" << ds->kernel->name << "' writes buffer " << b.index << " ('" << b.name
      << "'), which was bound from bytes (constant data)" << at_site(flags);
    fail(ErrorKind::kOther, o.str());
  }

  // ---------------------------------------------- memory cost counters --
  // With counters on, every access is also filed under the memory
  // instruction that a simdgroup executes. Lanes run one after another here,
  // so the n-th time a lane reaches an access site at a SIMT position (the
  // calls and iterations of loops around simd operations and barriers) is
  // matched with the n-th time the other lanes of its simdgroup reach it
  // there: the same instruction instance, as long as the lanes took the same
  // path through other loops and branches (a site is a source position, so
  // the inlined copies of a helper share one and are matched in the order
  // they run). An instance is complete once every lane has
  // passed it: at a threadgroup barrier and at the end of the threadgroup,
  // where the instances are measured and dropped. Memory stays bounded: only
  // the first kMaxOccurrences times a lane reaches a site in a threadgroup
  // are measured (a long loop is sampled by its first iterations), and at
  // most kMaxInstances instances between two barriers.
  static constexpr uint32_t kMaxOccurrences = 1024;
  static constexpr size_t kMaxInstances = size_t(1) << 17;
  bool measuring = false;
  FlatMap site_counts;     // hash of (lane, site, position) -> times the lane reached the site there
  FlatMap instance_index;  // hash of (simdgroup, site, position, n) -> index into instances
  std::vector<Instance> instances;
  std::vector<uint64_t> words;  // scratch of measure()
  // Device bytes read, in 32-byte granules: (buffer << 48 | offset >> 5) ->
  // mask of the granule's bytes. group_reads: this threadgroup's (a cache
  // hit inside the threadgroup is not counted again, a re-read by another
  // threadgroup is); all_reads: every threadgroup this worker ran.
  FlatMap group_reads, all_reads;

  void note_read(int buffer, uint64_t offset, uint64_t size) {
    for (uint64_t b = offset, end = offset + size; b < end;) {
      uint64_t g = b >> 5, upto = std::min(end, (g + 1) << 5);
      uint32_t bits = upto - b == 32 ? ~0u : ((1u << (upto - b)) - 1) << (b & 31);
      group_reads.at(uint64_t(buffer) << 48 | g, 0) |= bits;
      b = upto;
    }
  }

  void flush_group_reads() {
    group_reads.each([&](uint64_t key, uint32_t bits) {
      counters.group_read[key >> 48] += __builtin_popcount(bits);
      all_reads.at(key, 0) |= bits;
    });
    group_reads.clear();
  }

  void track(int buffer, uint64_t offset, uint64_t size, uint32_t flags) {
    uint64_t site = flags >> MX_ACC_SITE_SHIFT;
    const Lane& l = *current;
    uint64_t position = l.depth ? l.frames[l.depth - 1].hash : 0;
    uint32_t n = site_counts.at(splitmix(position ^ splitmix((uint64_t(l.index) << 24) | site)), 0)++;
    if (n >= kMaxOccurrences) return;
    uint64_t key = splitmix(position ^ splitmix((uint64_t(l.index / 32) << 56) | (site << 32) | n));
    uint32_t& slot = instance_index.at(key, kNoInstance);
    if (slot == kNoInstance) {
      if (instances.size() >= kMaxInstances) {
        slot = kNoInstance - 1;  // not measured
        return;
      }
      slot = static_cast<uint32_t>(instances.size());
      instances.push_back(Instance{buffer, static_cast<uint32_t>(size), 0, {}});
    }
    if (slot >= instances.size()) return;
    Instance& in = instances[slot];
    // Another instruction under the same key (lanes on different paths):
    // not the same instance, left out.
    if (in.buffer != buffer || in.size != size || in.lanes == 32) return;
    in.offset[in.lanes++] = offset;
  }

  void reset_instances(bool counts) {
    instances.clear();
    instance_index.clear();
    if (counts) site_counts.clear();
  }

  void flush_instances() {
    for (const Instance& in : instances) measure(in);
    reset_instances(false);
  }

  // Coalescing (device memory): the 128-byte lines the lanes touch, against
  // the fewest lines that hold the bytes they access. Bank conflicts
  // (threadgroup memory, 32 banks of 4 bytes): the cycles beyond what the
  // access needs without conflicts, i.e. the most distinct 4-byte words
  // falling in one bank, less the distinct words over 32 banks (1 for an
  // access of up to 4 bytes a lane). The same word read by several lanes is
  // a broadcast, free.
  void measure(const Instance& in) {
    uint64_t o[32];
    std::copy(in.offset, in.offset + in.lanes, o);
    std::sort(o, o + in.lanes);
    uint64_t size = std::max<uint64_t>(in.size, 1);
    if (in.buffer >= 0) {
      uint64_t lines = 0, bytes = 0, line_end = 0, byte_end = 0;
      for (uint32_t i = 0; i < in.lanes; ++i) {
        uint64_t first = o[i] >> 7, last = (o[i] + size - 1) >> 7;
        if (i == 0 || first >= line_end) lines += last - first + 1;
        else if (last >= line_end) lines += last - line_end + 1;
        line_end = std::max(line_end, last + 1);
        uint64_t begin = i == 0 ? o[i] : std::max(o[i], byte_end);
        if (o[i] + size > begin) bytes += o[i] + size - begin;
        byte_end = std::max(byte_end, o[i] + size);
      }
      counters.lines[in.buffer] += lines;
      counters.min_lines[in.buffer] += (bytes + 127) / 128;
      return;
    }
    words.clear();
    for (uint32_t i = 0; i < in.lanes; ++i)
      for (uint64_t w = o[i] >> 2; w <= (o[i] + size - 1) >> 2; ++w) words.push_back(w);
    std::sort(words.begin(), words.end());
    words.erase(std::unique(words.begin(), words.end()), words.end());
    uint32_t per_bank[32] = {};
    uint32_t most = 0;
    for (uint64_t w : words) most = std::max(most, ++per_bank[w & 31]);
    uint64_t needed = (words.size() + 31) / 32;
    counters.tg_instructions++;
    counters.bank_cycles += most > needed ? most - needed : 0;
  }

  // ------------------------------------------- device memory in the group --
  void reset_device_races() {
    device_index.clear();
    device_granules.clear();
    plain_barriers = 0;
  }

  [[gnu::noinline]] void device_races(const Bound& b, uintptr_t a, uint64_t size, uint32_t flags) {
    for (uintptr_t g = a >> 4, last = (a + (size ? size : 1) - 1) >> 4; g <= last; ++g) {
      uint32_t& slot = device_index.at(g, kNoInstance);
      if (slot == kNoInstance) {
        if (device_granules.size() >= kMaxDeviceGranules) {
          slot = kNoInstance - 1;  // not checked
          continue;
        }
        slot = static_cast<uint32_t>(device_granules.size());
        device_granules.emplace_back();  // epoch 0: empty (the device epoch is 1)
      }
      if (slot >= device_granules.size()) continue;
      uintptr_t lo = std::max<uintptr_t>(a, g << 4), hi = std::min<uintptr_t>(a + size, (g + 1) << 4);
      Shadow* bytes = device_granules[slot].bytes + (lo & 15);
      uint16_t conflict = 0;
      const char* what = nullptr;
      uint64_t i = scan_races(bytes, hi - lo, 1, dsg_epoch, plain_barriers, flags, &conflict, &what);
      if (i < hi - lo) device_race(b, a, lo + i, conflict, what, flags, bytes[i].pad != plain_barriers);
    }
  }

  [[noreturn, gnu::noinline, gnu::cold]] void device_race(const Bound& b, uintptr_t a, uintptr_t at, uint16_t conflict,
                                                          const char* what, uint32_t flags, bool barrier_between) {
    std::ostringstream o;
    o << "data race on device memory in kernel '" << ds->kernel->name << "': ";
    if (conflict == kMany) o << "several threads";
    else o << "thread " << (conflict - 1);
    o << " " << what << " byte " << (at - reinterpret_cast<uintptr_t>(b.begin)) << " of buffer " << b.index << " ('"
      << b.name << "') and thread " << current->index << " " << ((flags & MX_ACC_WRITE) ? "writes" : "reads") << " it"
      << at_site(flags);
    if (barrier_between)
      o << " after a threadgroup_barrier without mem_flags::mem_device, which orders only threadgroup memory: "
           "use threadgroup_barrier(mem_flags::mem_device)";
    else o << " with no threadgroup_barrier(mem_flags::mem_device) between them";
    o << " (threadgroup " << size3({group_pos.x, group_pos.y, group_pos.z}) << ")";
    (void)a;
    fail(ErrorKind::kRace, o.str());
  }

  // ------------------------------------------ device memory across groups --
  void device_fence() {
    if (dirty) pending = true;
    dirty = false;
  }

  [[gnu::noinline]] void device_visibility(const Bound& b, uintptr_t a, uint64_t size, uint32_t flags) {
    DispatchState& d = *ds;
    settle();
    if (flags & MX_ACC_ATOMIC) {
      // The hook runs before the operation, and other threadgroups run
      // between them (this lane yields first), so numbers taken here need
      // not follow the order the operations ran in. A release is numbered
      // and recorded here, before its operation; the reader's number is
      // taken at its next event, after its operation (settle). A release
      // whose operation ran before the reader's then always has a number
      // at most the reader's.
      uint64_t seq = d.atomic_seq.fetch_add(1) + 1;
      if ((flags & MX_ACC_WRITE) && pending) {
        pending = false;
        std::lock_guard<std::mutex> g(d.release_mutex);
        d.releases[tag].push_back(seq);
        ++releases;
      }
      current->acquire_due = true;
      return;
    }
    Shadow32& sh = d.shadows[(a - d.slot_base) >> kSlotShift];
    if (!sh.tags) return;
    uint32_t* t = sh.tags + (a - reinterpret_cast<uintptr_t>(sh.at));
    if (flags & MX_ACC_WRITE) {
      uint32_t v = (tag << 4) | std::min<uint32_t>(releases, 15);
      for (uint64_t k = 0; k < size; ++k) __atomic_store_n(&t[k], v, __ATOMIC_RELAXED);
      if (!sh.written.load(std::memory_order_relaxed)) sh.written.store(true, std::memory_order_relaxed);
      dirty = true;
      return;
    }
    if (!sh.written.load(std::memory_order_relaxed)) return;
    for (uint64_t k = 0; k < size; ++k) {
      uint32_t v = __atomic_load_n(&t[k], __ATOMIC_RELAXED);
      if (v == 0 || (v >> 4) == tag || v == verified) continue;
      if (!visible(v)) stale_read(b, a + k, v, flags);
      verified = v;
    }
  }

  // This lane's last device atomic has run by the time the lane reaches
  // its next access or barrier: what had been numbered by then precedes it.
  void settle() {
    if (!current->acquire_due) return;
    current->acquire_due = false;
    acquired = std::max(acquired, ds->atomic_seq.load());
  }

  // Did the writer of shadow value v release the write before this
  // threadgroup's latest device atomic?
  bool visible(uint32_t v) {
    DispatchState& d = *ds;
    std::lock_guard<std::mutex> g(d.release_mutex);
    auto it = d.releases.find(v >> 4);
    if (it == d.releases.end()) return false;
    size_t k = v & 15;  // the write came after the writer's k-th release
    return it->second.size() > k && it->second[k] <= acquired;
  }

  [[noreturn]] void stale_read(const Bound& b, uintptr_t a, uint32_t v, uint32_t flags) {
    uint64_t w = (v >> 4) - 1;
    Size3 wp{static_cast<uint32_t>(w % ds->groups[0]), static_cast<uint32_t>((w / ds->groups[0]) % ds->groups[1]),
             static_cast<uint32_t>(w / (uint64_t(ds->groups[0]) * ds->groups[1]))};
    std::ostringstream o;
    o << "kernel '" << ds->kernel->name << "': " << thread_name(*current) << " reads byte "
      << (a - reinterpret_cast<uintptr_t>(b.begin)) << " of buffer " << b.index << " ('" << b.name << "')"
      << at_site(flags) << ", which threadgroup " << size3(wp)
      << " wrote in this dispatch without making it visible. Metal keeps device memory coherent only within a "
         "threadgroup, so a GPU may read a stale value: the writer needs a device fence after its writes "
         "(threadgroup_barrier(mem_flags::mem_device), or atomic_thread_fence in MSL 3.2) and then a device atomic "
         "write, and the reader a device atomic after that one";
    fail(ErrorKind::kRace, o.str());
  }

  [[noreturn, gnu::noinline, gnu::cold]] void misaligned(uintptr_t a, uint64_t size, uint32_t flags,
                                                         const std::string& what, uint64_t off) {
    std::ostringstream o;
    o << "misaligned " << ((flags & MX_ACC_WRITE) ? "write" : "read") << " of " << size << " bytes at byte offset "
      << off << " of " << what << ": the type needs " << (uint64_t(1) << ((flags >> MX_ACC_ALIGN_SHIFT) & 15))
      << "-byte alignment (kernel '" << ds->kernel->name << "', " << thread_name(*current) << at_site(flags) << ")";
    fail(ErrorKind::kAlign, o.str());
  }

  // ------------------------------------------------------ synchronisation --
  void block(LaneState state) {
    current->state = state;
    mx_fiber_switch(&current->sp, scheduler_sp);
  }

  // An atomic operation: let the other lanes run (the lane stays runnable).
  [[gnu::noinline]] void yield(uint32_t flags) {
    Lane& l = *current;
    l.flags = flags;
    if (++yield_ticks == 256) {
      yield_ticks = 0;
      watchdog();
    }
    l.state = LaneState::kRunnable;
    yieldq.push_back(l.index);
    mx_fiber_switch(&l.sp, scheduler_sp);
  }

  void barrier(uint32_t scope, uint32_t mem) {
    Lane& l = *current;
    l.flags = mem;
    if (ds->isolated) settle();
    if (scope == MX_SCOPE_SIMDGROUP) {
      l.simd_barrier = true;
      l.fn = nullptr;
      block(LaneState::kSimd);
      l.simd_barrier = false;
    } else {
      if (mem & MX_MEM_DEVICE) device_fence();
      block(LaneState::kBarrier);
    }
  }

  void simd(mx_simd_fn fn, const void* in, void* out, int64_t arg, uint32_t flags) {
    Lane& l = *current;
    l.fn = fn;
    l.in = in;
    l.out = out;
    l.arg = arg;
    l.flags = flags;
    block(LaneState::kSimd);
  }

  // ----------------------------------------------------- SIMT positions --
  [[noreturn]] void too_deep(uint32_t site) {
    std::ostringstream o;
    o << "kernel '" << ds->kernel->name << "': calls and loops leading to simd operations or barriers are nested "
      << "more than " << kMaxFrames << " deep at " << site_name(site) << " (" << thread_name(*current) << ")";
    fail(ErrorKind::kOther, o.str());
  }

  void enter(uint32_t key, uint32_t site, uint32_t depth) {
    Lane& l = *current;
    uint32_t n = std::min(l.base + depth, l.depth);  // drops the frames of loops already left
    if (n >= kMaxFrames) too_deep(site);
    l.frames[n] = Frame{key, 0, site, l.base, 0, 0};
    if (measuring) rehash(l, n);
    l.depth = l.base = n + 1;
  }

  // The position's hash (Frame::hash), for matching the lanes of a memory
  // instruction in the same iteration of a loop around a simd operation.
  static void rehash(Lane& l, uint32_t i) {
    const Frame& f = l.frames[i];
    l.frames[i].hash = splitmix((i ? l.frames[i - 1].hash : 0) ^ (uint64_t(f.key) << 32 | f.iteration) ^ f.loop);
  }

  void leave() {
    Lane& l = *current;
    if (l.base == 0) return;
    l.depth = l.base - 1;
    l.base = l.frames[l.depth].saved_base;
  }

  void loop(uint32_t key, uint32_t site, uint32_t depth) {
    Lane& l = *current;
    if (++loop_ticks == 1u << 12) {
      loop_ticks = 0;
      watchdog();
    }
    uint32_t i = l.base + depth;
    if (i < l.depth && l.frames[i].loop && l.frames[i].key == key) {  // the next iteration
      l.frames[i].iteration++;
      if (measuring) rehash(l, i);
      l.depth = i + 1;
      return;
    }
    i = std::min(i, l.depth);  // entering the loop
    if (i >= kMaxFrames) too_deep(site);
    l.frames[i] = Frame{key, 0, site, 0, 1, 0};
    if (measuring) rehash(l, i);
    l.depth = i + 1;
  }

  std::string site_name(uint32_t site) const {
    std::string s = ds->library->site(site);
    return s.empty() ? "an unknown position" : s;
  }

  // "file:line:col (iteration 2 of the loop at file:line:col)" for a blocked lane.
  std::string position_name(const Lane& l) const {
    if (l.depth == 0) return "an unknown position";
    std::ostringstream o;
    o << site_name(l.frames[l.depth - 1].site);
    for (uint32_t i = l.depth; i-- > 0;)
      if (l.frames[i].loop) {
        o << " (iteration " << l.frames[i].iteration + 1 << " of the loop at " << site_name(l.frames[i].site) << ")";
        break;
      }
    return o.str();
  }

  std::string describe_lanes(const std::vector<Lane*>& ls) {
    std::ostringstream o;
    size_t shown = 0;
    for (Lane* l : ls) {
      if (shown++ == 4) {
        o << ", ...";
        break;
      }
      if (shown > 1) o << ", ";
      o << "thread " << l->index;
      if (l->state == LaneState::kDone) o << " had returned";
      else if (l->state == LaneState::kBarrier) o << " waits at a threadgroup_barrier at " << position_name(*l);
      else if (l->state == LaneState::kSimd) o << " waits at a simd operation at " << position_name(*l);
      else if (l->state == LaneState::kRunnable && l->sp)
        o << " spins at an atomic at " << site_name(l->flags >> MX_ACC_SITE_SHIFT);
      else o << " is running";
    }
    return o.str();
  }

  // ----------------------------------------------------------- watchdog --
  void progress() { last_progress = now_ns(); }

  // No lane finished and no barrier opened for too long: an error (from a
  // lane, or from the scheduler when current is null).
  void watchdog() {
    if (now_ns() - last_progress <= ds->watchdog_ns) return;
    watchdog_fires();
  }
  [[gnu::noinline, gnu::cold]] void watchdog_fires() {
    std::vector<Lane*> live;
    for (uint32_t i = 0; i < lane_count; ++i)
      if (lanes[i].state != LaneState::kDone && lanes[i].state != LaneState::kUnstarted) live.push_back(&lanes[i]);
    std::ostringstream o;
    o << "kernel '" << ds->kernel->name << "' made no progress for " << ds->watchdog_ns / 1e9 << " s in threadgroup "
      << size3({group_pos.x, group_pos.y, group_pos.z}) << ": no thread finished and no threadgroup barrier opened ("
      << describe_lanes(live) << "). A spin-wait that never ends, or one that waits for another threadgroup, which "
      << "Metal does not promise to run at the same time? (MPS_EXT_EXECUTOR_WATCHDOG_SECONDS sets the limit)";
    if (current) fail(ErrorKind::kOther, o.str());
    ds->fail(ErrorKind::kOther, o.str());
    aborted = true;
  }

  // --------------------------------------------------------- resolution --
  // Per simdgroup, complete the simd operation of the lanes at the smallest
  // position, unless those wait at a threadgroup barrier. True if any was.
  bool resolve_simd() {
    bool progress = false;
    for (uint32_t g = 0; g < simdgroup_count; ++g) {
      uint32_t lo = g * 32, hi = std::min(lane_count, lo + 32);
      Lane* first = nullptr;
      for (uint32_t i = lo; i < hi; ++i) {
        Lane& l = lanes[i];
        if ((l.state == LaneState::kSimd || l.state == LaneState::kBarrier) &&
            (!first || compare_positions(l, *first) < 0))
          first = &l;
      }
      if (!first || first->state != LaneState::kSimd) continue;
      mx_simd_lane part[32] = {};
      uint32_t mask = 0;
      bool uniform = false, simd_barrier = false, matrix = false;
      uint32_t mem = 0;
      mx_simd_fn fn = first->fn;
      for (uint32_t i = lo; i < hi; ++i) {
        Lane& l = lanes[i];
        if (l.state != LaneState::kSimd || compare_positions(l, *first) != 0) continue;
        if (l.fn != fn || l.simd_barrier != first->simd_barrier) {
          std::ostringstream o;
          o << "internal error: threads " << first->index << " and " << l.index << " of kernel '" << ds->kernel->name
            << "' wait at different simd operations at the same position " << position_name(l);
          ds->fail(ErrorKind::kOther, o.str());
          return false;
        }
        mask |= 1u << (i - lo);
        part[i - lo] = {l.in, l.out, l.arg};
        uniform |= l.simd_barrier || (l.flags & MX_SIMD_UNIFORM);
        matrix |= !l.simd_barrier && (l.flags & MX_SIMD_MATRIX);
        simd_barrier |= l.simd_barrier;
        if (l.simd_barrier) mem |= l.flags;
      }
      std::string what = simd_barrier ? "simdgroup_barrier" : matrix ? "simdgroup matrix operation" : "";
      std::string in_group = " of threadgroup " + size3({group_pos.x, group_pos.y, group_pos.z});
      if (matrix && hi - lo < 32) {
        std::ostringstream o;
        o << "simdgroup matrix operation at " << position_name(*first) << " in kernel '" << ds->kernel->name
          << "' runs in simdgroup " << g << in_group << ", which has " << (hi - lo)
          << " threads: a simdgroup_matrix needs all 32 (threads_per_threadgroup "
          << size3({ds->tpt[0], ds->tpt[1], ds->tpt[2]}) << " is not a multiple of 32)";
        ds->fail(ErrorKind::kDivergence, o.str());
        return false;
      }
      uint32_t full = hi - lo == 32 ? ~0u : ((1u << (hi - lo)) - 1);
      if (uniform && mask != full) {
        std::vector<Lane*> missing;
        for (uint32_t i = lo; i < hi; ++i)
          if (!((mask >> (i - lo)) & 1)) missing.push_back(&lanes[i]);
        std::ostringstream o;
        o << what << " at " << position_name(*first) << " in kernel '" << ds->kernel->name << "' is reached by "
          << __builtin_popcount(mask) << " of the " << (hi - lo) << " threads of simdgroup " << g << in_group
          << "; every thread of the simdgroup must reach it (" << describe_lanes(missing) << ")";
        ds->fail(ErrorKind::kDivergence, o.str());
        return false;
      }
      if (simd_barrier) {
        if (mem & MX_MEM_THREADGROUP) ++sg_epoch[g];
        if (mem & MX_MEM_DEVICE) ++dsg_epoch[g];
        counters.simd_barriers++;
      } else {
        fn(part, mask, hi - lo);
        counters.simd_ops++;
        if (matrix) count_matrix(*first);
      }
      for (uint32_t i = lo; i < hi; ++i)
        if ((mask >> (i - lo)) & 1) {
          lanes[i].state = LaneState::kRunnable;
          runq.push_back(i);
        }
      progress = true;
    }
    return progress;
  }

  // A simdgroup_matrix operation the simdgroup completed: an MMA, or a load
  // or store whose memory (the address in `arg`, mx_metal.h) is this
  // worker's threadgroup arena or else device memory.
  void count_matrix(const Lane& l) {
    if (l.flags & MX_SIMD_MATRIX_MMA) {
      counters.mma++;
      if (l.flags & MX_SIMD_MATRIX_MMA_32) counters.mma_32++;
      return;
    }
    const char* p = reinterpret_cast<const char*>(static_cast<uintptr_t>(l.arg));
    bool tg = p >= arena && p < arena + kArenaSize;
    if (l.flags & MX_SIMD_MATRIX_LOAD) ++(tg ? counters.matrix_loads_tg : counters.matrix_loads_device);
    if (l.flags & MX_SIMD_MATRIX_STORE) ++(tg ? counters.matrix_stores_tg : counters.matrix_stores_device);
  }

  bool resolve_barrier() {
    Lane* first = nullptr;
    std::vector<Lane*> off;
    uint32_t mem = 0;
    for (uint32_t i = 0; i < lane_count; ++i) {
      Lane& l = lanes[i];
      if (l.state == LaneState::kBarrier) {
        if (!first) first = &l;
        mem |= l.flags;
      }
    }
    if (!first) return false;
    for (uint32_t i = 0; i < lane_count; ++i) {
      Lane& l = lanes[i];
      if (l.state != LaneState::kBarrier || compare_positions(l, *first) != 0) off.push_back(&l);
    }
    if (!off.empty()) {
      std::ostringstream o;
      o << "threadgroup_barrier at " << position_name(*first) << " in kernel '" << ds->kernel->name
        << "' is not reached by every thread of threadgroup " << size3({group_pos.x, group_pos.y, group_pos.z})
        << " on the same path: thread " << first->index << " waits there, " << describe_lanes(off);
      ds->fail(ErrorKind::kDivergence, o.str());
      return false;
    }
    if (mem & MX_MEM_THREADGROUP) {
      if (++epoch == 0) {
        std::fill(shadow.begin(), shadow.end(), Shadow{});
        epoch = 1;
      }
    }
    if (mem & MX_MEM_DEVICE) reset_device_races();
    else if (plain_barriers < 0xffff) ++plain_barriers;
    counters.barriers++;
    if (measuring) flush_instances();
    progress();
    for (uint32_t i = 0; i < lane_count; ++i) {
      lanes[i].state = LaneState::kRunnable;
      runq.push_back(i);
    }
    return true;
  }

  // ------------------------------------------------------------- running --
  static void fiber_main(void* self) {
    Worker* w = static_cast<Worker*>(self);
    for (;;) {
      Lane* l = w->current;
      l->state = LaneState::kRunning;
      w->ds->kernel->entry(&l->info);
      l->state = LaneState::kDone;
      w->counters.threads++;
      for (int k = 0; k < MX_OPS_COUNT; ++k) {
        w->counters.ops[k] += l->ops[k];
        w->counters.max_ops[k] = std::max<uint64_t>(w->counters.max_ops[k], l->ops[k]);
      }
      w->progress();
      // Run the next lane on this stack if it has not started yet.
      if (!w->runq.empty() && w->lanes[w->runq.back()].state == LaneState::kUnstarted && !w->ds->failed) {
        Lane* next = &w->lanes[w->runq.back()];
        w->runq.pop_back();
        next->stack = l->stack;
        l->stack = -1;
        w->current = next;
        continue;
      }
      w->free_stacks.push_back(l->stack);
      l->stack = -1;
      void* dead;
      mx_fiber_switch(&dead, w->scheduler_sp);
    }
  }

  void shuffle_runq() {
    // The order in which runnable lanes go: random, so that a kernel that
    // relies on one (a missing barrier) gives different results.
    for (size_t i = runq.size(); i > 1; --i) std::swap(runq[i - 1], runq[rng() % i]);
  }

  void setup_lanes(uint64_t linear) {
    DispatchState& d = *ds;
    const Dispatch& dp = *d.dispatch;
    uint32_t gx = static_cast<uint32_t>(linear % d.groups[0]);
    uint32_t gy = static_cast<uint32_t>((linear / d.groups[0]) % d.groups[1]);
    uint32_t gz = static_cast<uint32_t>(linear / (uint64_t(d.groups[0]) * d.groups[1]));
    group_pos = {gx, gy, gz};
    uint32_t size[3];
    for (int k = 0; k < 3; ++k) {
      uint32_t g = k == 0 ? gx : k == 1 ? gy : gz;
      size[k] = d.tpt[k];
      if (dp.use_threads) size[k] = std::min<uint32_t>(d.tpt[k], d.grid[k] - g * d.tpt[k]);
    }
    lane_count = size[0] * size[1] * size[2];
    simdgroup_count = (lane_count + 31) / 32;
    mx_uint3 actual{size[0], size[1], size[2]};
    uint32_t n = 0;
    for (uint32_t z = 0; z < size[2]; ++z)
      for (uint32_t y = 0; y < size[1]; ++y)
        for (uint32_t x = 0; x < size[0]; ++x, ++n) {
          Lane& l = lanes[n];
          l.reset();  // not Lane{}: the frames need no clearing
          l.index = n;
          mx_thread_info& t = l.info;
          t.buffers = d.buffer_table;
          t.tg_buffers = tg_table;
          t.thread_position_in_threadgroup = {x, y, z};
          t.threadgroup_position_in_grid = group_pos;
          t.thread_position_in_grid = {gx * d.tpt[0] + x, gy * d.tpt[1] + y, gz * d.tpt[2] + z};
          t.threads_per_threadgroup = actual;
          t.dispatch_threads_per_threadgroup = {d.tpt[0], d.tpt[1], d.tpt[2]};
          t.threadgroups_per_grid = {d.groups[0], d.groups[1], d.groups[2]};
          t.threads_per_grid = {d.grid[0], d.grid[1], d.grid[2]};
          t.thread_index_in_threadgroup = n;
          t.thread_index_in_simdgroup = n % 32;
          t.simdgroup_index_in_threadgroup = n / 32;
          t.simdgroups_per_threadgroup = simdgroup_count;
        }
  }

  // Runs one threadgroup; false if the dispatch failed.
  bool run_group(uint64_t linear) {
    aborted = false;
    rng.seed(splitmix(ds->dispatch->seed ^ splitmix(linear)));
    group_linear = linear;
    tag = static_cast<uint32_t>(linear % kTagLimit) + 1;
    dirty = pending = false;
    releases = 0;
    acquired = 0;
    verified = 0;
    progress();
    setup_lanes(linear);
    reset_threadgroup_memory();
    reset_device_races();
    std::fill(std::begin(dsg_epoch), std::end(dsg_epoch), 0u);
    if (aborted) return false;
    if (measuring) {
      reset_instances(true);
      group_reads.clear();
    }
    runq.clear();
    yieldq.clear();
    for (uint32_t i = 0; i < lane_count; ++i) runq.push_back(i);
    shuffle_runq();
    free_stacks.clear();
    for (size_t s = 0; s < stacks.size(); ++s) free_stacks.push_back(static_cast<int>(s));
    for (;;) {
      while (!runq.empty()) {
        Lane& l = lanes[runq.back()];
        runq.pop_back();
        current = &l;
        if (l.state == LaneState::kUnstarted) {
          l.stack = take_stack();
          FiberStack& st = stacks[l.stack];
          void* sp = fiber_prepare(st.base, st.size, &Worker::fiber_main, this);
          mx_fiber_switch(&scheduler_sp, sp);
        } else {
          l.state = LaneState::kRunning;
          mx_fiber_switch(&scheduler_sp, l.sp);
        }
        current = nullptr;
        if (aborted || ds->failed) return false;
      }
      if (!yieldq.empty()) {  // lanes that yielded at an atomic go again
        runq.swap(yieldq);
        shuffle_runq();
        continue;
      }
      watchdog();
      if (aborted) return false;
      if (resolve_simd()) {
        shuffle_runq();
        continue;
      }
      if (ds->failed) return false;
      if (resolve_barrier()) {
        shuffle_runq();
        continue;
      }
      counters.tg_memory = std::max(counters.tg_memory, arena_used);
      if (measuring && !ds->failed) {
        flush_instances();
        flush_group_reads();
      }
      return !ds->failed;
    }
  }

  void run(DispatchState* d) {
    ds = d;
    counters = Counters{};
    measuring = d->counters;
    all_reads.clear();
    FpControl fp(d->flush_denormals);    // restored when the job ends: the worker may be the caller's thread
    if (stack_bytes < d->stack_bytes) {  // stacks only grow
      for (auto& s : stacks) s.release();
      stacks.clear();
      stack_bytes = d->stack_bytes;
    }
    while (!d->failed) {
      uint64_t g = d->next_group.fetch_add(1);
      if (g >= d->group_count) break;
      if (!run_group((*d->order)(g))) break;
    }
    std::lock_guard<std::mutex> lock(d->mutex);
    d->totals.add(counters);
    if (measuring) all_reads.each([d](uint64_t key, uint32_t bits) { d->unique_reads.at(key, 0) |= bits; });
    ds = nullptr;
  }
};

thread_local Worker* tls_worker = nullptr;

Worker& this_worker() {
  if (!tls_worker) tls_worker = new Worker();  // lives as long as its thread
  return *tls_worker;
}

// ----------------------------------------------------------- engine api --
void api_access(const void* p, mx_u64 size, mx_u32 flags) {
  Worker* w = tls_worker;
  if (!w || !w->current) return;  // shader code running outside a dispatch
  w->access(reinterpret_cast<uintptr_t>(p), size, flags);
}
void api_barrier(mx_u32 scope, mx_u32 mem) { tls_worker->barrier(scope, mem); }
void api_simd(mx_simd_fn fn, const void* in, void* out, mx_i64 arg, mx_u32 flags) {
  tls_worker->simd(fn, in, out, arg, flags);
}
// Position updates come only from lanes; shader code run by the engine
// itself (a user-defined operator inside a simd reduction) has none.
void api_enter(mx_u32 key, mx_u32 site, mx_u32 depth) {
  Worker* w = tls_worker;
  if (w && w->current) w->enter(key, site, depth);
}
void api_leave() {
  Worker* w = tls_worker;
  if (w && w->current) w->leave();
}
void api_loop(mx_u32 key, mx_u32 site, mx_u32 depth) {
  Worker* w = tls_worker;
  if (w && w->current) w->loop(key, site, depth);
}
void api_fence(mx_u32 mem) {
  Worker* w = tls_worker;
  if (w && w->current && (mem & MX_MEM_DEVICE)) w->device_fence();
}
void api_conversion_error(mx_u32 flags, const char* file, mx_u32 line, mx_u32 col) {
  Worker* w = tls_worker;
  if (!w || !w->current) return;
  std::ostringstream where;
  if (file) where << file << ":" << line << ":" << col;
  else where << w->site_name(flags >> MX_CONV_SITE_SHIFT);
  std::ostringstream o;
  o << "kernel '" << w->ds->kernel->name << "' converts a NaN or out-of-range floating-point value to a "
    << (flags & 0x7f) << "-bit " << ((flags & MX_CONV_SIGNED) ? "signed" : "unsigned") << " integer at " << where.str()
    << " (" << w->thread_name(*w->current)
    << "); Metal leaves the result undefined: clamp the value into the integer's range (and handle NaN) first";
  w->fail(ErrorKind::kOther, o.str());
}
void api_arithmetic_error(mx_u32 kind, mx_u32 flags) {
  Worker* w = tls_worker;
  if (!w || !w->current) return;
  unsigned bits = flags & 0x7f;
  const char* sign = (flags & MX_CONV_SIGNED) ? "signed" : "unsigned";
  std::ostringstream o;
  o << "kernel '" << w->ds->kernel->name << "' ";
  if (kind == MX_ARITH_OVERFLOW) o << "divides the smallest " << bits << "-bit signed integer by -1";
  else if (kind == MX_ARITH_NEGATIVE_REMAINDER)
    o << "takes the remainder (%) of a negative " << bits << "-bit signed integer or by a negative one";
  else o << "divides a " << bits << "-bit " << sign << " integer by zero";
  o << " at " << w->site_name(flags >> MX_CONV_SITE_SHIFT) << " (" << w->thread_name(*w->current) << "); Metal "
    << (kind == MX_ARITH_NEGATIVE_REMAINDER ? "leaves % undefined when an operand is negative"
                                            : "gives an unspecified value")
    << ": guard the operands first";
  w->fail(ErrorKind::kOther, o.str());
}
void* api_threadgroup_variable(const void* key, mx_u64 size, mx_u64 align) {
  return tls_worker->threadgroup_variable(key, size, align);
}
void api_fail(const char* message) {
  Worker& w = *tls_worker;
  if (!w.current) {  // only lanes may fail; an engine callback never should
    fprintf(stderr, "CPU Metal executor: internal error: %s\n", message);
    abort();
  }
  w.fail(ErrorKind::kOther,
         std::string("kernel '") + w.ds->kernel->name + "': " + message + " (" + w.thread_name(*w.current) + ")");
}
const mx_thread_info* api_current_thread() { return &tls_worker->current->info; }
mx_u64* api_op_counts() {
  static thread_local mx_u64 outside[MX_OPS_COUNT];  // shader code run by no worker
  Worker* w = tls_worker;
  if (!w) return outside;
  return w->current ? w->current->ops : w->ops_sink;
}

const mx_engine_api kApi = {
    MX_ABI_VERSION,      &api_access,          &api_barrier, &api_simd, &api_threadgroup_variable, &api_fail,
    &api_current_thread, &api_enter,           &api_leave,   &api_loop, &api_conversion_error,     &api_fence,
    &api_op_counts,      &api_arithmetic_error};

// ----------------------------------------------------------- worker pool --
class Pool {
 public:
  static Pool& get() {
    static Pool* p = new Pool();  // never destroyed: threads outlive static destruction
    return *p;
  }
  unsigned size() const { return static_cast<unsigned>(threads_.size()) + 1; }

  // Run job on every pool thread and on the caller; return when all are done.
  void run(const std::function<void()>& job, unsigned want) {
    want = std::min(want, size());
    if (want <= 1) {
      job();
      return;
    }
    {
      std::lock_guard<std::mutex> g(m_);
      job_ = &job;
      pending_ = want - 1;
      active_ = want - 1;
      ++generation_;
    }
    cv_.notify_all();
    job();
    std::unique_lock<std::mutex> g(m_);
    done_cv_.wait(g, [&] { return pending_ == 0; });
    job_ = nullptr;
  }

 private:
  Pool() {
    unsigned n = std::thread::hardware_concurrency();
    if (const char* e = getenv("MPS_EXT_EXECUTOR_THREADS")) n = static_cast<unsigned>(std::max(1, atoi(e)));
    if (n == 0) n = 1;
    for (unsigned i = 1; i < n; ++i) threads_.emplace_back([this, i] { loop(i); });
    for (auto& t : threads_) t.detach();
  }
  void loop(unsigned id) {
    uint64_t seen = 0;
    for (;;) {
      const std::function<void()>* job;
      {
        std::unique_lock<std::mutex> g(m_);
        cv_.wait(g, [&] { return generation_ != seen && active_ > 0 && id <= active_; });
        seen = generation_;
        job = job_;
      }
      (*job)();
      {
        std::lock_guard<std::mutex> g(m_);
        if (--pending_ == 0) done_cv_.notify_all();
      }
    }
  }
  std::vector<std::thread> threads_;
  std::mutex m_;
  std::condition_variable cv_, done_cv_;
  const std::function<void()>* job_ = nullptr;
  unsigned pending_ = 0, active_ = 0;
  uint64_t generation_ = 0;
};

// ------------------------------------------------------------- recording --
std::mutex g_record_mutex;
std::vector<std::shared_ptr<Recorder>> g_recorders;

// One dispatch at a time: the slot region and the pool are shared.
std::mutex g_dispatch_mutex;

bool recording_counters() {
  std::lock_guard<std::mutex> g(g_record_mutex);
  for (const auto& r : g_recorders)
    if (r->counters) return true;
  return false;
}

std::string kernel_param_name(const mx_kernel& k, uint32_t kind, uint32_t index) {
  for (uint32_t i = 0; i < k.param_count; ++i)
    if (k.params[i].kind == kind && k.params[i].index == index) return k.params[i].name;
  return "";
}

}  // namespace

// ================================================================ Library ==
std::shared_ptr<Library> Library::load(const std::string& path) {
  void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h) throw std::runtime_error(std::string("CPU Metal executor: cannot load ") + path + ": " + dlerror());
  auto abi = reinterpret_cast<mx_u32 (*)()>(dlsym(h, MX_LIBRARY_ABI_SYMBOL));
  auto bind = reinterpret_cast<void (*)(const mx_engine_api*)>(dlsym(h, MX_LIBRARY_BIND_SYMBOL));
  auto kernels = reinterpret_cast<const mx_kernel* (*)(mx_u32*)>(dlsym(h, MX_LIBRARY_KERNELS_SYMBOL));
  auto sites = reinterpret_cast<const char* const* (*)(mx_u32*)>(dlsym(h, MX_LIBRARY_SITES_SYMBOL));
  auto frames = reinterpret_cast<const mx_u64* (*)(mx_u32*)>(dlsym(h, MX_LIBRARY_FRAMES_SYMBOL));
  auto infos = reinterpret_cast<const mx_kernel_info* (*)(mx_u32*)>(dlsym(h, MX_LIBRARY_KERNEL_INFO_SYMBOL));
  if (!abi || !bind || !kernels || !sites || !frames || !infos || abi() != MX_ABI_VERSION) {
    dlclose(h);
    throw std::runtime_error("CPU Metal executor: " + path + " was not built for this version of the executor");
  }
  std::shared_ptr<Library> lib(new Library());
  lib->handle_ = h;
  lib->path_ = path;
  bind(&kApi);
  lib->kernels_ = kernels(&lib->kernel_count_);
  lib->sites_ = sites(&lib->site_count_);
  lib->frames_ = frames(&lib->frame_count_);
  lib->infos_ = infos(&lib->info_count_);
  return lib;
}

Library::~Library() {
  // Shader libraries stay loaded: a pointer into one may outlive this
  // object (a pipeline cache, a recorded site name), and they are small.
}

std::vector<std::string> Library::function_names() const {
  std::vector<std::string> names;
  for (uint32_t i = 0; i < kernel_count_; ++i) names.push_back(kernels_[i].name);
  return names;
}

const mx_kernel& Library::kernel(const std::string& name) const {
  for (uint32_t i = 0; i < kernel_count_; ++i)
    if (name == kernels_[i].name) return kernels_[i];
  std::ostringstream o;
  o << "no kernel named '" << name << "' in this library; it has:";
  for (uint32_t i = 0; i < kernel_count_; ++i) o << (i ? ", " : " ") << kernels_[i].name;
  throw DispatchError(o.str());
}

KernelInfo Library::kernel_info(const std::string& name) const {
  size_t i = static_cast<size_t>(&kernel(name) - kernels_);
  KernelInfo info;
  if (i < info_count_) {
    const mx_kernel_info& k = infos_[i];
    info.registers = k.registers;
    info.uniform_registers = k.uniform_registers;
    info.private_bytes = k.private_bytes;
    info.loads_in_flight = k.loads_in_flight;
    info.hot_loop = k.hot_loop ? k.hot_loop : "";
    info.loads_after_barrier = k.loads_after_barrier;
  }
  return info;
}

std::string Library::site(uint32_t index) const {
  if (index == 0 || index >= site_count_) return "";
  return sites_[index];
}

Stats Library::dispatch(const std::string& name, const Dispatch& dp) const {
  const mx_kernel& k = kernel(name);
  auto error = [&](const std::string& msg) { return DispatchError("kernel '" + name + "': " + msg); };

  // ---- the grid
  uint64_t per_group =
      uint64_t(dp.threads_per_threadgroup[0]) * dp.threads_per_threadgroup[1] * dp.threads_per_threadgroup[2];
  if (per_group == 0 || per_group > kMaxThreads)
    throw error("threads_per_threadgroup " + size3(dp.threads_per_threadgroup) + " has " + std::to_string(per_group) +
                " threads; Metal allows 1 to 1024");
  if (k.max_total_threads_per_threadgroup && per_group > k.max_total_threads_per_threadgroup)
    throw error("threads_per_threadgroup " + size3(dp.threads_per_threadgroup) +
                " exceeds the kernel's [[max_total_threads_per_threadgroup(" +
                std::to_string(k.max_total_threads_per_threadgroup) + ")]]");
  DispatchState ds;
  ds.library = this;
  ds.kernel = &k;
  ds.dispatch = &dp;
  ds.tpt = dp.threads_per_threadgroup;
  for (int i = 0; i < 3; ++i) {
    if (dp.use_threads) {
      if (dp.threads[i] == 0) throw error("threads " + size3(dp.threads) + " has a zero dimension");
      ds.grid[i] = dp.threads[i];
      ds.groups[i] = (dp.threads[i] + ds.tpt[i] - 1) / ds.tpt[i];
    } else {
      if (dp.threadgroups[i] == 0) throw error("threadgroups " + size3(dp.threadgroups) + " has a zero dimension");
      ds.groups[i] = dp.threadgroups[i];
      uint64_t g = uint64_t(dp.threadgroups[i]) * ds.tpt[i];
      if (g > 0xffffffffull) throw error("the grid has more than 2^32 threads along one dimension");
      ds.grid[i] = static_cast<uint32_t>(g);
    }
  }
  ds.group_count = uint64_t(ds.groups[0]) * ds.groups[1] * ds.groups[2];
  ds.order.reset(new Permutation(ds.group_count, dp.seed));
  ds.flush_denormals = flush_denormals();
  ds.counters = dp.counters || recording_counters();
  ds.watchdog_ns = static_cast<uint64_t>(watchdog_seconds() * 1e9);

  // ---- thread-private memory: stacks large enough for the kernel's frames
  size_t kernel_index = static_cast<size_t>(&k - kernels_);
  uint64_t frame = kernel_index < frame_count_ ? frames_[kernel_index] : 0;
  if (frame > kMaxThreadPrivate)
    throw KernelError("kernel '" + name + "' needs about " + std::to_string(frame >> 10) +
                      " KiB of thread-private memory per thread (its local arrays and those of the functions it "
                      "calls); the CPU Metal executor allows " +
                      std::to_string(kMaxThreadPrivate >> 20) +
                      " MiB: keep large arrays in device or threadgroup memory");
  ds.stack_bytes =
      std::max<size_t>(min_stack_size(), (frame + kStackMargin + page_size() - 1) / page_size() * page_size());

  // ---- the arguments
  uint32_t max_buffer = 0, max_tg = 0;
  bool any_buffer = false, any_tg = false;
  for (uint32_t i = 0; i < k.param_count; ++i) {
    const mx_param& p = k.params[i];
    if (p.kind == MX_PARAM_BUFFER) {
      any_buffer = true;
      max_buffer = std::max(max_buffer, p.index);
    } else if (p.kind == MX_PARAM_THREADGROUP) {
      any_tg = true;
      max_tg = std::max(max_tg, p.index);
    }
  }
  size_t want_buffers = any_buffer ? max_buffer + 1 : 0, want_tg = any_tg ? max_tg + 1 : 0;
  if (dp.buffers.size() != want_buffers)
    throw error("takes " + std::to_string(want_buffers) + " buffer arguments ([[buffer(0)]] to [[buffer(" +
                std::to_string(want_buffers ? want_buffers - 1 : 0) + ")]]), " + std::to_string(dp.buffers.size()) +
                " given");
  if (dp.threadgroup_memory.size() != want_tg)
    throw error("has " + std::to_string(want_tg) + " [[threadgroup(i)]] parameters, but threadgroup_memory gives " +
                std::to_string(dp.threadgroup_memory.size()) + " sizes");
  for (size_t i = 0; i < dp.buffers.size(); ++i) {
    std::string pname = kernel_param_name(k, MX_PARAM_BUFFER, static_cast<uint32_t>(i));
    if (pname.empty() && dp.buffers[i].kind != Binding::Kind::kNone)
      throw error("has no [[buffer(" + std::to_string(i) + ")]] parameter; pass None there");
  }
  uint64_t tg_total = 0;
  for (size_t i = 0; i < dp.threadgroup_memory.size(); ++i) {
    uint64_t sz = dp.threadgroup_memory[i];
    std::string pname = kernel_param_name(k, MX_PARAM_THREADGROUP, static_cast<uint32_t>(i));
    if (pname.empty() && sz) throw error("has no [[threadgroup(" + std::to_string(i) + ")]] parameter");
    if (sz % 16)
      throw error("threadgroup_memory[" + std::to_string(i) + "] = " + std::to_string(sz) +
                  " bytes; Metal needs a multiple of 16");
    tg_total += sz;
    ds.tg_buffers.push_back({0, sz});
    ds.tg_names.push_back("threadgroup buffer " + std::to_string(i) + " ('" + pname + "', " + std::to_string(sz) +
                          " bytes)");
  }
  if (tg_total > kThreadgroupLimit)
    throw error("asks for " + std::to_string(tg_total) + " bytes of threadgroup memory; Metal allows 32768");

  for (uint32_t i = 0; i < k.param_count; ++i) {
    const mx_param& p = k.params[i];
    if (p.kind != MX_PARAM_BUFFER) continue;
    const Binding& b = dp.buffers[p.index];
    std::string what = "parameter '" + std::string(p.name) + "' ([[buffer(" + std::to_string(p.index) + ")]])";
    if (b.kind == Binding::Kind::kNone) throw error(what + " is not bound");
    if (b.kind == Binding::Kind::kBytes && !(p.flags & MX_PARAM_READONLY))
      throw error(what + " is a writable device buffer; bind a tensor, not bytes");
    if (p.flags & MX_PARAM_REFERENCE) {
      if (b.kind == Binding::Kind::kBytes && b.size != p.pointee_size)
        throw error(what + " is a reference to a " + std::to_string(p.pointee_size) + "-byte struct, but " +
                    std::to_string(b.size) + " bytes were given (does the host struct match the shader's?)");
      if (b.size < p.pointee_size)
        throw error(what + " is a reference to " + std::to_string(p.pointee_size) + " bytes, but the buffer has " +
                    std::to_string(b.size));
    }
  }

  std::lock_guard<std::mutex> serial(g_dispatch_mutex);

  // ---- place the buffers
  std::vector<Bound>& bound = ds.bound;
  for (size_t i = 0; i < dp.buffers.size(); ++i) {
    const Binding& b = dp.buffers[i];
    if (b.kind == Binding::Kind::kNone) continue;
    Bound x;
    x.index = static_cast<int>(i);
    x.size = b.size;
    x.from_bytes = b.kind == Binding::Kind::kBytes;
    x.begin =
        x.from_bytes ? const_cast<char*>(reinterpret_cast<const char*>(b.bytes.data())) : static_cast<char*>(b.data);
    x.name = kernel_param_name(k, MX_PARAM_BUFFER, static_cast<uint32_t>(i));
    x.origin = x.from_bytes ? 0 : b.origin;
    for (uint32_t j = 0; j < k.param_count; ++j)
      if (k.params[j].kind == MX_PARAM_BUFFER && k.params[j].index == i)
        x.writable = !x.from_bytes && !(k.params[j].flags & MX_PARAM_READONLY);
    bound.push_back(x);
  }
  SlotRegion& region = slot_region();
  ds.isolated = dp.isolate && region.base;
  ds.slot_base = reinterpret_cast<uintptr_t>(region.base);
  ds.slot_span = region.span;
  // Isolated: buffers whose memory overlaps share one copy (a kernel may read
  // and write the same tensor through two arguments).
  struct Copy {
    char* host;
    uint64_t size;
    char* at;
    std::vector<int> members;
    bool writable;
  };
  std::vector<Copy> copies;
  if (ds.isolated) {
    std::vector<int> order(bound.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
    std::sort(order.begin(), order.end(), [&](int a, int b) { return bound[a].begin < bound[b].begin; });
    for (int m : order) {
      Bound& b = bound[m];
      if (!copies.empty() && !b.from_bytes && b.begin < copies.back().host + copies.back().size &&
          !bound[copies.back().members[0]].from_bytes) {
        Copy& c = copies.back();
        c.size = std::max<uint64_t>(c.size, b.begin + b.size - c.host);
        c.members.push_back(m);
        c.writable |= b.writable;
      } else {
        copies.push_back({b.begin, b.size, nullptr, {m}, b.writable});
      }
    }
    // A buffer larger than half a slot (32 GiB) cannot be isolated: run the
    // whole dispatch on the caller's memory instead.
    for (const Copy& c : copies)
      if (c.size > kSlotMid) ds.isolated = false;
    if (!ds.isolated) copies.clear();
  }
  if (ds.isolated) {
    ds.slot_members.assign(copies.size(), {});
    size_t page = page_size();
    for (size_t s = 0; s < copies.size(); ++s) {
      Copy& c = copies[s];
      char* slot = region.base + (uint64_t(s) << kSlotShift) + kSlotMid;
      // Keep the address's alignment within a page, so that misaligned data
      // stays misaligned.
      c.at = slot + (reinterpret_cast<uintptr_t>(c.host) & (page - 1));
      uint64_t len = (c.at - slot) + c.size;
      len = (len + page - 1) / page * page;
      if (len && mprotect(slot, len, PROT_READ | PROT_WRITE) != 0)
        throw std::runtime_error("CPU Metal executor: cannot map a buffer copy");
      if (c.size) std::memcpy(c.at, c.host, c.size);
      for (int m : c.members) {
        bound[m].begin = c.at + (bound[m].begin - c.host);
        bound[m].race_checked = c.writable;  // also a read-only view of memory another argument writes
        ds.slot_members[s].push_back(m);
      }
      // Which threadgroup wrote each byte, for the check of reads across
      // threadgroups; reserved, so only pages the kernel touches cost memory.
      if (c.writable && c.size && c.size <= kShadowLimit) {
        void* t = mmap(nullptr, c.size * 4, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (t != MAP_FAILED) {
          ds.shadows[s].at = c.at;
          ds.shadows[s].size = c.size;
          ds.shadows[s].tags = static_cast<uint32_t*>(t);
        }
      }
    }
  }
  if (!ds.isolated)
    for (Bound& b : bound) b.race_checked = b.writable;
  for (const Bound& b : bound) ds.buffer_table[b.index] = b.begin;

  // ---- run
  unsigned want = static_cast<unsigned>(std::min<uint64_t>(ds.group_count, Pool::get().size()));
  Pool::get().run([&] { this_worker().run(&ds); }, want);

  // ---- copy back (unless the kernel failed: then the caller's memory is
  // left as it was) and release
  if (ds.isolated) {
    size_t page = page_size();
    for (size_t s = 0; s < copies.size(); ++s) {
      Copy& c = copies[s];
      bool written = false;
      for (int m : c.members) written |= ds.totals.written[bound[m].index] > 0;
      if (written && ds.error == ErrorKind::kNone && !bound[c.members[0]].from_bytes && c.size)
        std::memcpy(c.host, c.at, c.size);
      char* slot = region.base + (uint64_t(s) << kSlotShift) + kSlotMid;
      uint64_t len = ((c.at - slot) + c.size + page - 1) / page * page;
      if (len) mmap(slot, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
      if (ds.shadows[s].tags) munmap(ds.shadows[s].tags, ds.shadows[s].size * 4);
    }
  }

  if (ds.error != ErrorKind::kNone) {
    switch (ds.error) {
      case ErrorKind::kBounds: throw OutOfBoundsError(ds.message);
      case ErrorKind::kAlign: throw MisalignedAccessError(ds.message);
      case ErrorKind::kDivergence: throw BarrierDivergenceError(ds.message);
      case ErrorKind::kRace: throw RaceError(ds.message);
      default: throw KernelError(ds.message);
    }
  }

  Stats st;
  st.kernel = name;
  st.threadgroups = ds.groups;
  st.threads_per_threadgroup = ds.tpt;
  st.threads = ds.totals.threads;
  st.barriers = ds.totals.barriers;
  st.simdgroup_barriers = ds.totals.simd_barriers;
  st.simd_operations = ds.totals.simd_ops;
  st.threadgroup_bytes_read = ds.totals.tg_read;
  st.threadgroup_bytes_written = ds.totals.tg_written;
  size_t n = dp.buffers.size();
  st.bytes_read.assign(n, 0);
  st.bytes_written.assign(n, 0);
  st.read_widths.assign(n, {});
  st.write_widths.assign(n, {});
  st.bound_from_bytes.assign(n, false);
  for (size_t i = 0; i < n; ++i) st.bound_from_bytes[i] = dp.buffers[i].kind == Binding::Kind::kBytes;
  for (size_t i = 0; i < n; ++i)
    st.buffer_names.push_back(kernel_param_name(k, MX_PARAM_BUFFER, static_cast<uint32_t>(i)));
  st.kernel_info = kernel_info(name);
  st.int64_divisions = ds.totals.ops[MX_OPS_INT64_DIVISIONS];
  st.int64_multiplications = ds.totals.ops[MX_OPS_INT64_MULTIPLICATIONS];
  st.max_int64_divisions = ds.totals.max_ops[MX_OPS_INT64_DIVISIONS];
  st.max_int64_multiplications = ds.totals.max_ops[MX_OPS_INT64_MULTIPLICATIONS];
  st.int32_divisions = ds.totals.ops[MX_OPS_INT32_DIVISIONS];
  st.float_divisions = ds.totals.ops[MX_OPS_FLOAT_DIVISIONS];
  st.max_int32_divisions = ds.totals.max_ops[MX_OPS_INT32_DIVISIONS];
  st.max_float_divisions = ds.totals.max_ops[MX_OPS_FLOAT_DIVISIONS];
  st.threadgroup_memory = ds.totals.tg_memory;
  st.instructions = ds.totals.ops[MX_OPS_INSTRUCTIONS];
  st.max_instructions = ds.totals.max_ops[MX_OPS_INSTRUCTIONS];
  st.simdgroup_mmas = ds.totals.mma;
  st.simdgroup_mmas_32 = ds.totals.mma_32;
  st.matrix_loads_threadgroup = ds.totals.matrix_loads_tg;
  st.matrix_loads_device = ds.totals.matrix_loads_device;
  st.matrix_stores_threadgroup = ds.totals.matrix_stores_tg;
  st.matrix_stores_device = ds.totals.matrix_stores_device;
  st.counters = ds.counters;
  if (ds.counters) {
    st.cache_lines.assign(ds.totals.lines, ds.totals.lines + n);
    st.cache_lines_minimum.assign(ds.totals.min_lines, ds.totals.min_lines + n);
    st.threadgroup_memory_instructions = ds.totals.tg_instructions;
    st.bank_conflict_cycles = ds.totals.bank_cycles;
    st.threadgroup_bytes_read_distinct.assign(ds.totals.group_read, ds.totals.group_read + n);
    st.unique_bytes_read.assign(n, 0);
    ds.unique_reads.each([&](uint64_t key, uint32_t bits) {
      if ((key >> 48) < n) st.unique_bytes_read[key >> 48] += __builtin_popcount(bits);
    });
  }
  for (size_t i = 0; i < n; ++i) {
    st.bytes_read[i] = ds.totals.read[i];
    st.bytes_written[i] = ds.totals.written[i];
    for (int w = 0; w < 8; ++w) {
      if (ds.totals.read_width[i][w]) st.read_widths[i][1u << w] = ds.totals.read_width[i][w];
      if (ds.totals.write_width[i][w]) st.write_widths[i][1u << w] = ds.totals.write_width[i][w];
    }
  }
  {
    std::lock_guard<std::mutex> g(g_record_mutex);
    for (auto& r : g_recorders) r->dispatches.push_back(st);
  }
  return st;
}

void start_recording(const std::shared_ptr<Recorder>& r) {
  std::lock_guard<std::mutex> g(g_record_mutex);
  g_recorders.push_back(r);
}

void stop_recording(const std::shared_ptr<Recorder>& r) {
  std::lock_guard<std::mutex> g(g_record_mutex);
  g_recorders.erase(std::remove(g_recorders.begin(), g_recorders.end(), r), g_recorders.end());
}

unsigned worker_count() { return Pool::get().size(); }

}  // namespace cpu_metal
