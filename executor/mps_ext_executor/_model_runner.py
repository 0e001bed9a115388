"""Whole models through mps_ext's kernels without a Mac.

    import mps_ext_executor as cpu_metal
    with cpu_metal.run_model(torch_release="2.13") as report:
        model.generate(ids, max_new_tokens=4)        # CPU tensors
    print(report)                                    # per family: ran, left to torch (why), dispatches, bytes
    report.ran_kernels()                             # {"linear", "softmax", ...}

Inside the block every aten call the package would take on a Mac with that
torch release goes to torch.ops.mps_ext.<op>, which runs the kernels on the
CPU Metal executor for CPU tensors or hands the call to aten's CPU kernel,
counting why (mps_ext.stats()); every other call runs torch's CPU kernel.
docs/dev/model_runner.md says how it works and what it does not see.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from mps_ext import _policy

_OLDEST_RELEASE = (2, 9)
_active = threading.Lock()  # one runner at a time: the CPU policy rules are process-wide


@dataclasses.dataclass
class OpReport:
    ran: int = 0  # calls that ran mps_ext's kernels
    left_to_torch: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # reason -> calls


@dataclasses.dataclass
class FamilyReport:
    ran: int = 0
    left_to_torch: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # reason -> calls
    ops: dict[str, OpReport] = dataclasses.field(default_factory=dict)  # "aten::mm" -> its calls
    dispatches: int = 0  # executor dispatches of the calls that ran
    bytes: int = 0  # bytes those dispatches read and wrote in tensors (DispatchStats.memory_bytes_moved)
    kernels: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # kernel -> dispatches


@dataclasses.dataclass
class ModelReport:
    """What a block run under run_model() did, per op family."""

    torch_release: str
    families: dict[str, FamilyReport] = dataclasses.field(default_factory=dict)
    # Dispatches made inside the block that no routed call made (none
    # unless something calls the executor directly).
    other_dispatches: int = 0

    def family(self, name: str) -> FamilyReport:
        return self.families.setdefault(name, FamilyReport())

    def ran_kernels(self) -> set[str]:
        """Families with at least one call that ran mps_ext's kernels."""
        return {name for name, f in self.families.items() if f.ran}

    def left_to_torch(self, name: str) -> dict[str, int]:
        """Family `name`'s calls that went to torch's kernel, per reason."""
        return dict(self.families[name].left_to_torch) if name in self.families else {}

    def __str__(self) -> str:
        lines = [f"mps_ext on CPU tensors, policy of torch {self.torch_release}:"]
        for name, f in sorted(self.families.items()):
            lines.append(f"  {name}: {f.ran} calls ran kernels ({f.dispatches} dispatches, {f.bytes} bytes), "
                         f"{sum(f.left_to_torch.values())} left to torch")
            for op, o in sorted(f.ops.items()):
                lines.append(f"    {op}: ran {o.ran}")
                lines.extend(f"      {n} x {why}" for why, n in sorted(o.left_to_torch.items()))
        if self.other_dispatches:
            lines.append(f"  dispatches made outside a routed call: {self.other_dispatches}")
        return "\n".join(lines)


def _owned_ops() -> dict:
    """aten OpOverload -> torch.ops.mps_ext OpOverload, for every aten op a
    family implements (those the installed torch has)."""
    from mps_ext import _C
    out = {}
    for fam in _C.families():
        for qualified in _C.family_aten_ops(fam):
            name, _, overload = qualified.split("::")[1].partition(".")
            aten = getattr(getattr(torch.ops.aten, name, None), overload or "default", None)
            if aten is not None:
                out[aten] = getattr(getattr(torch.ops.mps_ext, name), overload or "default")
    return out


