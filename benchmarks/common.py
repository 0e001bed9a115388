"""Shared by the benchmarks: every op's cases are measured here, once, with
the CPU Metal executor's counters (traffic, coalescing, 64-bit integer work,
registers, bank conflicts), and on a Mac also timed, stock torch against
mps_ext. `python -m benchmarks` (benchmarks/__main__.py) runs them all; each
benchmarks/bench_<op>.py only lists its op's cases.

A case is measured by running it once inside cpu_metal.record(counters=True);
the tables report, per case, the worst of its dispatches (the most lines per
instruction, the most registers, the fewest loads in flight).
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

import mps_ext
import mps_ext_executor as cpu_metal

# The benchmarks run mps_ext's kernels on CPU tensors: through the executor,
# installed as mps_ext's backend of CPU tensors (mps_ext has none of its own).
if mps_ext._C is not None:
    cpu_metal.install()

ROOT = Path(__file__).resolve().parent.parent

# GB/s of Apple GPUs (/work/shared/reference/anchors.md, "Apple GPU memory
# bandwidth"): the physical limit of a memory-bound op.
BANDWIDTH_GBPS = {"M1": 68, "M2 Pro": 200, "M3 Max": 400, "M3 Ultra": 819, "M4 Max": 546}
SIZES = ("full", "quick", "tiny")  # full: every shape; quick: no vocabulary-sized ones; tiny: a smoke test


Stats = list[cpu_metal.DispatchStats]


@dataclasses.dataclass
class Prepared:
    """A case's inputs, made when it runs (some weigh a gigabyte)."""

    run: Callable[[], Any]  # calls torch.ops.mps_ext ops on CPU tensors
    # Reading every input once and writing every output once, for the whole
    # case (all it stands for when `scale` is not 1); or computed from the
    # dispatches (and what the run returned, which `run` may keep).
    minimum_bytes: int | Callable[[Stats], int]
    # On a Mac: returns (stock, ours), two callables on MPS tensors (ours may be
    # the same callable: stock runs with mps_ext disabled).
    mac: Callable[[], tuple[Callable, Callable]] | None = None
    # Op-specific columns from the case's dispatches.
    extras: Callable[[Stats], dict[str, str]] | None = None
    # The case stands for `scale` times what runs (an extrapolated batch, a
    # sample block of tiles): a number, or computed from the dispatches.
    scale: float | Callable[[Stats], float] = 1
    # The bytes that reach DRAM, when the run re-reads operands small enough
    # to stay in the GPU's caches (default: every byte moved, scaled).
    dram_bytes: Callable[[Stats], float] | None = None


@dataclasses.dataclass
class Case:
    op: str
    id: str  # unique within the op; the budget tests name cases by it
    labels: dict[str, str]  # the table's first columns
    prepare: Callable[[], Prepared]


@dataclasses.dataclass
class Result:
    case: Case
    stats: Stats
    minimum_bytes: int
    scale: float
    dram: float  # bytes that reach DRAM, for the whole case
    seconds: float  # the executor's wall time
    times: tuple[str, str, str] | None  # on a Mac: stock us, mps_ext us, speedup
    extras: dict[str, str]

    @property
    def kernels(self) -> list[str]:
        return [d.kernel for d in self.stats]

    @property
    def threadgroups(self) -> int:
        return round(sum(d.total_threadgroups for d in self.stats) * self.scale)

    @property
    def memory_bytes(self) -> float:
        """Bytes moved over tensor buffers, for the whole case."""
        return sum(d.memory_bytes_moved for d in self.stats) * self.scale

    @property
    def bytes_over_minimum(self) -> float:
        return self.memory_bytes / self.minimum_bytes if self.minimum_bytes else 1.0

    def projected_us(self, chip: str) -> float:
        """The time the case's DRAM traffic takes at the chip's bandwidth: a
        bound, not a prediction (no launch cost, no latency)."""
        return self.dram / (BANDWIDTH_GBPS[chip] * 1e3)

    def dispatched_us(self, chip: str) -> float:
        """projected_us plus the GPU cost of each of the case's dispatches
        beyond its bytes (benchmarks/timeline.py's DISPATCH, central): what
        the ops plot draws beside the bandwidth limit."""
        from benchmarks.timeline import DISPATCH
        return self.projected_us(chip) + len(self.stats) * DISPATCH.central * 1e6

    def limit_us(self, chip: str) -> float:
        """The bandwidth limit: the minimum bytes at the chip's bandwidth."""
        return self.minimum_bytes / (BANDWIDTH_GBPS[chip] * 1e3)


