"""The CPU Metal executor: run Metal Shading Language kernels, unmodified, on
the CPU, with Metal's execution model, checked.

    from mps_ext import cpu_metal
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
Apple GPUs, unless set). Each dispatch returns DispatchStats: bytes read and
written per buffer, barriers, threads.
`with cpu_metal.record() as rec:` collects the stats of every dispatch made
inside it, from Python or from C++ (the op layer).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Sequence

import numpy as np
import torch  # noqa: F401  (loads the libraries the extension links against)

from .. import _C
from ._compiler import CompileError, Diagnostic, build, cache_dir

KernelError = _C.KernelError
OutOfBoundsError = _C.OutOfBoundsError
MisalignedAccessError = _C.MisalignedAccessError
BarrierDivergenceError = _C.BarrierDivergenceError
RaceError = _C.RaceError
DispatchError = _C.DispatchError

__all__ = [
    "compile_library", "Library", "DispatchStats", "record", "set_default_seed", "worker_count",
    "CompileError", "Diagnostic", "KernelError", "OutOfBoundsError", "MisalignedAccessError",
    "BarrierDivergenceError", "RaceError", "DispatchError", "cache_dir",
]

_default_seed = int(os.environ.get("MPS_EXT_EXECUTOR_SEED", "0"))


def set_default_seed(seed: int) -> None:
    """Seed of the thread order for dispatches that do not give one."""
    global _default_seed
    _default_seed = int(seed)


def worker_count() -> int:
    """CPU threads that run threadgroups in parallel."""
    return _C.executor_worker_count()


@dataclasses.dataclass
class DispatchStats:
    """What one dispatch did, from the executor's counters."""

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
        )

    def buffer(self, name: str) -> int:
        """The index of the kernel's buffer parameter `name` (KeyError if none)."""
        for i, n in self.buffer_names.items():
            if n == name:
                return i
        raise KeyError(f"kernel {self.kernel} has no buffer parameter {name!r}; it has {self.buffer_names}")

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
        return ("memory", storage.data_ptr() + offset, max(storage.nbytes() - offset, 0))
    if isinstance(arg, np.ndarray):
        if not arg.flags.c_contiguous or not arg.flags.writeable:
            raise TypeError(f"{where}: a numpy array must be C-contiguous and writable to bind as a buffer")
        return ("memory", arg.ctypes.data, arg.nbytes)
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
    ) -> DispatchStats:
        """Run kernel `name` over a grid, like dispatchThreadgroups (threadgroups=)
        or dispatchThreads (threads=, with non-uniform edge threadgroups)."""
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
    """

    def __init__(self):
        self._native = _C.ExecutorRecorder()
        self.dispatches: list[DispatchStats] = []

    def __enter__(self) -> "record":
        self._native.start()
        return self

    def __exit__(self, *exc):
        self._native.stop()
        self.dispatches = [DispatchStats._from_native(d) for d in self._native.take()]
        return False
