"""python -m mps_ext [--self-check]

Prints whether mps_ext's Metal kernels are active here and why not, the op
families with their state, and the calls counted so far. --self-check also
runs every op against torch's own CPU kernels (exit status 1 on a failure).
"""

import argparse
import platform
import sys

import torch

import mps_ext


def report() -> None:
    print(f"mps_ext {mps_ext.__version__}  torch {torch.__version__}  Python {platform.python_version()}  "
          f"{platform.system()} {platform.machine()}")
    reason = mps_ext.unavailable_reason()
    print("Metal kernels active: " + ("yes" if reason is None else f"no. {reason}"))
    installed = mps_ext.installed_overrides()
    width = max((len(f) for f in mps_ext.families()), default=10)
    print()
    print(f"{'op family':<{width}} {'state':<55} ops (aten overrides; mps_ext's own as mps_ext::op)")
    for fam in mps_ext.families():
        aten = [op.split("::")[1] for op in mps_ext._C.family_aten_ops(fam)]
        own = mps_ext._C.family_own_ops(fam)
        # Only aten ops are overrides; a family's own ops need no installing.
        where = ", ".join(aten) if fam in installed or not aten else f"(not installed) {', '.join(aten)}"
        ops = "; ".join(part for part in (where, ", ".join(own)) if part)
        print(f"{fam:<{width}} {mps_ext.family_status(fam):<55} {ops}")
    stats = mps_ext.stats()
    if any(s["ran"] or s["fallbacks"] or s["unavailable"] for s in stats.values()):
        print()
        for fam, s in stats.items():
            fb = "; ".join(f"{n} x {why}" for why, n in s["fallbacks"].items()) or "none"
            print(f"{fam:<{width}} ran {s['ran']}, fell back: {fb}")
            for device, why in s["unavailable"].items():
                print(f"{'':<{width}} kernels unavailable on {device}: {why}")
    print()
    print("Turn a family off: MPS_EXT_DISABLE=softmax,pad, or `with mps_ext.disabled('pad'):`.")


def self_check() -> bool:
    from mps_ext import _selfcheck

    print()
    devices = _selfcheck.devices()
    if not devices:
        print("self-check: nothing to check here (no Apple GPU, and no backend of CPU tensors installed)")
        return True
    print("self-check against torch's CPU kernels (" + ", ".join(devices) + ")")
    results = _selfcheck.run()
    failed = [r for r in results if not r.ok]
    for r in results:
        if not r.ok:
            print(f"  FAIL {r.device:<8} {r.case.name}: {r.detail}")
    by_family = {}
    for r in results:
        by_family.setdefault(r.case.family, []).append(r)
    for fam, rs in by_family.items():
        torch_runs = sum(r.ok and not r.ours and r.ran for r in rs)
        not_run = sum(not r.ran for r in rs)
        notes = [f"{torch_runs} on torch's own kernel by policy or switch"] if torch_runs else []
        notes += [f"{not_run} not run: off, and torch has no kernel for the op"] if not_run else []
        note = f" ({'; '.join(notes)})" if notes else ""
        print(f"  {fam:<10} {sum(r.ok for r in rs)}/{len(rs)} passed{note}")
    print("self-check " + ("passed" if not failed else f"FAILED ({len(failed)} of {len(results)})"))
    return not failed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mps_ext", description=__doc__.splitlines()[2])
    parser.add_argument("--self-check", action="store_true", help="run every op against torch's CPU kernels")
    args = parser.parse_args(argv)
    if mps_ext._C is None:
        print(f"mps_ext's native extension did not load: {mps_ext._load_error}")
        return 1
    report()
    ok = self_check() if args.self_check else True
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