class _Dispatch(TorchDispatchMode):
    """Sends the aten calls a family owns to torch.ops.mps_ext and records
    each call of a torch.ops.mps_ext op (those and the ones model code, e.g.
    mps_ext's fp8 modules, makes itself): which family's counters it moved
    and the executor dispatches it made."""

    def __init__(self, report: ModelReport, owned: dict, recorder):
        super().__init__()
        self.report, self.owned, self.recorder = report, owned, recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = self.owned.get(func)
        if target is None and func.namespace != "mps_ext":
            return func(*args, **kwargs)
        return self._measured(func if target is None else target, args, kwargs)

    def _measured(self, op, args, kwargs):
        from mps_ext import _C
        before = _C.stats()
        self.report.other_dispatches += len(self.recorder.take())
        out = op(*args, **kwargs)
        after = _C.stats()
        dispatches = self.recorder.take()
        name = op._schema.name + ("" if op._overloadname == "default" else f".{op._overloadname}")
        if op in self.owned.values():
            name = "aten::" + name.split("::")[1]  # the aten op it stands for
        # A call no counter saw is one the family never takes (fp8's copy_ of
        # a float tensor): not reported.
        for fam, a in after.items():
            b = before[fam]
            ran = a["ran"] - b["ran"]
            fell = {why: n - b["fallbacks"].get(why, 0) for why, n in a["fallbacks"].items()
                    if n != b["fallbacks"].get(why, 0)}
            if not ran and not fell:
                continue
            f = self.report.family(fam)
            o = f.ops.setdefault(name, OpReport())
            f.ran += ran
            o.ran += ran
            f.left_to_torch.update(fell)
            o.left_to_torch.update(fell)
            if ran:  # the dispatches are the kernels of the family that ran
                f.dispatches += len(dispatches)
                f.bytes += sum(d.memory_bytes_moved for d in dispatches)
                f.kernels.update(d.kernel for d in dispatches)
                dispatches = []
        self.report.other_dispatches += len(dispatches)
        return out


class _Linear(TorchFunctionMode):
    """F.linear as one call, as on a Mac: aten::linear has an MPS kernel
    there (mps_ext's override), while on CPU it is a composite that
    decomposes into t and mm/addmm before a dispatch mode sees it. Calls
    that need autograd decompose as before (torch.ops.mps_ext.linear has no
    derivative); their mm/addmm are still routed."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear and not (
                torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                                for t in (*args, *kwargs.values()))):
            return torch.ops.mps_ext.linear(*args, **kwargs)
        return func(*args, **kwargs)


def _apply_policy(release: str, device: str = "CPU") -> None:
    """The rules of `release` (mps_ext/_policy.py) on the CPU key, and no
    others: the same call that puts the installed torch's on the MPS key at
    import."""
    import mps_ext
    _clear_policy(device)
    for fam in mps_ext.families():
        mps_ext._leave_to_torch(fam, _policy.left_to_torch(fam, release), device)


def _clear_policy(device: str = "CPU") -> None:
    import mps_ext
    for fam in mps_ext.families():
        for op in mps_ext._C.family_aten_ops(fam):
            mps_ext._C.leave_to_torch(fam, op, device, "")


@contextlib.contextmanager
def run_model(torch_release: str | None = None):
    """Runs the block's CPU tensor ops as a Mac with torch `torch_release`
    ("2.13"; default: the installed torch) would run them with mps_ext:
    what mps_ext takes there runs its kernels on the CPU Metal executor,
    what the release's policy leaves to torch, and what the ops do not
    handle, run aten's CPU kernels. Yields a ModelReport, filled in as the
    calls run. mps_ext's fp8 modules use their kernels inside (it enters
    mps_ext_executor.request())."""
    import mps_ext
    from mps_ext import _C
    from . import install, record, request
    if _C is None:
        raise RuntimeError(f"mps_ext's native extension is not loaded: {mps_ext.unavailable_reason()}")
    release = torch_release or torch.__version__
    try:
        version = _policy.torch_version(str(release))
    except (ValueError, IndexError):
        raise ValueError(f"torch_release must be a release such as '2.13', not {release!r}") from None
    if version < _OLDEST_RELEASE:
        raise ValueError(f"torch_release {release!r} is older than 2.9, the oldest torch mps_ext supports")
    if not _active.acquire(blocking=False):
        raise RuntimeError("run_model() is already active: the policy rules it sets are process-wide, so runs "
                           "cannot nest or overlap")
    report = ModelReport(torch_release=f"{version[0]}.{version[1]}")
    try:
        install()  # the executor as mps_ext's backend of CPU tensors (idempotent)
        _apply_policy(str(release))
        with record() as recording, request(), \
                _Dispatch(report, _owned_ops(), recording), _Linear():
            yield report
    finally:
        _clear_policy()
        _active.release()
