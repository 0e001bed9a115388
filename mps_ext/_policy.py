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


# torch 2.15 has float8_e4m3fn tensors on MPS and runs tensor-wise and
# row-wise e4m3fn scaled_mm there; mps_ext's fp8 and scaled_mm families then
# keep float8_e5m2 and the block-wise recipes (torch has Metal kernels for
# e4m3fn only: no e5m2 instantiation in its 2.15 metallib).
FP8_E4M3_NATIVE_SINCE = (2, 15)


def fp8_e4m3_native(version: str) -> bool:
    """Whether torch `version` handles float8_e4m3fn on MPS itself."""
    return torch_version(version) >= FP8_E4M3_NATIVE_SINCE
