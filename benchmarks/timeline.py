"""A decode step as an MPS stream runs it: the host encoding each call, the
GPU running what has been committed, and when the command buffer is
committed; tokens/s from the simulated steady state.

When torch's MPS stream commits (aten/src/ATen/mps/MPSStream.mm; the 2.14
source read at cyyever/pytorch 0343f8a, whose declarations are those of the
2.14 wheel's ATen/mps/MPSStream.h; the 2.15 wheel's header declares the
same SyncType and commit members, plus the recording of command-buffer
errors):
- at a synchronisation (SyncType::COMMIT_AND_WAIT: `.item()`, a blocking
  copy to the CPU such as the offs copy of torch <= 2.14's _grouped_mm
  fallback): the command buffer is committed and the host waits for it;
- at an asynchronous copy to the host (copy_and_sync with non_blocking:
  SyncType::COMMIT), an event record (MPSEvent::recordLocked commits), and
  mps_ext's commit op (mps_ext/stream.py): committed, nobody waits;
- MPSGraph ops (executeMPSGraph) and Metal kernels commit only at
  COMMIT_ADAPTIVE, when the allocator is within 1 MB of its low watermark
  (MPSAllocator.h of 2.14 and 2.15: 1.4 x the GPU's recommended working
  set), which decode does not reach; MPSGraph's own commitAndContinue
  heuristic (the execution descriptor's enableCommitAndContinue) is Apple's
  and undocumented: not modelled (if it commits inside a step, a stock step
  overlaps more than modelled here);
- mps_ext's kernels never commit (csrc/backend/metal.mm).
So within a step the GPU starts only at a commit: without one, the host's
encoding and the GPU's execution of the step add up.

The model (simulate): the host runs the step's calls in order, each taking
its host time (COSTS: per call, per view, per commit, per empty expert of
torch's fallback); each call adds its GPU time to the open command buffer
(dispatches x the GPU cost per dispatch + its bytes / bandwidth). A commit
sends the open buffer to the GPU: it starts when the GPU is free and the
buffer has arrived (ROUND_TRIP x SUBMIT_SHARE after the commit; a buffer
committed while the GPU is busy waits in the queue, its latency hidden). A
sync commits and the host resumes ROUND_TRIP x (1 - SUBMIT_SHARE) after the
GPU finishes; DeferredStopCheck's wait resumes the host that long after the
previous step's event. Steps repeat until the period is steady; tokens/s is
the sequences of a step over the period.

Calibration (calibrate): two constants are fitted, each on one release's
two published figures, and each model's fit predicts the other model's
figure: the GPU cost per dispatch on torch 2.15's (GPU-bound steps: the
deferred stop check overlaps the host with the previous step's GPU work),
the round trip of a synchronisation on torch 2.14's (whose steps sync twice
per MoE layer). The rest are measured or published, with ranges.
"""

from __future__ import annotations

import dataclasses
import math

from benchmarks import census
from benchmarks import generate_loop


@dataclasses.dataclass(frozen=True)
class Constant:
    low: float
    central: float
    high: float
    unit: str
    source: str


CALIBRATION = {"dispatch": "2.15", "round_trip": "2.14"}  # the release whose two figures fit each constant
BANDWIDTH = Constant(573e9, 647e9, 692e9, "B/s",
                     "M3 Ultra, 819 GB/s nominal: 692 sustained read (jundot/omlx issue 2238, 85%); dense decode "
                     "reaches 70-79% of nominal (573-647; anchors.md)")
DISPATCH = Constant(5e-6, 5.3e-6, 12e-6, "s",
                    "GPU time of one more dependent dispatch in a command buffer; range published: 5 us M2 Pro "
                    "(antonellof/ferrox issue 149), 10 us M3 Ultra in MLX's routing chain (jundot/omlx PR 2755), "
                    "10-12 us M5 Pro (ml-explore/mlx-lm PR 1676); central fitted on torch 2.15's two published "
                    "figures (calibrate)")
HOST = Constant(10e-6, 10e-6, 25e-6, "s",
                "host time of one call that encodes GPU work (Python, the dispatcher, torch's MPS encode); "
                "published: a command buffer ~10 us, an MPSGraph encode ~15 us (pytorch issue 82707), at least "
                "~20 us per eager op (pytorch/torchchat PR 1464, ~770 ops per token, M1 Pro); central the low "
                "end: torch 2.15's steps, host-bound above ~14 us (Qwen3.6) and ~17 us (LFM2.5), reach their "
                "published figures only below; compiled calls (Inductor's wrapper) costed the same")
