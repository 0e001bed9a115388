"""mps_ext: Metal kernels that make PyTorch models faster and smaller on
Apple-silicon Macs.

`import mps_ext` overrides some of PyTorch's MPS ops with Metal kernels of its
own, where the installed torch's are slower or wrong. Model code does not
change. Importing never raises: if the kernels cannot be used here,
`unavailable_reason()` says why and torch runs as before.

    mps_ext.is_available()        # are the Metal kernels active?
    mps_ext.unavailable_reason()  # None, or one sentence why not
    mps_ext.enabled_ops()         # op families in use
    with mps_ext.disabled("pad"): ...   # torch's own kernel inside the block
    mps_ext.stats()               # per family: calls run, fallbacks and why

MPS_EXT_DISABLE=softmax,pad in the environment turns families off before
anything is installed. `python -m mps_ext` prints a report.
"""

from __future__ import annotations

import contextlib
import os
import platform
import sys
import warnings

from . import _policy

__version__ = "0.1.0"
__all__ = ["is_available", "unavailable_reason", "families", "enabled_ops", "set_enabled", "disabled",
           "stats", "reset_stats", "family_status", "quantize_fp8", "FP8Linear", "FP8Experts", "load_fp8",
           "optimize"]

_load_error: str | None = None
try:
    import torch as _torch

    from .fp8 import FP8Experts, FP8Linear, quantize_fp8
    from .checkpoint import load_fp8
    from .passes import optimize
    from . import _C, _meta

    _meta.register()
except Exception as e:  # never let a broken install break the user's import
    _C = None
    _load_error = f"{type(e).__name__}: {e}"


_env_disabled: dict[str, str] = {}  # family -> why it is off
_policy_skipped: dict[str, str] = {}        # family -> why it is not installed
_policy_left: dict[str, dict[str, _policy.Native]] = {}  # family -> {aten op: the rule that leaves it to torch}
_installed: list[str] = []

# Fallback reasons that are decisions, not problems: a user's switch and the
# policy (C++ prefixes every policy reason with "policy: ").
POLICY_PREFIX = "policy: "
TURNED_OFF = "turned off"


def _mac_version() -> tuple[int, ...]:
    v = platform.mac_ver()[0]
    return tuple(int(x) for x in v.split(".")) if v else ()


def unavailable_reason() -> str | None:
    """None if mps_ext's Metal kernels can run here; otherwise one sentence
    naming the cause."""
    if sys.platform != "darwin":
        return f"mps_ext's Metal kernels run on macOS with an Apple GPU; this is {platform.system()}."
    mac = _mac_version()
    if mac and mac < (14,):
        return f"macOS {'.'.join(map(str, mac))} is older than 14, the oldest macOS mps_ext supports."
    if _load_error is not None:
        return f"the native extension failed to load: {_load_error}"
    if not _torch.backends.mps.is_built():
        return "this torch was built without MPS support."
    if not _torch.backends.mps.is_available():
        return "torch sees no Metal GPU (torch.backends.mps.is_available() is False)."
    return None


def is_available() -> bool:
    return unavailable_reason() is None


def families() -> list[str]:
    """Every op family mps_ext has, available here or not."""
    return list(_C.families()) if _C is not None else []


def family_status(name: str) -> str:
    """'on' (possibly with what the policy leaves to torch on MPS, and the
    kernels that cannot run on this Mac), or why the family is off."""
    if _C is None:
        return "off: the native extension is not loaded"
    if name in _env_disabled:
        return f"off: {_env_disabled[name]}"
    if not _C.is_enabled(name):
        return "off: turned off at run time"
    if name in _policy_skipped:
        return f"left to torch on MPS: {_policy_skipped[name]}"
    notes = []
    if name in _policy_left:
        ops = ", ".join(op.split("::")[1] + (f" ({rule.scope()})" if rule.scope() else "")
                        for op, rule in sorted(_policy_left[name].items()))
        notes.append(f"{ops} left to torch on MPS")
    # A kernel that cannot run on this Mac takes down only the calls that
    # need it: the family stays on.
    unavailable = _C.stats()[name]["unavailable"]
    if "MPS" in unavailable:
        notes.append(f"unavailable on MPS: {unavailable['MPS']}")
    return f"on ({'; '.join(notes)})" if notes else "on"


def enabled_ops() -> list[str]:
    """Op families whose kernels run: for torch's MPS ops where mps_ext is
    available, and for torch.ops.mps_ext (CPU tensors, through a CPU backend
    where one is installed: mps_ext/_cpu_backend.py) everywhere."""
    return [f for f in families() if family_status(f).startswith("on")]


# Families that were split: each old name also switched the ops that are now
# the families listed here (kv_append and sigmoid_gate were norm's,
# linear_attention_decode and short_conv_decode linear's, the moe_* ops
# grouped_mm's). A request naming the old family alone keeps that meaning,
# with a DeprecationWarning once per name; one that also names any of its
# new families means the new ones.
_SPLIT = {"norm": ("attention_gate", "kv_cache"), "linear": ("linear_attention", "short_conv"),
          "grouped_mm": ("moe",)}
_warned_split: set[str] = set()