# ---------------------------------------------------------------- counters --
def device_coalescing(d: cpu_metal.DispatchStats) -> dict[str, float]:
    """Coalescing per device buffer, by parameter name; constant data bound
    from bytes (parameter structs) is served by the constant cache and left out."""
    return {d.buffer_names.get(i, str(i)): r for i, r in d.coalescing.items() if i not in d.constant_buffers}


def worst_coalescing(stats: Stats) -> tuple[float, str]:
    """The highest ratio over the dispatches' device buffers, and where."""
    worst, where = 1.0, ""
    for d in stats:
        for name, r in device_coalescing(d).items():
            if r > worst:
                worst, where = r, f"{d.kernel} {name}" if len(stats) > 1 else name
    return worst, where


def worst_reread(stats: Stats) -> tuple[float, str]:
    """The highest re-read factor (DispatchStats.reread_factor: bytes the
    threadgroups read, each once per threadgroup, over the distinct bytes)
    over the dispatches' tensor buffers, and where."""
    worst, where = 1.0, ""
    for d in stats:
        for i, r in d.reread_factor.items():
            if i not in d.constant_buffers and r > worst:
                name = d.buffer_names.get(i, str(i))
                worst, where = r, f"{d.kernel} {name}" if len(stats) > 1 else name
    return worst, where


def occupancy_cell(stats: Stats) -> str:
    """The most threadgroup memory a dispatch's threadgroup used, and the
    fewest threadgroups a core keeps resident over the dispatches."""
    memory = max(d.threadgroup_memory for d in stats)
    per_core = min(d.threadgroups_per_core for d in stats)
    return f"{memory / 1024:.1f} KiB ({per_core})"


def bank_conflicts_per_instruction(stats: Stats) -> float:
    instructions = sum(d.threadgroup_memory_instructions for d in stats)
    return sum(d.bank_conflict_cycles for d in stats) / instructions if instructions else 0.0


# Bytes written between timed calls so that no operand stays in the GPU's
# caches: more than the largest system-level cache of anchors.md's chips
# (a weight read again from it looks faster than DRAM).
CACHE_FLUSH_BYTES = 256 << 20