VIEW = Constant(2.3e-6, 3e-6, 3.4e-6, "s",
                "host time of a view or metadata call from Python (a trip through the dispatcher, no GPU work): "
                "2.3-3.4 us, pytorch PR 32194's operator micro-benchmark of split (CPU and CUDA alike); eager "
                "only (compiled, Inductor's wrapper reinterprets tensors in C++)")
COMMIT = Constant(10e-6, 10e-6, 15e-6, "s",
                  "host time of a commit without a wait (a new command buffer ~10 us, pytorch issue 82707; an "
                  "MPSGraph encode ~15 us as the high end); mps_ext's commit op, an asynchronous copy's commit, "
                  "an event record")
ROUND_TRIP = Constant(0.46e-3, 0.51e-3, 0.57e-3, "s",
                      "a synchronisation's latency beyond the GPU work: a committed command buffer through the "
                      "pipeline until waitUntilCompleted returns; Apple: 'up to 2.5 ms just to get an empty "
                      "command buffer through the pipeline' (MetalPerformanceShaders, Tuning Hints); central "
                      "fitted on torch 2.14's two published figures, range what each implies (calibrate)")
SUBMIT_SHARE = Constant(0.0, 0.5, 1.0, "",
                        "the share of ROUND_TRIP between a commit and the GPU starting the buffer (the rest: from "
                        "the GPU finishing to the host resuming); not published, assumed even, the range every "
                        "split; it matters only where a commit lands on an idle GPU (our commit points)")
EMPTY_GROUP = Constant(0.8e-6, 1.6e-6, 3.0e-6, "s",
                       "host time of one group of torch <= 2.14's _grouped_mm fallback whose expert no token chose "
                       "(GroupedMMUtils.h's loop: offs_cpu[g], .item(), two slices, a select, an mm_out that "
                       "returns at once: 6 trips through the dispatcher in C++) at about 0.27 us a trip (pytorch PR "
                       "51165's empty-op framework overhead, a 2 GHz server core, turbo off): 1.6 us; 0.8 us on a "
                       "core twice as fast; 3.0 us measured on this machine (torch 2.13's CPU fallback, a loaded "
                       "2-core x86, where a Python view call took 2.7 us)")

COSTS = {"bandwidth": BANDWIDTH, "dispatch": DISPATCH, "host": HOST, "view": VIEW, "commit": COMMIT,
         "round_trip": ROUND_TRIP, "submit_share": SUBMIT_SHARE, "empty_group": EMPTY_GROUP}
# Which end of each constant makes a step slower.
_SLOW_IS_LOW = {"bandwidth"}


def costs(which: str = "central", **overrides) -> dict[str, float]:
    """The constants' values: 'central', 'low' (the slow end of each) or
    'high' (the fast end); `overrides` replace some."""
    if which not in ("central", "low", "high"):
        raise ValueError(f"which must be 'central', 'low' or 'high', got {which!r}")
    out = {}
    for name, k in COSTS.items():
        if which == "central" or name == "submit_share":
            out[name] = k.central
        else:
            slow = (which == "low") != (name in _SLOW_IS_LOW)
            out[name] = k.high if slow else k.low
    unknown = set(overrides) - set(out)
    if unknown:
        raise ValueError(f"no constant named {sorted(unknown)}; they are {sorted(out)}")
    out.update(overrides)
    return out


def constants_text() -> str:
    rows = []
    for name, k in COSTS.items():
        f, unit = {"B/s": (1e-9, "GB/s"), "s": (1e6, "us"), "": (1, "")}[k.unit]
        rows.append(f"- {name}: {k.low * f:g}-{k.high * f:g} {unit}, central {k.central * f:g} ({k.source})")
    return "\n".join(rows)


# ------------------------------------------------------------------- step --
@dataclasses.dataclass
class Op:
    """One host call of a step (or a commit point), as counts the constants
    turn into time (host_s, gpu_s)."""
    counts: census.Counts  # its host calls, views, empty groups, commits and dispatches
    bytes: float = 0.0     # it reads and writes (its share of its layer's)
    action: str = ""       # "", "commit", "sync" or "wait_previous"
    where: object = ""     # "pre", a layer index, "post", "loop", "commit"

    def host_s(self, k: dict) -> float:
        c = self.counts
        return c.host * k["host"] + c.views * k["view"] + c.empty * k["empty_group"] + c.commits * k["commit"]

    def gpu_s(self, k: dict) -> float:
        return self.counts.dispatches * k["dispatch"] + self.bytes / k["bandwidth"]


