"""The CPU Metal executor: run Metal Shading Language kernels, unmodified, on
the CPU, with Metal's execution model, checked. A package of its own
(mps-ext-executor, executor/ in mps_ext's repository): mps_ext's tests and
contributors use it, mps_ext's users do not need it.

    import mps_ext_executor as cpu_metal
    lib = cpu_metal.compile_library(source, defines={"N": 4})
    lib.function_names
    stats = lib.dispatch("name", [t0, t1, np.uint32(7), struct_bytes],
                         threadgroups=(gx, gy, gz), threads_per_threadgroup=(tx, ty, tz),
                         threadgroup_memory=[4096])   # or threads=(x, y, z)

Argument i binds [[buffer(i)]]: a CPU torch tensor binds its storage from its
storage offset to the storage's end, and the kernel writes it in place (so
does a numpy array); bytes, numpy scalars and numpy structured scalars bind
as constant data of exactly their size. threadgroup_memory[i] sizes the
[[threadgroup(i)]] parameter.

Threadgroups start, and the threads of a threadgroup run as fibers, in a
seeded random order; simd operations run over the threads on the same
control-flow path. Out-of-bounds and misaligned accesses (OutOfBoundsError,
MisalignedAccessError), barriers not every thread reaches on the same path
and simdgroup matrices in partial simdgroups (BarrierDivergenceError), races
on threadgroup memory and unsynchronised reads of another threadgroup's device
writes (RaceError), float-to-integer conversions of NaN or out-of-range values
and spin-waits that never end (KernelError) raise the errors below (all
KernelError). Environment: MPS_EXT_EXECUTOR_WATCHDOG_SECONDS (default 60),
MPS_EXT_EXECUTOR_DENORMALS=keep (fp32 and bfloat denormals are flushed, as on
Apple GPUs, unless set), MPS_EXT_EXECUTOR_CONTRACT=off and
MPS_EXT_EXECUTOR_PERTURB=n (the MathMode shaders compile in; also
`with cpu_metal.math_mode(contract=False, perturb=1):`). Each dispatch returns DispatchStats: bytes read and
written per buffer, barriers, threads, 64-bit integer divisions and
multiplications, and the kernel's static costs (kernel_info: registers,
private memory, loads in flight); with counters=True also coalescing per
buffer and threadgroup-memory bank conflicts.
`with cpu_metal.record() as rec:` collects the stats of every dispatch made
inside it, from Python or from C++ (the op layer); record(counters=True)
turns the counters on for all of them.
`with cpu_metal.run_model(torch_release="2.13") as report:` runs a whole
model's CPU tensor ops through mps_ext's kernels where a Mac with that torch
would (docs/dev/model_runner.md).

As mps_ext's backend of CPU tensors: `install()` registers the executor with
mps_ext's op layer (through mps_ext._C._backend_slot(); mps_ext has no
backend of CPU tensors of its own), after which torch.ops.mps_ext ops on CPU
tensors run their Metal kernels here. mps_ext's modules take their kernels'
path on CPU tensors only inside `request()`; on a Mac (a Metal backend
present) the op layer's CPU calls reach the executor only there too.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
from typing import Sequence

import numpy as np
import torch  # noqa: F401  (loads the libraries the extension links against)

from . import _C, _compiler
from ._compiler import CompileError, Diagnostic, MathMode, build, cache_dir

KernelError = _C.KernelError
OutOfBoundsError = _C.OutOfBoundsError
MisalignedAccessError = _C.MisalignedAccessError
BarrierDivergenceError = _C.BarrierDivergenceError
RaceError = _C.RaceError
DispatchError = _C.DispatchError

__all__ = [
    "compile_library", "Library", "DispatchStats", "KernelInfo", "record", "set_default_seed", "worker_count",
    "FULL_OCCUPANCY_REGISTERS", "MAX_REGISTERS", "occupancy", "registers_for", "GPU", "gpu", "set_gpu",
    "THREADGROUP_MEMORY_PER_CORE", "MAX_THREADGROUP_MEMORY", "threadgroups_per_core",
    "MMA_FMAS", "MMA_ISSUE_SLOTS", "MMA_ISSUE_SLOTS_32", "MATRIX_MEMORY_ISSUE_SLOTS",
    "run_model", "ModelReport", "CompileError", "Diagnostic", "KernelError", "OutOfBoundsError",
    "MisalignedAccessError",
    "BarrierDivergenceError", "RaceError", "DispatchError", "cache_dir", "MathMode", "math_mode", "set_math_mode",
]

_default_seed = int(os.environ.get("MPS_EXT_EXECUTOR_SEED", "0"))

# The register budget of a thread, in 32-bit registers as KernelInfo.registers
# counts them. Apple GPUs (G13, M1; M2 is the same family) give a thread up to
# 128 32-bit registers, addressable as 256 16-bit halves (Dougall Johnson's
# reverse-engineered "Apple G13 GPU Architecture Reference",
# github.com/dougallj/applegpu). The more a kernel uses, the fewer threads a
# core keeps resident: Alyssa Rosenzweig measured, through the pipeline's
# maxTotalThreadsPerThreadgroup, from 1024 threads at the lowest register
# pressure down to 384 at the highest, which puts the register file at
# 208 KiB or more per core ("Dissecting the Apple M1 GPU, part III", 2021,
# rosenzweig.io/blog/asahi-gpu-part-3.html; discussed in realworldtech.com
# forum thread 201676); Philip Turner's measurements give the same ~208 KB per
# core for Apple 7 and 8 (github.com/philipturner/metal-benchmarks, "On-Chip
# Memory"). 208 KiB over 1024 threads is 208 bytes, 52 32-bit registers: a
# kernel within that keeps a full 1024 threads per core; 128 (512 bytes)
# leaves 384. From Apple family 9 (M3) registers are allocated dynamically
# ("Dynamic Caching"), so the budget matters most on M1 and M2. Memory-bound
# kernels need full occupancy to hide the latency of their loads.
# The whole curve is in Mesa's compiler for these GPUs, as (16-bit registers,
# threads) pairs: up to 104 halves (52 registers) 1024 threads, ..., 256
# halves (128) 384 (src/asahi/compiler/agx_performance.c, `occupancies`,
# Alyssa Rosenzweig, 2023). A compute pipeline keeps its whole threadgroup on
# one core, so the same figure bounds the threadgroup size a pipeline allows
# (maxTotalThreadsPerThreadgroup): a kernel that needs 1024 threads in a
# threadgroup must fit 52 registers.
FULL_OCCUPANCY_REGISTERS = 52
MAX_REGISTERS = 128
_OCCUPANCY = ((52, 1024), (56, 896), (64, 832), (68, 768), (72, 704), (80, 640), (92, 576), (104, 512),
              (116, 448), (128, 384))  # (32-bit registers, threads), Mesa's table in 32-bit units


def occupancy(registers: int) -> int:
    """Threads an Apple GPU core (M1/M2) keeps resident for a kernel using
    `registers` 32-bit registers per thread (KernelInfo.registers), which is
    also the largest threadgroup its pipeline allows; 0 beyond
    MAX_REGISTERS, where the compiler spills."""
    return next((threads for most, threads in _OCCUPANCY if registers <= most), 0)


# The compute counters' issue-slot model (DispatchStats.issue_slots; docs/dev/
# contributing.md, "Compute efficiency"). A simdgroup issues one instruction
# for its 32 lanes; an 8x8x8 simdgroup_multiply_accumulate is 512 FMAs and
# occupies the simdgroup's issue for about 17 cycles with 16-bit operands
# and 18 with 32-bit ones: Philip Turner's measured throughputs of
# MATMUL<8x8xF16> (~17 cycles) and MATMUL<8x8xF32> (~18), M1 family
# (github.com/philipturner/metal-benchmarks, README, "Intra-simd
# communication"; a plain FFMA32 is 1 cycle there, so 512 FMAs over 32 lanes
# is 16 slots at best). A simdgroup_load or simdgroup_store counts as one
# slot: each lane moves its two adjacent elements, one memory instruction.
# That one is an assumption (no published measurement), as is one slot per
# IR instruction of the shader: the ratio is an estimate to compare tiled
# kernels with each other, not a cycle count.
MMA_FMAS = 8 * 8 * 8
MMA_ISSUE_SLOTS, MMA_ISSUE_SLOTS_32 = 17, 18
MATRIX_MEMORY_ISSUE_SLOTS = 1


def registers_for(threads: int) -> int:
    """The most 32-bit registers a thread may use for a core to keep
    `threads` threads (or a threadgroup of that size) resident."""
    if not 0 < threads <= 1024:
        raise ValueError(f"threads must be in 1..1024, got {threads}")
    return max(most for most, n in _OCCUPANCY if n >= threads)


# Threadgroup memory. A threadgroup may allocate at most 32 KiB on every
# Apple GPU family (Apple's "Metal Feature Set Tables",
# developer.apple.com/metal/Metal-Feature-Set-Tables.pdf: maximum total
# threadgroup memory allocation, 32 KB; the executor refuses more). A core
# has 64 KB of it (Philip Turner, github.com/philipturner/metal-benchmarks,
# "Layout of an M1 GPU Core": shared memory per core, Apple 7 and 8), which
# its resident threadgroups share: a threadgroup that uses 24 KB leaves room
# for two, one that uses 32 KB for two, 33 KB for one. The rule assumed here
# is that a core keeps a threadgroup resident only while both its threadgroup
# memory and its threads (registers, `occupancy`) fit beside the others; the
# fewer resident threadgroups, the less one's barrier and load latency is
# hidden by another's work. From Apple family 9 (M3) on-chip memory is
# allocated dynamically, so this matters most on M1 and M2.
THREADGROUP_MEMORY_PER_CORE = 64 * 1024
MAX_THREADGROUP_MEMORY = 32 * 1024


def threadgroups_per_core(threadgroup_memory: int, threads: int, registers: int = 0) -> int:
    """Threadgroups of `threads` threads, each allocating `threadgroup_memory`
    bytes and using `registers` 32-bit registers a thread, that an M1/M2
    core keeps resident: the fewest of THREADGROUP_MEMORY_PER_CORE //
    threadgroup_memory and occupancy(registers) // threads (0: the
    threadgroup does not fit a core)."""
    if threads <= 0:
        raise ValueError(f"threads must be positive, got {threads}")
    by_threads = occupancy(registers) // threads
    if threadgroup_memory <= 0:
        return by_threads
    if threadgroup_memory > MAX_THREADGROUP_MEMORY:
        return 0
    return min(by_threads, THREADGROUP_MEMORY_PER_CORE // threadgroup_memory)


@dataclasses.dataclass(frozen=True)
class GPU:
    """The GPU the ops' launch geometry assumes (csrc/dispatch/kernel_choice.h):
    its core count and Apple GPU family (7: M1, 8: M2, 9: M3 and M4; 0:
    unknown). On a Mac it is read from the GPU once; the executor stands
    for whichever one set_gpu names, by default the largest (an 80-core M3
    Ultra)."""

    cores: int
    family: int = 9


def gpu(device: str = "cpu") -> GPU:
    """The GPU the ops' launch geometry assumes on `device` ("cpu": the
    executor's, "mps": the Mac's)."""
    if device == "cpu":
        cores, family = _C._profile()
    else:
        import mps_ext
        cores, family = mps_ext._C._device_profile(device)
    return GPU(cores, family)


def set_gpu(profile: GPU) -> GPU:
    """Let the executor stand for `profile` in the ops' launch geometry
    (tests sweep a small and a large GPU with it); returns the one before."""
    if not isinstance(profile, GPU):
        raise TypeError(f"set_gpu takes a cpu_metal.GPU, not {type(profile).__name__}")
    if profile.cores < 1:
        raise ValueError(f"a GPU has at least 1 core, got cores={profile.cores}")
    if profile.family < 0:
        raise ValueError(f"a GPU family is 0 (unknown) or an Apple GPU family number (7, 8, 9), got {profile.family}")
    before = gpu()
    _C._set_profile(int(profile.cores), int(profile.family))
    return before


def set_math_mode(mode: MathMode) -> MathMode:
    """Compile shaders in `mode` (MathMode: contraction of multiply-adds,
    functions at the specification's accuracy bound) from now on, the op
    layer's libraries too (dropped, to be compiled again at their next
    launch); returns the mode before. Libraries compiled before keep theirs."""
    before = _compiler.set_math_mode(mode)
    if mode != before:
        _C._forget_libraries()
    return before


@contextlib.contextmanager
def math_mode(**changes):
    """Compile shaders inside the block in the current MathMode with
    `changes`, e.g. `with cpu_metal.math_mode(contract=False):` (a rounded
    product and sum for every `a * b + c`, which Metal's Safe math allows as
    well as the fma) or `math_mode(perturb=1)` (exp, log, ... as far off as
    the specification allows)."""
    before = set_math_mode(dataclasses.replace(_compiler.math_mode(), **changes))
    try:
        yield _compiler.math_mode()
    finally:
        set_math_mode(before)


def set_default_seed(seed: int) -> None:
    """Seed of the thread order for dispatches that do not give one."""
    global _default_seed
    _default_seed = int(seed)


def worker_count() -> int:
    """CPU threads that run threadgroups in parallel."""
    return _C.executor_worker_count()


@dataclasses.dataclass(frozen=True)
class KernelInfo:
    """What a kernel costs a GPU beyond its bytes, from its optimised IR
    (computed when the library is built; see executor/mps_ext_executor/_analysis.py
    and docs/dev/contributing.md)."""

    registers: int  # 32-bit registers live per thread at the peak (16-bit values count half)
    uniform_registers: int  # values the same for the whole dispatch (buffer addresses, parameters)
    private_bytes: int  # thread-private arrays that stay in (stack) memory
    loads_in_flight: int  # independent device loads per iteration of the hot loop
    hot_loop: str  # the hot loop's source position, "" if the kernel has none
    loads_after_barrier: int = 0  # device loads of a loop's iteration that wait behind a threadgroup barrier

    @classmethod
    def _from_native(cls, d: dict) -> "KernelInfo":
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls)})


@dataclasses.dataclass
class DispatchStats:
    """What one dispatch did, from the executor's counters.

    Bytes, barriers, simd operations and threads are counted as the kernel
    runs. What a GPU pays beyond bytes (docs/dev/contributing.md, "What a kernel costs a GPU
    beyond its bytes", has the details and limits of each):
    - int64_divisions / int64_multiplications (always counted): an increment
      the instrumenter puts after optimisation before every 64-bit integer
      sdiv/udiv/srem/urem by a run-time value, and every 64-bit mul (a
      division by a constant counts as a multiplication, by a power of two
      as nothing); totals, per-thread means, and the busiest thread.
    - kernel_info (static, computed when the library is built, see
      KernelInfo): registers from SSA liveness over the kernel's IR optimised
      as a GPU compiler would; private_bytes from the allocas that stay;
      loads_in_flight from the independent device loads of the hot loop.
    - with counters=True only (`counters` says whether they were measured):
      cache_lines / cache_lines_minimum per buffer, from the byte ranges of
      the active lanes of each simdgroup memory instruction (lanes matched
      by access site and SIMT position): the distinct 128-byte lines they
      touch, counted from the start of the storage, and the fewest lines
      their distinct bytes fit in; `coalescing` is their ratio.
      threadgroup_memory_instructions and bank_conflict_cycles, from the
      same instructions on threadgroup memory: the most distinct 4-byte
      words in one of 32 banks, less the distinct words over 32 banks
      (several lanes on one word is a broadcast, free).
      threadgroup_bytes_read_distinct / unique_bytes_read per buffer: the
      distinct bytes each threadgroup read, summed over threadgroups, and
      those of the whole dispatch; `reread_factor` is their ratio.
    - int32_divisions / float_divisions (always counted): 32-bit integer
      divisions and remainders by a run-time value and IEEE float divisions,
      counted as the 64-bit work is.
    - threadgroup_memory (always counted): the most threadgroup memory one
      threadgroup allocated; `threadgroups_per_core` what that and the
      registers leave resident on a core (threadgroups_per_core()).
    - buffer_names: the kernel's parameter name of each buffer index.
    - compute (always counted): simdgroup_mmas (simdgroup_mmas_32: those
      with 32-bit operands), matrix_loads_* / matrix_stores_* by memory
      (threadgroup or device), once per simdgroup; instructions, the IR
      instructions of the shader's own code its threads executed. Derived:
      matrix_flops, flops_per_device_byte, flops_per_threadgroup_byte, and
      the issue-slot estimate (issue_slots, matrix_slot_fraction; the model
      at MMA_ISSUE_SLOTS).
    """

    kernel: str
    threadgroups: tuple[int, int, int]
    threads_per_threadgroup: tuple[int, int, int]
    threads: int
    barriers: int
    simdgroup_barriers: int
    simd_operations: int
    bytes_read: dict[int, int]  # buffer index -> bytes
    bytes_written: dict[int, int]
    read_widths: dict[int, dict[int, int]]  # buffer index -> {access width in bytes: count}
    write_widths: dict[int, dict[int, int]]
    threadgroup_bytes_read: int
    threadgroup_bytes_written: int
    constant_buffers: frozenset[int] = frozenset()  # indices bound from bytes
    buffer_names: dict[int, str] = dataclasses.field(default_factory=dict)  # buffer index -> parameter name
    kernel_info: KernelInfo | None = None
    # 64-bit integer work (always counted): divisions and remainders by a
    # run-time value, and multiplications (divisions by a constant count as
    # one), in total and by the busiest thread.
    int64_divisions: int = 0
    int64_multiplications: int = 0
    max_int64_divisions_per_thread: int = 0
    max_int64_multiplications_per_thread: int = 0
    # Divisions that run as long sequences (always counted): 32-bit (and
    # narrower) integer divisions and remainders by a run-time value, and
    # IEEE float divisions (an fdiv without fast-math flags), in total and
    # by the busiest thread.
    int32_divisions: int = 0
    float_divisions: int = 0
    max_int32_divisions_per_thread: int = 0
    max_float_divisions_per_thread: int = 0
    # The most threadgroup memory one threadgroup allocated (always counted).
    threadgroup_memory: int = 0
    # Compute (always counted): IR instructions of the shader's own code the
    # threads executed (and the most one thread did), and the simdgroup_matrix
    # operations the simdgroups completed: multiply-accumulates (those with
    # 32-bit operands also in simdgroup_mmas_32), loads and stores by memory.
    instructions: int = 0
    max_instructions_per_thread: int = 0
    simdgroup_mmas: int = 0
    simdgroup_mmas_32: int = 0
    matrix_loads_threadgroup: int = 0
    matrix_loads_device: int = 0
    matrix_stores_threadgroup: int = 0
    matrix_stores_device: int = 0
    # Measured with counters=True only (`counters` says whether they were):
    counters: bool = False
    cache_lines: dict[int, int] = dataclasses.field(default_factory=dict)  # 128-byte lines touched per buffer
    cache_lines_minimum: dict[int, int] = dataclasses.field(default_factory=dict)  # fewest that hold the bytes
    threadgroup_memory_instructions: int = 0  # executed by a simdgroup
    bank_conflict_cycles: int = 0  # extra cycles of those for bank conflicts
    # Per device buffer: the distinct bytes each threadgroup read, summed over
    # threadgroups (an operand every threadgroup re-reads or re-stages counts
    # once per threadgroup), and the distinct bytes the dispatch read.
    threadgroup_bytes_read_distinct: dict[int, int] = dataclasses.field(default_factory=dict)
    unique_bytes_read: dict[int, int] = dataclasses.field(default_factory=dict)

    @classmethod
    def _from_native(cls, d: dict) -> "DispatchStats":
        def per_buffer(values):
            return {i: v for i, v in enumerate(values) if v}

        return cls(
            kernel=d["kernel"],
            threadgroups=tuple(d["threadgroups"]),
            threads_per_threadgroup=tuple(d["threads_per_threadgroup"]),
            threads=d["threads"],
            barriers=d["barriers"],
            simdgroup_barriers=d["simdgroup_barriers"],
            simd_operations=d["simd_operations"],
            bytes_read=per_buffer(d["bytes_read"]),
            bytes_written=per_buffer(d["bytes_written"]),
            read_widths=per_buffer(d["read_widths"]),
            write_widths=per_buffer(d["write_widths"]),
            threadgroup_bytes_read=d["threadgroup_bytes_read"],
            threadgroup_bytes_written=d["threadgroup_bytes_written"],
            constant_buffers=frozenset(i for i, b in enumerate(d["bound_from_bytes"]) if b),
            buffer_names={i: n for i, n in enumerate(d["buffer_names"]) if n},
            kernel_info=KernelInfo._from_native(d["kernel_info"]),
            int64_divisions=d["int64_divisions"],
            int64_multiplications=d["int64_multiplications"],
            max_int64_divisions_per_thread=d["max_int64_divisions"],
            max_int64_multiplications_per_thread=d["max_int64_multiplications"],
            counters=d["counters"],
            cache_lines=per_buffer(d["cache_lines"]),
            cache_lines_minimum=per_buffer(d["cache_lines_minimum"]),
            threadgroup_memory_instructions=d["threadgroup_memory_instructions"],
            bank_conflict_cycles=d["bank_conflict_cycles"],
            int32_divisions=d["int32_divisions"],
            float_divisions=d["float_divisions"],
            max_int32_divisions_per_thread=d["max_int32_divisions"],
            max_float_divisions_per_thread=d["max_float_divisions"],
            threadgroup_memory=d["threadgroup_memory"],
            threadgroup_bytes_read_distinct=per_buffer(d["threadgroup_bytes_read_distinct"]),
            unique_bytes_read=per_buffer(d["unique_bytes_read"]),
            instructions=d["instructions"],
            max_instructions_per_thread=d["max_instructions"],
            simdgroup_mmas=d["simdgroup_mmas"],
            simdgroup_mmas_32=d["simdgroup_mmas_32"],
            matrix_loads_threadgroup=d["matrix_loads_threadgroup"],
            matrix_loads_device=d["matrix_loads_device"],
            matrix_stores_threadgroup=d["matrix_stores_threadgroup"],
            matrix_stores_device=d["matrix_stores_device"],
        )

    def buffer(self, name: str) -> int:
        """The index of the kernel's buffer parameter `name` (KeyError if none)."""
        for i, n in self.buffer_names.items():
            if n == name:
                return i
        raise KeyError(f"kernel {self.kernel} has no buffer parameter {name!r}; it has {self.buffer_names}")

    def _measured(self, what: str):
        if not self.counters:
            raise ValueError(f"{what} of kernel '{self.kernel}' was not measured: dispatch with counters=True, "
                             "or inside cpu_metal.record(counters=True)")

    @property
    def coalescing(self) -> dict[int, float]:
        """Per device buffer: 128-byte lines the memory instructions of each
        simdgroup touched, over the fewest lines their bytes fit in (1.0:
        perfectly coalesced; 32: every lane of a 4-byte access on its own
        line)."""
        self._measured("coalescing")
        return {i: self.cache_lines[i] / m for i, m in self.cache_lines_minimum.items() if m}

    @property
    def reread_factor(self) -> dict[int, float]:
        """Per device buffer: bytes the threadgroups read (each counting a
        byte once however often it read it) over the distinct bytes the
        dispatch read: 1.0 when no two threadgroups read the same byte; the
        number of threadgroups when each reads the whole buffer (an
        activation every threadgroup stages again). Those re-reads come from
        the GPU's L2 cache rather than DRAM, but each costs cache bandwidth
        and load instructions."""
        self._measured("reread_factor")
        return {i: self.threadgroup_bytes_read_distinct.get(i, 0) / u for i, u in self.unique_bytes_read.items() if u}

    @property
    def threadgroups_per_core(self) -> int:
        """Threadgroups of this dispatch an Apple GPU core keeps resident:
        the fewest of what its threadgroup memory allows
        (THREADGROUP_MEMORY_PER_CORE // threadgroup_memory) and what its
        registers allow (occupancy(registers) // threads per threadgroup);
        0 if neither fits."""
        x, y, z = self.threads_per_threadgroup
        registers = self.kernel_info.registers if self.kernel_info else 0
        return threadgroups_per_core(self.threadgroup_memory, x * y * z, registers)

    @property
    def int32_divisions_per_thread(self) -> float:
        return self.int32_divisions / self.threads if self.threads else 0.0

    @property
    def float_divisions_per_thread(self) -> float:
        return self.float_divisions / self.threads if self.threads else 0.0

    @property
    def int64_divisions_per_thread(self) -> float:
        return self.int64_divisions / self.threads if self.threads else 0.0

    @property
    def int64_multiplications_per_thread(self) -> float:
        return self.int64_multiplications / self.threads if self.threads else 0.0

    @property
    def total_threadgroups(self) -> int:
        x, y, z = self.threadgroups
        return x * y * z

    @property
    def bytes_moved(self) -> int:
        """Bytes read plus bytes written over all device buffers."""
        return sum(self.bytes_read.values()) + sum(self.bytes_written.values())

    @property
    def memory_bytes_moved(self) -> int:
        """Bytes read plus written over buffers bound to memory (tensors),
        leaving out constant data such as parameter structs, which a GPU
        serves from its constant cache, not from DRAM."""
        return sum(v for i, v in self.bytes_read.items() if i not in self.constant_buffers) + sum(
            v for i, v in self.bytes_written.items() if i not in self.constant_buffers)


    # ------------------------------------------------ compute efficiency --
    @property
    def matrix_flops(self) -> int:
        """FLOPs of the simdgroup multiply-accumulates (2 per FMA, 512 FMAs each)."""
        return 2 * MMA_FMAS * self.simdgroup_mmas

    @property
    def threadgroup_bytes(self) -> int:
        return self.threadgroup_bytes_read + self.threadgroup_bytes_written

    @property
    def flops_per_device_byte(self) -> float:
        """Matrix FLOPs per byte moved over tensor buffers (memory_bytes_moved,
        re-reads included: what the tiles ask of the caches and DRAM)."""
        moved = self.memory_bytes_moved
        return self.matrix_flops / moved if moved else 0.0

    @property
    def flops_per_threadgroup_byte(self) -> float:
        """Matrix FLOPs per byte read or written in threadgroup memory."""
        return self.matrix_flops / self.threadgroup_bytes if self.threadgroup_bytes else 0.0

    @property
    def matrix_issue_slots(self) -> float:
        """Issue slots of the multiply-accumulates (MMA_ISSUE_SLOTS each,
        MMA_ISSUE_SLOTS_32 with 32-bit operands)."""
        return (MMA_ISSUE_SLOTS * (self.simdgroup_mmas - self.simdgroup_mmas_32)
                + MMA_ISSUE_SLOTS_32 * self.simdgroup_mmas_32)

    @property
    def issue_slots(self) -> float:
        """The estimate of the simdgroups' issue slots: the shader's executed
        IR instructions over the 32 lanes a simdgroup issues them for, the
        multiply-accumulates' slots, and MATRIX_MEMORY_ISSUE_SLOTS per
        simdgroup_load and simdgroup_store."""
        matrix_memory = (self.matrix_loads_threadgroup + self.matrix_loads_device + self.matrix_stores_threadgroup
                         + self.matrix_stores_device)
        return self.instructions / 32 + self.matrix_issue_slots + MATRIX_MEMORY_ISSUE_SLOTS * matrix_memory

    @property
    def matrix_slot_fraction(self) -> float:
        """The share of issue_slots that are multiply-accumulates (1.0: the
        simdgroups issue nothing but matrix products)."""
        slots = self.issue_slots
        return self.matrix_issue_slots / slots if slots else 0.0


def _size3(value, what: str) -> list[int]:
    if isinstance(value, int):
        value = (value,)
    value = [int(v) for v in value]
    if not 1 <= len(value) <= 3 or any(v < 0 for v in value):
        raise ValueError(f"{what} must be 1 to 3 non-negative integers, got {value}")
    return value


def _binding(arg, i: int, param: str):
    where = f"argument {i}" + (f" ('{param}')" if param else "")
    if arg is None:
        return None
    if isinstance(arg, torch.Tensor):
        if arg.device.type != "cpu":
            raise TypeError(f"{where} is a tensor on {arg.device}; the CPU Metal executor runs CPU tensors")
        storage = arg.untyped_storage()
        offset = arg.storage_offset() * arg.element_size()
        return ("memory", storage.data_ptr() + offset, max(storage.nbytes() - offset, 0), offset)
    if isinstance(arg, np.ndarray):
        if not arg.flags.c_contiguous or not arg.flags.writeable:
            raise TypeError(f"{where}: a numpy array must be C-contiguous and writable to bind as a buffer")
        return ("memory", arg.ctypes.data, arg.nbytes, 0)
    if isinstance(arg, np.generic):  # numpy scalars, structured scalars included
        return ("bytes", arg.tobytes())
    if isinstance(arg, (bytes, bytearray, memoryview)):
        return ("bytes", bytes(arg))
    if isinstance(arg, (bool, int, float)):
        raise TypeError(
            f"{where} is a Python {type(arg).__name__}, which has no size in Metal; "
            f"pass a numpy scalar such as np.uint32({arg!r}) or np.float32({arg!r})"
        )
    raise TypeError(
        f"{where} is a {type(arg).__name__}; bind a CPU tensor, a numpy array, bytes, a numpy scalar or None"
    )


class Library:
    """Kernels compiled from one MSL source."""

    def __init__(self, path: str, kernels: list[dict]):
        self._native = _C.ExecutorLibrary.load(str(path))
        self._kernels = {k["name"]: k for k in kernels}
        self._buffer_names: dict[str, dict[int, str]] = {}  # per kernel, for messages

    @property
    def function_names(self) -> list[str]:
        return list(self._native.function_names)

    @property
    def path(self) -> str:
        return self._native.path

    def parameters(self, name: str) -> list[dict]:
        """The kernel's parameters: name, kind, index, address space, ..."""
        return self._native.kernel_params(name)

    def kernel_info(self, name: str) -> KernelInfo:
        """What kernel `name` costs a GPU beyond its bytes: registers,
        private memory, loads in flight (computed when it was built)."""
        return KernelInfo._from_native(self._native.kernel_info(name))

    def dispatch(
        self,
        name: str,
        args: Sequence = (),
        *,
        threadgroups=None,
        threads=None,
        threads_per_threadgroup=1,
        threadgroup_memory: Sequence[int] = (),
        seed: int | None = None,
        isolate: bool = True,
        counters: bool = False,
    ) -> DispatchStats:
        """Run kernel `name` over a grid, like dispatchThreadgroups (threadgroups=)
        or dispatchThreads (threads=, with non-uniform edge threadgroups).
        counters=True also measures coalescing and bank conflicts (slower)."""
        if (threadgroups is None) == (threads is None):
            raise ValueError("give exactly one of threadgroups= (dispatchThreadgroups) or threads= (dispatchThreads)")
        names = self._buffer_names.get(name)
        if names is None:
            names = {p["index"]: p["name"] for p in self.parameters(name) if p["kind"] == "buffer"}
            self._buffer_names[name] = names
        buffers = [_binding(a, i, names.get(i, "")) for i, a in enumerate(args)]
        stats = self._native.dispatch(
            name,
            buffers,
            _size3(threadgroups, "threadgroups") if threadgroups is not None else [],
            _size3(threads, "threads") if threads is not None else [],
            _size3(threads_per_threadgroup, "threads_per_threadgroup"),
            [int(s) for s in threadgroup_memory],
            _default_seed if seed is None else int(seed),
            bool(isolate),
            bool(counters),
        )
        return DispatchStats._from_native(stats)


def compile_library(
    source: str,
    defines: dict | None = None,
    *,
    filename: str = "shader.metal",
    check_address_spaces: bool = True,
) -> Library:
    """Compile MSL source (self-contained: the text Metal would get) into a
    Library. `defines` become preprocessor macros. Compile errors raise
    CompileError with file:line messages of the source."""
    built = build(source, defines, filename, check_address_spaces)
    return Library(str(built.path), built.kernels)


class record:
    """Collect the stats of every dispatch made inside the block.

    with cpu_metal.record() as rec:
        ...
    rec.dispatches  # list of DispatchStats

    counters=True measures coalescing and bank conflicts in every dispatch
    made inside the block (slower).
    """

    def __init__(self, counters: bool = False):
        self._native = _C.ExecutorRecorder()
        self._counters = bool(counters)
        self.dispatches: list[DispatchStats] = []

    def __enter__(self) -> "record":
        self._native.start(self._counters)
        return self

    def __exit__(self, *exc):
        self._native.stop()
        self.dispatches = self.take()
        return False

    def take(self) -> list[DispatchStats]:
        """The dispatches recorded since the block began or the last take(),
        which no longer count in `dispatches` (run_model attributes each
        call's dispatches to its op this way)."""
        return [DispatchStats._from_native(d) for d in self._native.take()]


_REQUESTED = contextvars.ContextVar("mps_ext_executor_requested", default=False)


def requested() -> bool:
    """True inside `request()`."""
    return _REQUESTED.get()


@contextlib.contextmanager
def request():
    """Run CPU tensors of mps_ext's modules through the executor in this
    block (mps_ext/_cpu_backend.py), and, on a Mac, let the op layer's CPU
    calls of this thread reach it:

        with mps_ext_executor.request():
            model(x)   # CPU tensors go through the Metal kernels on the executor

    Usable as a decorator. Outside it a Mac's torch.ops.mps_ext ops on CPU
    tensors run torch's CPU kernel (counted as a fallback, "the CPU backend
    was not asked for"), or, for mps_ext's own ops, raise saying so. Where no
    Metal backend exists (Linux) the op layer's calls always reach the
    executor once it is installed."""
    token = _REQUESTED.set(True)
    _C._set_requested(True)
    try:
        yield
    finally:
        _C._set_requested(False)
        _REQUESTED.reset(token)


def install() -> None:
    """Registers the executor as mps_ext's backend of CPU tensors, in the op
    layer (torch.ops.mps_ext ops on CPU tensors run their kernels here from
    now on) and for mps_ext's modules (request()). Idempotent. An error if
    mps_ext's native extension did not load, or was built from another
    checkout (a backend slot of another layout)."""
    import mps_ext
    if mps_ext._C is None:
        raise RuntimeError(f"mps_ext_executor: mps_ext's native extension did not load: {mps_ext._load_error}")
    _C._install(mps_ext._C._backend_slot())
    from mps_ext import _cpu_backend
    _cpu_backend.install(requested, request)


from ._model_runner import ModelReport, run_model  # noqa: E402  (uses record, defined above)