def _as_meant(names, stacklevel: int) -> list[str]:
    """The families a request naming `names` turns on or off: `names`, plus
    those an old name of _SPLIT still stands for."""
    out = list(dict.fromkeys(names))
    for old, new in _SPLIT.items():
        if old in out and not set(new) & set(out):
            out += [n for n in new if n not in out]
            if old not in _warned_split:
                _warned_split.add(old)
                warnings.warn(f"mps_ext: the op family {old!r} no longer includes {' and '.join(new)}, now "
                              f"families of their own; named alone, {old!r} still switches them too, for now. "
                              f"Name the families you mean: {','.join((old,) + new)} as before, or {old} with "
                              f"some of {', '.join(new)}", DeprecationWarning, stacklevel=stacklevel + 1)
    return out


def set_enabled(name: str, enabled: bool) -> None:
    """Turn a family on or off; off sends its calls to torch's own kernel."""
    if name not in families():
        raise ValueError(f"no op family {name!r}; mps_ext has {', '.join(families())}")
    for n in _as_meant([name], stacklevel=2):
        _C.set_enabled(n, bool(enabled))


@contextlib.contextmanager
def disabled(*names: str):
    """Inside the block, these families (all if none named) use torch's own
    kernels."""
    for n in names:
        if n not in families():
            raise ValueError(f"no op family {n!r}; mps_ext has {', '.join(families())}")
    names = _as_meant(names, stacklevel=3) if names else families()
    before = {n: _C.is_enabled(n) for n in names}
    for n in names:
        _C.set_enabled(n, False)
    try:
        yield
    finally:
        for n, was in before.items():
            _C.set_enabled(n, was)


def stats() -> dict[str, dict]:
    """Per family: {'ran': calls that ran mps_ext's kernels, 'fallbacks':
    {reason: calls that went to torch's own kernel}, 'unavailable':
    {device: why some of mps_ext's kernels cannot run there}} (a Metal
    library or pipeline that did not build on this Mac, or a pipeline that
    allows too few threads; the causes joined by '; '; empty normally).
    Only the calls that need such a kernel go to torch's kernel. Calls a family
    never takes are in neither count: the fp8 family overrides copy_, fill_,
    zero_, cat and index_select for every dtype (the dispatcher knows no
    finer key) and passes all but float8 straight to torch's kernel."""
    if _C is None:
        return {}
    return {k: {"ran": v["ran"], "fallbacks": dict(v["fallbacks"]), "unavailable": dict(v["unavailable"])}
            for k, v in _C.stats().items()}


def reset_stats() -> None:
    if _C is not None:
        _C.reset_stats()


def installed_overrides() -> list[str]:
    """Families installed as overrides of torch's MPS ops in this process."""
    return list(_installed)


def _leave_to_torch(family: str, rules: dict[str, _policy.Native], device: str) -> None:
    """Hands the policy's rules for `family` ({aten op: rule}) to the op
    layer for `device` ("MPS"; "CPU" in tests)."""
    for op, rule in rules.items():
        _C.leave_to_torch(family, op, device, POLICY_PREFIX + rule.what,
                          [getattr(_torch, d) for d in rule.kept_dtypes], list(rule.kept_args),
                          rule.calls.value if rule.calls else "")


def _setup() -> None:
    if _C is None:
        return
    known = set(_C.families())
    # A policy for a family the op layer does not have is a typo in this
    # package (never in the user's environment): fail its import, and so
    # every test, rather than never apply the rule.
    if set(_policy.NATIVE) - known:
        raise ValueError(f"mps_ext/_policy.py has rules for unknown op families "
                         f"{sorted(set(_policy.NATIVE) - known)}; the families are {sorted(known)}")
    requested = {n.strip() for n in os.environ.get("MPS_EXT_DISABLE", "").split(",") if n.strip()}
    unknown = requested - known - {"all"}
    if unknown:
        warnings.warn(f"MPS_EXT_DISABLE names unknown op families {sorted(unknown)}; "
                      f"mps_ext has {sorted(known)}", stacklevel=3)
    if "all" in requested:
        _env_disabled.update({n: "listed in MPS_EXT_DISABLE" for n in known})
    else:
        named = sorted(requested & known)
        _env_disabled.update({n: "listed in MPS_EXT_DISABLE" for n in named})
        for n in _as_meant(named, stacklevel=3):
            if n not in _env_disabled:  # a family the old name it was split from stands for
                old = next(o for o, new in _SPLIT.items() if n in new)
                _env_disabled[n] = f"MPS_EXT_DISABLE lists {old}, which included it"
    version = _torch.__version__
    for name in known:
        why = _policy.steps_aside(name, _C.family_aten_ops(name), version)
        if why:
            _policy_skipped[name] = why
            continue
        left = _policy.left_to_torch(name, version)
        if left:
            _policy_left[name] = left
        _leave_to_torch(name, left, "MPS")
    for name in _env_disabled:
        _C.set_enabled(name, False)
    if is_available():
        wanted = sorted(known - set(_env_disabled) - set(_policy_skipped))
        try:
            _installed.extend(_C.install_overrides(wanted))
            if "fp8" in _installed:
                # Now, with the overrides, not when float8 values first reach
                # the GPU: rewriting torch's dispatch tables later races
                # with threads running ops (csrc/ops/fp8_errors.cpp).
                _C.name_float8_errors("MPS")
        except Exception as e:  # keep torch usable whatever happens
            warnings.warn(f"mps_ext could not install its MPS overrides: {e}", stacklevel=3)


_setup()