@dataclasses.dataclass
class Step:
    """A decode step's ops, and what they add up to."""
    ops: list
    counts: census.Counts
    bytes: float
    tokens: int


def step(spec: census.Spec, trace: census.Trace, tiny_config, loop: generate_loop.LoopTrace | None, release: str,
         mode: str, ours: bool, *, tokens: int, context: int, fp8: bool = False, fp8_head: bool = False,
         cache_copy: bool = True, cache: str = "dynamic", commit_after=(), layer_host_calls: int | None = None,
         dispatch_delta: dict | None = None) -> Step:
    """The ops of one decode step of `tokens` sequences at `context`: the
    forward (the traced layers in the real model's order, census.units'
    rules, `mode`), then generate's loop (`loop`, always eager; None: the
    forward alone). Bytes from census.layer_bytes / head_bytes (`fp8`,
    `fp8_head`, `cache_copy`, `cache`), spread over each layer's dispatches. What-ifs:
    a commit after each layer index in `commit_after`; `layer_host_calls`,
    the host calls a decoder layer costs eager (issue 31 point 4: one, the
    layer encoded from C++; the calls and views inside it cost nothing
    more); `dispatch_delta`, dispatches a layer of a kind (or "pre",
    "post": the calls outside the layers) loses (point 5's fusions)."""
    real = spec.config()
    calls, sequence = census.layer_calls(spec, trace, tiny_config)
    used = census.expected_experts(real.num_experts, real.num_experts_per_tok, tokens)
    segments = ["pre", *range(len(sequence)), "post"]
    # One list through census.units, so that compiled runs of generated code fuse across layer boundaries;
    # each call copied with its segment as `layer`.
    flat = [dataclasses.replace(c, layer=seg) for seg in segments
            for c in calls[seg if isinstance(seg, str) else sequence[seg]]]
    units = census.units(flat, release, mode, ours, real.num_experts, used, census.attention_keys(context, cache))
    head = census.head_bytes(real, tokens, fp8_head)
    seg_bytes = {"pre": head["pre"], "post": head["post"]}
    for i, kind in enumerate(sequence):
        seg_bytes[i] = census.layer_bytes(real, kind, tokens, context, fp8, cache_copy=cache_copy, cache=cache)["total"]
    seg_dispatches = dict.fromkeys(segments, 0.0)
    for call, c in units:
        seg_dispatches[call.layer] += c.dispatches
    delta = dispatch_delta or {}
    ops, total = [], census.Counts()
    commit_after = set(commit_after)
    for i, (call, c) in enumerate(units):
        seg = call.layer
        total = total + c
        n = seg_dispatches[seg]
        share = c.dispatches / n if n else 0.0
        cost = dataclasses.replace(c)
        cost.dispatches -= delta.get(sequence[seg] if isinstance(seg, int) else seg, 0) * share
        if isinstance(seg, int):
            if layer_host_calls is not None and mode == "eager":
                first = i == 0 or units[i - 1][0].layer != seg
                cost.host, cost.views, cost.empty = (layer_host_calls if first else 0), 0, 0
        ops.append(Op(cost, seg_bytes[seg] * share, _action(c), seg))
        last = i + 1 == len(units) or units[i + 1][0].layer != seg
        if last and seg in commit_after:
            ops.append(Op(census.Counts(commits=1), 0.0, "commit", "commit"))
            total.commits += 1
    nbytes = sum(seg_bytes.values())
    if loop is not None:
        for call, c in census.units(loop.calls, release, "eager", False):
            b = generate_loop.call_bytes(loop, call, real.vocab_size, context + 1) if c.dispatches else 0.0
            ops.append(Op(c, b, _action(c), "loop"))
            total = total + c
            nbytes += b
    return Step(ops, total, nbytes, tokens)


def _action(c: census.Counts) -> str:
    if c.syncs:
        return "sync"
    if c.waits:
        return "wait_previous"
    return "commit" if c.commits else ""


# -------------------------------------------------------------- simulation --
@dataclasses.dataclass
class Timeline:
    period: float          # seconds a step takes in the steady state
    tokens_per_s: float
    host_busy: float       # seconds of host time a step (its ops' host time)
    gpu_busy: float        # seconds of GPU work a step
    host_waits: float      # seconds a step the host waits (syncs, the previous step's event)
    gpu_idle: float        # seconds a step the GPU has nothing to run


