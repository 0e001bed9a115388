"""Where mps_ext's kernels help, and where torch's own are as good.

One table, read at import: an op family is installed as an override of the
aten ops on the MPS key only on torch versions older than the release that
shipped an equal kernel of its own. On those, mps_ext steps aside.
"""

from __future__ import annotations

# family -> (first torch release with an equal MPS kernel, what it is)
NATIVE_SINCE: dict[str, tuple[tuple[int, int], str]] = {
    "softmax": ((2, 15), "torch 2.15 splits long softmax rows over many threadgroups itself"),
    "pad": ((2, 15), "torch 2.15 has a Metal constant_pad_nd kernel"),
}


# grouped_mm is not in NATIVE_SINCE. torch 2.9-2.14 have no MPS _grouped_mm:
# the CompositeExplicitAutograd kernel runs, which copies offs to the CPU (a
# sync) and launches one mm per group; torch 2.15 ships a Metal kernel
# (_grouped_mm_mps) that does not sync, but it has no decode path that reads
# each chosen expert once in one dispatch, and no release has an MPS
# _scaled_grouped_mm. Whether mps_ext's grouped_mm beats 2.15's own needs a
# Mac to time (benchmarks/bench_moe.py does it there).

# torch 2.15 added GEMV kernels for exactly one activation row; mps_ext's
# linear keeps 2 to 8 rows there (speculative decoding, beam search, small
# batches) and leaves one row to torch.
ONE_ROW_GEMV_SINCE = (2, 15)


def torch_version(version: str) -> tuple[int, int]:
    parts = version.split("+")[0].split(".")
    return int(parts[0]), int(parts[1])


def steps_aside(family: str, version: str) -> str | None:
    """Why mps_ext leaves `family` to torch `version`, or None if it should
    override it."""
    entry = NATIVE_SINCE.get(family)
    if entry and torch_version(version) >= entry[0]:
        return entry[1]
    return None


def linear_min_rows(version: str) -> int:
    """Fewest activation rows mps_ext's linear takes on torch `version`."""
    return 2 if torch_version(version) >= ONE_ROW_GEMV_SINCE else 1
