"""Op tests run on every device mps_ext has here: 'executor' (CPU tensors
through torch.ops.mps_ext and the CPU Metal executor, always) and 'mps' (the
overridden aten ops on the GPU, where mps_ext is available). The reference is
torch's own CPU kernel.

On 'mps' an op the policy leaves to the installed torch, or a family turned
off, runs torch's own kernel: the test then checks torch's result, and does
not count it as a failure (mps_ext._selfcheck.judge)."""

import pytest
import torch

import mps_ext
from mps_ext._selfcheck import judge

# The mps parameter carries the `mac` marker: `-m "not mac"` leaves it out where
# torch reports a GPU that cannot run (GitHub's macOS runners: .github/workflows/macos.yml).
DEVICES = ["executor"] + ([pytest.param("mps", marks=pytest.mark.mac)] if mps_ext.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


def _to(x, device):
    """Tensors in x (or in a tuple of them: ops with several outputs) on `device`."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, tuple):
        return tuple(_to(v, device) for v in x)
    return x


class Runner:
    """Calls aten op `name` so that mps_ext's kernel runs on `device`, and
    checks that it did, unless torch's own kernel ran by decision. Returns
    the op's output on the CPU: a tensor, or a tuple of them."""

    def __init__(self, device):
        self.device = device

    def __call__(self, name, *args, family, **kwargs):
        before = mps_ext.stats()[family]
        if self.device == "executor":
            out = getattr(torch.ops.mps_ext, name)(*args, **kwargs)
        else:
            args, kwargs = _to(args, "mps"), {k: _to(v, "mps") for k, v in kwargs.items()}
            out = _to(getattr(torch.ops.aten, name)(*args, **kwargs), "cpu")
        _, problem = judge(family, self.device, before, mps_ext.stats()[family])
        assert not problem, problem
        return out


@pytest.fixture
def run(device):
    return Runner(device)