def simulate(s: Step, k: dict, steps: int = 8) -> Timeline:
    """Run `steps` steps of `s` back to back with the constants `k`
    (costs(); the module docstring's model) and measure the last half."""
    if steps < 4:
        raise ValueError(f"steps must be at least 4 (the last half is measured), got {steps}")
    submit, complete = k["round_trip"] * k["submit_share"], k["round_trip"] * (1 - k["submit_share"])
    ops = [(op.host_s(k), op.gpu_s(k), op.action) for op in s.ops]
    t = gpu_free = open_gpu = 0.0
    ends, waited, idle = [], [], []
    marker = previous = None
    for _ in range(steps):
        w = gpu_idle = 0.0
        for host, gpu, action in ops:
            t += host
            open_gpu += gpu
            if not action:
                continue
            if action == "sync" or (action == "commit" and open_gpu > 0):
                start = max(gpu_free, t + submit)
                gpu_idle += start - gpu_free
                gpu_free = start + open_gpu
                open_gpu = 0.0
                marker = gpu_free
            if action == "sync":
                resume = gpu_free + complete
            elif action == "wait_previous" and previous is not None:
                resume = previous + complete
            else:
                continue
            w += max(0.0, resume - t)
            t = max(t, resume)
        previous = marker
        ends.append(t)
        waited.append(w)
        idle.append(gpu_idle)
    half = steps // 2
    period = (ends[-1] - ends[half - 1]) / (steps - half)
    return Timeline(period, s.tokens / period, sum(h for h, _, _ in ops), sum(g for _, g, _ in ops),
                    sum(waited[half:]) / (steps - half), sum(idle[half:]) / (steps - half))


def tokens_per_s(make_step, which: str = "central", **overrides) -> float:
    """Simulated tokens/s of the step `make_step()` builds, with the
    constants of costs(which, **overrides)."""
    return simulate(make_step(), costs(which, **overrides)).tokens_per_s


def tok_s_range(make_step, **overrides) -> tuple[float, float, float]:
    """(slow end, central, fast end) of tokens_per_s."""
    return tuple(tokens_per_s(make_step, w, **overrides) for w in ("low", "central", "high"))


# ------------------------------------------------------------- calibration --
def _solve(f, target: float, lo: float, hi: float) -> float | None:
    """The x in [lo, hi] with f(x) = target for f decreasing in x (tokens/s
    against a cost), by bisection; None if target is outside [f(hi), f(lo)]."""
    if not f(hi) <= target <= f(lo):
        return None
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) > target else (lo, mid)
    return (lo + hi) / 2


def calibrate(points: dict) -> dict:
    """`points`: {(model, release): (make_step, published tok/s)} for the
    two releases of CALIBRATION, two models each. Fits DISPATCH on its
    release's figures (each figure's own value, then their mean) with the
    other constants central, then ROUND_TRIP on its release's with that
    dispatch cost. Returns per figure: 'implied' (its own value of the
    constant it fits), 'predicted' (its tokens/s with the other model's
    implied value: the cross-validation) and 'fitted' (with both means);
    and 'dispatch', 'round_trip' (the means)."""
    out = {"figures": {}}
    fitted = {}
    for name, lo, hi in (("dispatch", 0.1e-6, 50e-6), ("round_trip", 0.0, 5e-3)):
        release = CALIBRATION[name]
        mine = {key: v for key, v in points.items() if key[1] == release}
        if len(mine) < 2:
            raise ValueError(f"calibrating {name} needs two published figures of torch {release}, got {len(mine)}")
        implied = {}
        for key, (make, published) in mine.items():
            x = _solve(lambda v: tokens_per_s(make, **fitted, **{name: v}), published, lo, hi)
            if x is None:
                raise ValueError(f"no {name} in [{lo}, {hi}] s reproduces {key}'s {published} tokens/s")
            implied[key] = x
        fitted[name] = sum(implied.values()) / len(implied)
        for key, (make, published) in mine.items():
            others = [v for other, v in implied.items() if other != key]
            predicted = tokens_per_s(make, **{n: v for n, v in fitted.items() if n != name},
                                     **{name: sum(others) / len(others)})
            out["figures"][key] = {"fits": name, "implied": implied[key], "published": published,
                                   "predicted": predicted}
    for key, (make, published) in points.items():
        out["figures"].setdefault(key, {"fits": None, "implied": None, "published": published, "predicted": None})
        out["figures"][key]["fitted"] = tokens_per_s(make, **fitted)
    out.update(fitted)
    return out


def within(ratio: float, tolerance: float = 0.15) -> bool:
    return math.isfinite(ratio) and abs(ratio - 1) <= tolerance
