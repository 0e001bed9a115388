"""What `model.generate` does around the forward, per decoded token,
counted from transformers' own generate code.

The tiny model of a census spec (benchmarks/census.py) runs `generate` on
the CPU with a TorchDispatchMode that records every aten call made outside
the model's forward (the forward is trace_step's): preparing the next
forward's inputs (cache position, the attention mask's concatenation), the
logits copy, the logits processors (temperature, top-k, top-p), the softmax
and multinomial (or argmax), the concatenation of the new token to the input
ids, the stopping criteria, and the stop check. One step is taken from the
middle of the loop (the calls after the second decode step's forward and
before the third's): the same calls run every step.

The stop check is what decides whether host and GPU overlap across tokens:
- "deferred": transformers' DeferredStopCheck, which generate uses on MPS
  (transformers PR 47975, in 5.23): the stop flag is copied to the host
  asynchronously (a copy with non_blocking=True: MPSStream::copy_and_sync
  commits the command buffer, SyncType::COMMIT), an event is recorded
  (MPSEvent::recordLocked commits again) and the host then waits for the
  event the previous step recorded: the host encodes token t+1 while the GPU
  runs token t. On the CPU transformers uses StopCheck, so the trace stands
  DeferredStopCheck in (is_supported made true, torch.Event replaced by a
  recorder of its record and synchronize calls).
- "sync": StopCheck (transformers before that PR, and any loop that reads
  each token on the host): `bool(unfinished_sequences.max() == 0)`, a sync
  every token.

Counts do not depend on the model's size (the loop makes the same calls at
any vocabulary and context); bytes do: a call that touches a tensor with a
vocabulary-sized dimension (the logits row and what top-k/top-p make of it)
is scaled by the real vocabulary over the tiny one, a call that touches one
of the sequence's length (the input ids, the attention mask) by the real
context over the traced length (Call.size, loop_bytes). Sorting and top-k
over a vocabulary-sized row count one dispatch a call, as every call does
(census.py: a lower bound where torch's kernel runs several passes).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks import census

SAMPLING = {
    "greedy": dict(do_sample=False),
    # transformers' usual sampling: temperature, then top-k and top-p
    "sampling": dict(do_sample=True, temperature=0.7, top_k=50, top_p=0.9),
}
STOP_CHECKS = ("deferred", "sync")
_STEP = 3  # the calls after this forward (1: the prefill) and before the next


@dataclasses.dataclass
class LoopTrace:
    calls: list          # census.Call of one step outside the forward, in order
    vocab: int           # the tiny model's vocabulary
    length: int          # the sequence's length when the step ran (context + tokens generated)
    sampling: str
    stop_check: str


class _Recorder(TorchDispatchMode):
    def __init__(self, trace: census.Trace, state: dict):
        super().__init__()
        self.trace, self.state = trace, state

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.state["in_forward"]:
            self.trace.record(func, args, kwargs, out, set(), None, None)
            call = self.trace.calls[-1]
            call.layer = self.state["forwards"]
            non_blocking = kwargs.get("non_blocking", len(args) > 2 and args[2])
            if call.op == "copy_" and non_blocking:  # an asynchronous copy to the host commits
                call.stream = "commit"
            call.size = _size(self.state, args, out)
            if self.state["in_stop_check"] and call.kind == "sync":
                # DeferredStopCheck reads the flag from its host copy (a CPU tensor on a Mac too): a call on a
                # host tensor, a trip through the dispatcher and no GPU work, costed as a view
                call.kind = "view"
        return out


def _size(state: dict, args, out) -> str:
    dims = {d for t in census._tensors((args, out)) for d in t.shape}
    if state["vocab"] in dims:
        return "vocab"
    if dims & {state["length"] - 1, state["length"], state["length"] + 1}:
        return "context"
    return ""


def _event_recorder(trace: census.Trace, state: dict):
    """A stand-in for torch.Event on the CPU: its record and synchronize are
    recorded as calls that commit and that wait for the previous step's."""

    class Event:
        def __init__(self, *args, **kwargs):
            pass

        def record(self, stream=None):
            trace.calls.append(census.Call("event_record", state["forwards"], "compute", False, 0, 0, 0,
                                           stream="commit"))

        def synchronize(self):
            trace.calls.append(census.Call("event_synchronize", state["forwards"], "compute", False, 0, 0, 0,
                                           stream="wait_previous"))

    return Event


