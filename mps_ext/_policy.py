"""Where mps_ext's kernels help, and where torch's own are as good.

One table, read at import: an aten op is overridden on the MPS key only on
torch releases older than the one that shipped an equal kernel of its own;
from that release on, mps_ext leaves the op to torch (a family whose every op
is left to torch is not installed at all). A rule may leave only some calls
of an op to torch: not those with a dtype or an argument value torch's
kernel refuses, or only those a named Condition picks (decided by the op's
own code, by what torch's kernel takes: a row count, a scale recipe). The
policy applies to the MPS overrides only: torch.ops.mps_ext on CPU tensors
always runs mps_ext's kernels.

Why each rule holds (what every supported release has on MPS, per family,
and the files of the macOS wheels that show it) is in docs/dev/policy.md.
"""
from __future__ import annotations

import dataclasses
import enum


class Condition(str, enum.Enum):
    """The calls of an op a rule leaves to torch, where the arguments' dtypes
    and bools do not say which: decided by the op's own code. The values are
    the names csrc/dispatch/registry.h's MPS_EXT_CONDITIONS gives them (the op
    layer refuses any other; tests/test_policy.py checks both lists)."""

    # mm and addmm with one activation row (or column): torch 2.14's GEMV
    # (csrc/ops/linear.cpp, mm_unsupported).
    ONE_ROW = "one_row"
    # _scaled_mm_v2 calls torch 2.15's kernel takes (csrc/ops/scaled_mm.cpp, policy).
    TORCH_SCALED_MM = "torch_scaled_mm"
    # _grouped_mm calls but the bfloat16 prefills torch 2.15 runs on its
    # simdgroup tile (csrc/ops/grouped_mm.cpp, policy).
    TORCH_GROUPED_MM = "torch_grouped_mm"

    def describe(self) -> str:
        """The calls, in words (mps_ext.family_status)."""
        return {
            Condition.ONE_ROW: "one row",
            Condition.TORCH_SCALED_MM: "tensor-wise and row-wise float8_e4m3fn, with outputs and bias torch's kernel "
                                       "takes, K and N, operand storage offsets and strides multiples of 16",
            Condition.TORCH_GROUPED_MM: "all but bfloat16 2D x 3D and 3D x 2D products of more than 64 jagged rows "
                                        "with K contiguous in both operands",
        }[self]


@dataclasses.dataclass(frozen=True)
class Native:
    """A kernel of torch's own that makes mps_ext's override unnecessary."""
    since: tuple[int, int]  # first torch release that has it (docs/dev/policy.md: the evidence)
    ops: tuple[str, ...]    # the aten ops mps_ext leaves to it on MPS
    what: str               # what torch has, in one sentence
    # Not calls with a tensor argument of these dtypes (torch's names:
    # "complex64"), nor those with these bool argument values (name, value):
    # inputs torch's kernel refuses, which mps_ext keeps.
    kept_dtypes: tuple[str, ...] = ()
    kept_args: tuple[tuple[str, bool], ...] = ()
    # Only the calls this condition picks (decided by the op's own code).
    calls: Condition | None = None

    def __post_init__(self):
        # route (csrc/dispatch/registry.h) applies kept dtypes and arguments; an op
        # whose condition picks the calls is handed the rule alone.
        if self.calls and (self.kept_dtypes or self.kept_args):
            raise ValueError(f"{self.ops}: a rule whose calls the op picks keeps no dtypes or arguments")

    def whole(self) -> bool:
        """Every call of the ops is left to torch."""
        return not (self.kept_dtypes or self.kept_args or self.calls)

    def scope(self) -> str:
        """Which calls, in words: '' for all."""
        parts = [self.calls.describe()] if self.calls else []
        parts += [f"not {dtype}" for dtype in self.kept_dtypes]
        parts += [f"not {name}={value}" for name, value in self.kept_args]
        return "; ".join(parts)


# Ops mps_ext leaves to torch from a release on (docs/dev/policy.md: why, per
# family).
NATIVE: dict[str, list[Native]] = {
    "softmax": [Native(
        (2, 15), ("aten::_softmax", "aten::_log_softmax"),
        "torch 2.15 splits long softmax rows over many threadgroups itself (its backward stays MPSGraph, so "
        "mps_ext keeps the backward)")],
    "pad": [Native((2, 15), ("aten::constant_pad_nd",), "torch 2.15 has Metal constant_pad_nd kernels",
                   kept_dtypes=("float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"))],
    "linalg": [
        Native((2, 15), ("aten::linalg_lu_factor_ex", "aten::linalg_lu"),
               "torch 2.15 has its own Metal LU for float32 and complex64", kept_args=(("pivot", False),)),
        Native((2, 15), ("aten::linalg_solve_triangular", "aten::triangular_solve", "aten::linalg_lu_solve",
                         "aten::_linalg_solve_ex", "aten::_linalg_det", "aten::_linalg_slogdet"),
               "torch 2.15 has its own Metal LU and triangular solves for float32 and complex64"),
        Native((2, 15), ("aten::linalg_inv_ex",), "torch 2.15 has its own Metal float32 inverse",
               kept_dtypes=("complex64",)),
    ],
    "grouped_mm": [
        Native((2, 15), ("aten::_grouped_mm",), "torch 2.15 has its own Metal _grouped_mm, which reads offs only "
               "on the GPU", calls=Condition.TORCH_GROUPED_MM),
    ],
    "linear": [Native((2, 14), ("aten::mm", "aten::addmm", "aten::mm.out", "aten::addmm.out"),
                      "torch 2.14 has its own one-row GEMV for mm and addmm", calls=Condition.ONE_ROW)],
    "fp8": [Native((2, 15), ("aten::copy_", "aten::fill_.Scalar", "aten::fill_.Tensor", "aten::zero_", "aten::cat",
                             "aten::index_select", "aten::_local_scalar_dense", "aten::eq.Tensor", "aten::eq.Scalar",
                             "aten::ne.Tensor", "aten::ne.Scalar", "aten::equal", "aten::gather"),
                   "torch 2.15 has float8_e4m3fn tensors on MPS", kept_dtypes=("float8_e5m2",))],
    "scaled_mm": [Native((2, 15), ("aten::_scaled_mm_v2",),
                         "torch 2.15's _scaled_mm_v2 runs tensor-wise and row-wise float8_e4m3fn products on MPS",
                         calls=Condition.TORCH_SCALED_MM)],
}


def torch_version(version: str) -> tuple[int, int]:
    parts = version.split("+")[0].split(".")
    return int(parts[0]), int(parts[1])


def left_to_torch(family: str, version: str) -> dict[str, Native]:
    """The aten ops of `family` that mps_ext leaves (in all or some calls)
    to torch `version` on MPS, each with its rule."""
    out = {}
    for native in NATIVE.get(family, []):
        if torch_version(version) >= native.since:
            out.update({op: native for op in native.ops})
    return out


def steps_aside(family: str, ops: list[str], version: str) -> str | None:
    """Why mps_ext does not install `family` (whose aten ops are `ops`) on
    torch `version`: every call of every op is left to torch. None if it
    installs it."""
    left = left_to_torch(family, version)
    if ops and all(op in left and left[op].whole() for op in ops):
        return "; ".join(sorted({native.what for native in left.values()}))
    return None
