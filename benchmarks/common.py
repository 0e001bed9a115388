"""Shared by the benchmarks: traffic from the CPU Metal executor's counters,
and, on a Mac, wall-clock timing of stock torch against mps_ext."""

from __future__ import annotations

import statistics
import time

import torch

import mps_ext
from mps_ext import cpu_metal

# GB/s of Apple GPUs (anchors.md): the physical limit of a memory-bound op.
BANDWIDTH_GBPS = {"M1": 68, "M2 Pro": 200, "M3 Max": 400, "M3 Ultra": 819, "M4 Max": 546}


def sixteen_byte_share(dispatches, reads=True, writes=True) -> float:
    """Share of the bytes moved over tensor buffers (not constant data) by
    16-byte accesses."""
    total = sixteen = 0
    for d in dispatches:
        for counted, widths_of in ((reads, d.read_widths), (writes, d.write_widths)):
            if not counted:
                continue
            for buffer, widths in widths_of.items():
                if buffer not in d.constant_buffers:
                    total += sum(width * n for width, n in widths.items())
                    sixteen += 16 * widths.get(16, 0)
    return sixteen / total if total else 0.0


def traffic(fn) -> dict:
    """Run fn (which calls torch.ops.mps_ext ops on CPU tensors) and sum the
    executor's counters over its dispatches."""
    with cpu_metal.record() as rec:
        fn()
    return {
        "dispatches": len(rec.dispatches),
        "wide_share": sixteen_byte_share(rec.dispatches),
        "wide_store_share": sixteen_byte_share(rec.dispatches, reads=False),
        "threadgroups": sum(d.total_threadgroups for d in rec.dispatches),
        "memory_bytes": sum(d.memory_bytes_moved for d in rec.dispatches),
        "all_bytes": sum(d.bytes_moved for d in rec.dispatches),
        "kernels": [d.kernel for d in rec.dispatches],
    }


def mac_times(stock, ours, repeat: int = 50, warmup: int = 5) -> tuple[float, float] | None:
    """Median seconds of stock torch and of mps_ext on the GPU, or None if
    there is no GPU here. Each call is synchronised so the time is the GPU's."""
    if not mps_ext.is_available():
        return None

    def median(fn, disable):
        samples = []
        for i in range(warmup + repeat):
            if disable:
                with mps_ext.disabled():
                    torch.mps.synchronize()
                    t = time.perf_counter()
                    fn()
                    torch.mps.synchronize()
            else:
                torch.mps.synchronize()
                t = time.perf_counter()
                fn()
                torch.mps.synchronize()
            if i >= warmup:
                samples.append(time.perf_counter() - t)
        return statistics.median(samples)

    return median(stock, True), median(ours, False)


def table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    widths = [max(len(title), *(len(str(r[key])) for r in rows)) for key, title in columns]
    line = lambda cells: "  ".join(str(c).rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line([t for _, t in columns])] + [line([r[k] for k, _ in columns]) for r in rows])
