"""Commit points: let the GPU start a decode step's work while the host
encodes the rest of it.

PyTorch's MPS stream encodes every op into one command buffer and commits
it only at a synchronisation (`.item()`, a blocking copy to the CPU), at an
asynchronous copy or event, or under memory pressure (`COMMIT_ADAPTIVE`
commits at the allocator's low watermark, 1.4 x the GPU's recommended
working set, which decode never reaches). Until then the GPU has nothing to
run: the host's encoding of a step and the GPU's execution of it add up.
`torch.ops.mps_ext.commit(x)` commits the current stream's command buffer
(`MPSStream::synchronize(SyncType::COMMIT)`, csrc/backend/metal.mm) without
waiting; on CPU tensors (a test's CPU backend) it does nothing, and the
census counts it (benchmarks/census.py).

    mps_ext.stream.install_commits(model, every=4)   # after layers 4, 8, ...
    mps_ext.stream.remove_commits(model)

A commit costs the host about 10 us (a new command buffer, pytorch issue
82707) and, if the GPU is idle when it lands, the time a command buffer
takes to start. Where it pays, and the `every` that pays most, is decided
by benchmarks/timeline.py's simulation (docs/decode.md, "Commit points"):
it pays when the host waits for the GPU once a token (a loop that reads
each token on the host, such as generate with transformers' StopCheck) and
buys nothing when the loop already overlaps tokens (transformers'
DeferredStopCheck on MPS), where the step is bound by the GPU or the host
alone.
"""

from __future__ import annotations

import torch

_HANDLES = "_mps_ext_commit_hooks"


def commit(x: torch.Tensor) -> None:
    """Commit the command buffer of the stream `x`'s device encodes on (MPS:
    the current MPS stream; CPU: nothing)."""
    torch.ops.mps_ext.commit(x)


def commit_layers(layers: int, every: int) -> list[int]:
    """The decoder layers (0-based) after which install_commits commits:
    every `every`-th, not the last (the step's own commit follows it: the
    stop check's copy to the host, or a synchronisation)."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"every must be a positive int (commit after every `every`-th decoder layer), got {every!r}")
    return [i for i in range(layers) if (i + 1) % every == 0 and i + 1 < layers]


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """A transformers causal LM's decoder layers (`model.get_decoder().layers`,
    or `model.layers`)."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model
    layers = getattr(base, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no decoder layers to commit after (looked for a ModuleList "
                         "`layers` on model.get_decoder() or the model)")
    return layers


def _first_tensor(x):
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (tuple, list)):
        for y in x:
            t = _first_tensor(y)
            if t is not None:
                return t
    return None


def _commit_after(module, args, output):
    t = _first_tensor(output)
    if t is not None:
        commit(t)


def install_commits(model: torch.nn.Module, every: int) -> list[int]:
    """Commit the MPS stream after every `every`-th decoder layer of `model`
    (commit_layers): a forward hook on each of those layers. Replaces
    commits installed before. Returns the layers' indices."""
    layers = decoder_layers(model)
    chosen = commit_layers(len(layers), every)
    remove_commits(model)
    setattr(model, _HANDLES, [layers[i].register_forward_hook(_commit_after) for i in chosen])
    return chosen


def remove_commits(model: torch.nn.Module) -> None:
    """Remove the commits install_commits installed (none: nothing to do)."""
    for handle in getattr(model, _HANDLES, ()):
        handle.remove()
    if hasattr(model, _HANDLES):
        delattr(model, _HANDLES)