def mac_times(stock, ours, repeat: int = 50, warmup: int = 5) -> tuple[float, float] | None:
    """Median seconds of stock torch and of mps_ext on the GPU, or None if
    there is no GPU here. Each call is synchronised so the time is the GPU's,
    and each starts with its weights out of the cache (CACHE_FLUSH_BYTES
    written first, not timed)."""
    if not mps_ext.is_available():
        return None
    flush = torch.empty(CACHE_FLUSH_BYTES // 4, dtype=torch.float32, device="mps")

    def median(fn, disable):
        samples = []
        for i in range(warmup + repeat):
            with mps_ext.disabled() if disable else contextlib.nullcontext():
                flush.zero_()
                torch.mps.synchronize()
                t = time.perf_counter()
                fn()
                torch.mps.synchronize()
            if i >= warmup:
                samples.append(time.perf_counter() - t)
        return statistics.median(samples)

    return median(stock, True), median(ours, False)


def _time_on_mac(prepared: Prepared) -> tuple[str, str, str] | None:
    if prepared.mac is None or not torch.backends.mps.is_available():
        return None
    stock, ours = prepared.mac()
    try:
        with mps_ext.disabled():
            stock()
    except Exception as e:  # e.g. torch before 2.15 refuses complex64 LU on MPS
        t = mac_times(ours, ours)
        return (f"error ({type(e).__name__})", f"{t[1] * 1e6:.1f}", "-") if t else None
    t = mac_times(stock, ours)
    return (f"{t[0] * 1e6:.1f}", f"{t[1] * 1e6:.1f}", f"{t[0] / t[1]:.2f}x") if t else None


def measure(case: Case, mac: bool = True) -> Result:
    """Run the case once on the executor with every counter on (and, on a
    Mac, time it)."""
    prepared = case.prepare()
    start = time.perf_counter()
    # On a Mac, CPU tensors reach the executor only when it is asked for.
    with cpu_metal.record(counters=True) as rec, cpu_metal.request():
        prepared.run()
    seconds = time.perf_counter() - start
    if not rec.dispatches:
        raise RuntimeError(f"{case.op} case {case.id!r} made no dispatch: it did not reach mps_ext's kernels")
    stats = rec.dispatches
    minimum = prepared.minimum_bytes(stats) if callable(prepared.minimum_bytes) else prepared.minimum_bytes
    scale = prepared.scale(stats) if callable(prepared.scale) else prepared.scale
    dram = prepared.dram_bytes(stats) if prepared.dram_bytes else sum(d.memory_bytes_moved for d in stats) * scale
    extras = prepared.extras(stats) if prepared.extras else {}
    return Result(case, stats, minimum, scale, dram, seconds,
                  _time_on_mac(prepared) if mac else None, extras)


# ------------------------------------------------------------------ tables --
def markdown(rows: list[dict], columns: list[str]) -> str:
    """A markdown table of `rows` (dicts) over `columns` (their keys, also the titles)."""
    def cell(v):
        return str(v).replace("|", "\\|")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def case_row(r: Result, chips: list[str]) -> dict:
    worst, where = worst_coalescing(r.stats)
    reread, reread_where = worst_reread(r.stats)
    registers = max(d.kernel_info.registers for d in r.stats)
    row = dict(r.case.labels)
    row.update({
        "kernels": " ".join(dict.fromkeys(r.kernels)),
        "dispatches": len(r.stats),
        "threadgroups": r.threadgroups,
        "bytes / min": f"{r.bytes_over_minimum:.3f}",
        "lines / min": f"{worst:.2f}" + (f" ({where})" if worst > 1.0 else ""),
        "i64 div / thread": f"{max(d.int64_divisions_per_thread for d in r.stats):.2f}",
        "i32 div / thread": f"{max(d.int32_divisions_per_thread for d in r.stats):.2f}",
        "fdiv / thread": f"{max(d.float_divisions_per_thread for d in r.stats):.2f}",
        "re-read": f"{reread:.2f}" + (f" ({reread_where})" if reread > 1.0 else ""),
        "tg memory (tg / core)": occupancy_cell(r.stats),
        "registers": f"{registers} ({cpu_metal.occupancy(registers)})",
        "bank conflicts": f"{bank_conflicts_per_instruction(r.stats):.2f}",
        "loads in flight": min(d.kernel_info.loads_in_flight for d in r.stats),
        "loads after barrier": max(d.kernel_info.loads_after_barrier for d in r.stats),
    })
    row.update(r.extras)
    for chip in chips:
        row[f"us @{chip}"] = f"{r.projected_us(chip):.1f}"
    row["stock us"], row["mps_ext us"], row["speedup"] = r.times or ("-", "-", "-")
    return row


CASE_COLUMNS = ["kernels", "dispatches", "threadgroups", "bytes / min", "lines / min", "re-read", "i64 div / thread",
                "i32 div / thread", "fdiv / thread", "registers", "tg memory (tg / core)", "bank conflicts",
                "loads in flight", "loads after barrier"]
CASE_NOTES = (
    "bytes / min: bytes read and written over tensor buffers against reading every input and writing every "
    "output once. lines / min: the most 128-byte lines a simdgroup's memory instruction touched over the fewest "
    "its bytes fit in, for the worst device buffer (1.00 = coalesced). re-read: for the worst tensor buffer, the bytes "
    "the threadgroups read (a byte once per threadgroup that reads it, cache hits included) over the distinct bytes "
    "read (1.00: no byte read by two threadgroups; an operand every threadgroup stages again shows the threadgroup "
    "count). i64 div / thread: 64-bit integer "
    "divisions and remainders per thread (software on Apple GPUs); i32 div: 32-bit ones by a run-time value (a "
    "software sequence too); fdiv: IEEE float divisions (several times a fast one). registers: 32-bit registers live per thread "  # noqa: E501
    "at the peak (threads an M1/M2 core keeps at that count; 1024 is full occupancy). tg memory: the most threadgroup "
    "memory a threadgroup allocated (threadgroups a core keeps resident, from its 64 KiB and the registers; the "
    "fewest over the case's kernels). bank conflicts: extra "
    "cycles per threadgroup-memory instruction. loads in flight: independent device loads per iteration of the "
    "hot loop (the fewest over the case's kernels); loads after barrier: device loads of a loop's iteration that "
    "wait behind its threadgroup barrier (the most). us @chip: the DRAM traffic at the chip's bandwidth (a bound, "
    'not a prediction). stock / mps_ext: median times on a Mac only. docs/dev/contributing.md, "What a kernel costs a GPU beyond its '  # noqa: E501
    'bytes", says how each counter is computed.'
)


def op_table(results: list[Result], chips: list[str]) -> str:
    rows = [case_row(r, chips) for r in results]
    labels = list(results[0].case.labels)
    extras = list(dict.fromkeys(k for r in results for k in r.extras))
    columns = labels + CASE_COLUMNS + extras + [f"us @{c}" for c in chips] + ["stock us", "mps_ext us", "speedup"]
    return markdown(rows, columns)


def library_kernels() -> dict[str, dict[str, cpu_metal.KernelInfo]]:
    """Every kernel host name of kernels_metal/*.metal, per library, with its
    static costs, as the executor compiles the shaders the build embeds."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from tools.embed_shaders import sources

    out = {}
    for name, text in sources().items():
        lib = cpu_metal.compile_library(text, filename=f"{name}.metal")
        out[name] = {k: lib.kernel_info(k) for k in sorted(lib.function_names)}
    return out


def kernel_table(results: list[Result]) -> str:
    """One row per kernel host name of kernels_metal/: its static costs, and
    the worst of what it did over the cases that reached it."""
    reached: dict[str, list[tuple[Result, cpu_metal.DispatchStats]]] = {}
    for r in results:
        for d in r.stats:
            reached.setdefault(d.kernel, []).append((r, d))
    rows = []
    for library, kernels in library_kernels().items():
        for name, info in kernels.items():
            row = {"kernel": name, "registers": info.registers, "threads / core": cpu_metal.occupancy(info.registers),
                   "uniform": info.uniform_registers, "private bytes": info.private_bytes,
                   "loads in flight": info.loads_in_flight, "loads after barrier": info.loads_after_barrier}
            runs = reached.get(name, [])
            if not runs:
                row["cases"] = "not reached by a benchmark case"
                rows.append(row)
                continue
            lines: dict[str, float] = {}
            for _, d in runs:
                for buffer, ratio in device_coalescing(d).items():
                    lines[buffer] = max(lines.get(buffer, 0.0), ratio)
            row.update({
                "cases": len(runs),
                "lines / min per buffer (worst)": ", ".join(f"{b} {v:.2f}" for b, v in sorted(lines.items())),
                "i64 div / thread": f"{max(d.int64_divisions_per_thread for _, d in runs):.2f}",
                "i64 mul / thread": f"{max(d.int64_multiplications_per_thread for _, d in runs):.2f}",
                "bank conflicts": f"{max(bank_conflicts_per_instruction([d]) for _, d in runs):.2f}",
                "re-read (worst)": f"{max(worst_reread([d])[0] for _, d in runs):.2f}",
                "i32 div / thread": f"{max(d.int32_divisions_per_thread for _, d in runs):.2f}",
                "fdiv / thread": f"{max(d.float_divisions_per_thread for _, d in runs):.2f}",
                "tg memory (tg / core)": occupancy_cell([d for _, d in runs]),
                "threadgroups (fewest)": min(round(d.total_threadgroups * r.scale) for r, d in runs),
            })
            rows.append(row)
    return markdown(
        rows,
        [
            "kernel",
            "cases",
            "registers",
            "threads / core",
            "uniform",
            "private bytes",
            "loads in flight",
            "loads after barrier",
            "lines / min per buffer (worst)",
            "i64 div / thread",
            "i64 mul / thread",
            "i32 div / thread",
            "fdiv / thread",
            "re-read (worst)",
            "tg memory (tg / core)",
            "bank conflicts",
            "threadgroups (fewest)",
        ],
    )


def run_as_script(op: str) -> None:
    """`python benchmarks/bench_<op>.py [options]`: the runner on one op."""
    from benchmarks.__main__ import main

    main([op] + sys.argv[1:])