def trace_loop(model, sampling: str = "sampling", tokens: int = 1, context: int = 12, stop_check: str = "deferred",
               transform=None, seed: int = 0) -> LoopTrace:
    """One decode step of `model.generate` outside the forward (see the
    module docstring), `tokens` sequences after a prompt of `context`
    tokens. `transform(model)` as census.trace_step's."""
    from transformers.generation import utils as gen

    if sampling not in SAMPLING:
        raise ValueError(f"sampling must be one of {sorted(SAMPLING)}, got {sampling!r}")
    if stop_check not in STOP_CHECKS:
        raise ValueError(f"stop_check must be one of {STOP_CHECKS}, got {stop_check!r}")
    if stop_check == "deferred" and not hasattr(gen, "DeferredStopCheck"):
        raise ValueError("this transformers has no DeferredStopCheck (its generate syncs every token): trace "
                         "stop_check='sync'")
    if transform is not None:
        model = copy.deepcopy(model)
        model = transform(model) or model
    vocab = model.config.vocab_size
    eos = vocab - 1
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, eos, (tokens, context), generator=g)
    state = {"in_forward": False, "in_stop_check": False, "forwards": 0, "vocab": vocab, "length": context}
    trace = census.Trace()

    def before(module, args, kwargs):
        state["in_forward"] = True

    def after(module, args, output):
        state["in_forward"] = False
        state["forwards"] += 1
        state["length"] = context + state["forwards"]  # the token this forward's logits choose is appended next

    handles = [model.register_forward_pre_hook(before, with_kwargs=True), model.register_forward_hook(after)]
    torch.manual_seed(seed)
    try:
        with torch.no_grad(), contextlib.ExitStack() as stack:
            if stop_check == "deferred":
                stack.enter_context(_patched(gen.DeferredStopCheck, "is_supported", staticmethod(lambda *a, **k: True)))
                stack.enter_context(_patched(torch, "Event", _event_recorder(trace, state)))
                check = gen.DeferredStopCheck.__call__

                def marked(self, *args, **kwargs):
                    state["in_stop_check"] = True
                    try:
                        return check(self, *args, **kwargs)
                    finally:
                        state["in_stop_check"] = False

                stack.enter_context(_patched(gen.DeferredStopCheck, "__call__", marked))
            elif hasattr(gen, "DeferredStopCheck"):
                stack.enter_context(_patched(gen.DeferredStopCheck, "is_supported",
                                             staticmethod(lambda *a, **k: False)))
            stack.enter_context(_Recorder(trace, state))
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=_STEP + 2, eos_token_id=eos,
                           pad_token_id=eos, **SAMPLING[sampling])
    finally:
        for h in handles:
            h.remove()
    if state["forwards"] <= _STEP + 1:
        raise RuntimeError(f"generate stopped after {state['forwards']} forwards (the tiny model chose its end "
                           f"token): no steady step to count; try another seed")
    calls = [c for c in trace.calls if c.layer == _STEP]
    for c in calls:
        c.layer = None
    return LoopTrace(calls, vocab, context + _STEP, sampling, stop_check)


@contextlib.contextmanager
def _patched(owner, name: str, value):
    old = owner.__dict__[name] if name in owner.__dict__ else getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


def call_bytes(loop: LoopTrace, call, real_vocab: int, context: int) -> float:
    """Bytes one of the loop's calls reads and writes in the real model's
    step at `context` (the module docstring: vocabulary- and length-sized
    calls scaled)."""
    factor = {"vocab": real_vocab / loop.vocab, "context": context / loop.length}.get(call.size, 1.0)
    return (call.read + call.written) * factor


def loop_bytes(loop: LoopTrace, real_vocab: int, context: int) -> float:
    """Bytes all the loop's calls read and write (call_bytes, summed)."""
    return sum(call_bytes(loop, c, real_vocab, context) for c in loop.calls)
