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
