"""Host time of routing: what a call of an mps_ext kernel costs before and
after its kernel, beside the same call of torch's own op.

    python -m benchmarks routing [--quick | --tiny]   (or python benchmarks/bench_routing.py)

Every op mps_ext overrides runs through route (csrc/dispatch/registry.h): the
family's switch, the policy, the devices of the arguments and the op's own
checks, then the kernel or torch's. On a Mac the calls are the MPS
overrides; here (Linux, no Metal) only CPU tensors can be timed, through
torch.ops.mps_ext.<op> on the CPU key, whose kernels and fallbacks are the
same code with K = CPU. A kernel that runs goes through the CPU Metal
executor (milliseconds, nothing like a GPU), so the routing cost is timed
on calls that leave mps_ext for torch's CPU kernel at each decision route
makes, with tiny tensors so that torch's kernel costs little:
  - pass-through: a call the fp8 family never takes (copy_ and eq of
    float32 tensors; the override sees every dtype);
  - unsupported: the op's own check says no (mm with 9 rows);
  - policy: a rule leaves the call to torch (F.linear of one row, with a rule
    installed on the CPU key for the benchmark, as the policy does on MPS);
  - turned off: the family is switched off.
Each call is made in a C++ loop through torch's dispatcher
(mps_ext_executor._C._routing_probe: Python's own per-call cost, microseconds and
noisy, stays out). The figure per case is the time of the mps_ext call minus
the time of the same aten call: the host cost mps_ext adds. Times are the
minimum over interleaved repeats (the machine may be shared), in
nanoseconds per call.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # python benchmarks/bench_routing.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import mps_ext  # noqa: E402
from benchmarks import common  # noqa: E402
import mps_ext_executor  # noqa: E402


# (probe case, what it shows, context: a rule or a switch set for it)
CASES = [
    ("copy_", "pass-through: copy_ of float32 (fp8 family)", None),
    ("eq", "pass-through: eq.Tensor of float32 (fp8 family)", None),
    ("mm", "unsupported: mm of 9 rows by 16 columns (linear family)", None),
    ("linear", "policy: F.linear of 1 row, a rule on CPU (linear family)", "policy"),
    ("constant_pad_nd", "turned off: constant_pad_nd (pad family)", "off"),
]


def measure(n: int = 20000, repeat: int = 15) -> list[dict]:
    torch.set_num_threads(1)  # torch's kernels on tiny tensors, without a thread pool's noise
    rows = []
    for case, what, context in CASES:
        if context == "policy":
            mps_ext._C.leave_to_torch("linear", "aten::linear", "CPU", "policy: benchmark rule")
        if context == "off":
            mps_ext.set_enabled("pad", False)
        try:
            ours, theirs = mps_ext_executor._C._routing_probe(case, n, repeat)
        finally:
            if context == "policy":
                mps_ext._C.leave_to_torch("linear", "aten::linear", "CPU", "")
            if context == "off":
                mps_ext.set_enabled("pad", True)
        rows.append({"case": what, "mps_ext (ns)": f"{ours:.0f}", "aten (ns)": f"{theirs:.0f}",
                     "added by mps_ext (ns)": f"{ours - theirs:.0f}"})
    mps_ext.reset_stats()
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    quick = "--tiny" in (argv or []) or "--quick" in (argv or [])
    rows = measure(n=2000 if quick else 20000, repeat=3 if quick else 15)
    print(f"## routing\n\nHost time per call on CPU tensors (a C++ loop through torch's dispatcher), torch "
          f"{torch.__version__}:\n\n{common.markdown(rows, list(rows[0]))}\n")
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
