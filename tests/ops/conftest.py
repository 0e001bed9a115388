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


class Runner:
    """Calls aten op `name` so that mps_ext's kernel runs on `device`, and
    checks that it did, unless torch's own kernel ran by decision."""

    def __init__(self, device):
        self.device = device

    def __call__(self, name, *args, family, **kwargs):
        before = mps_ext.stats()[family]
        if self.device == "executor":
            out = getattr(torch.ops.mps_ext, name)(*args, **kwargs)
        else:
            moved = [a.to("mps") if isinstance(a, torch.Tensor) else a for a in args]
            out = getattr(torch.ops.aten, name)(*moved, **kwargs).cpu()
        _, problem = judge(family, self.device, before, mps_ext.stats()[family])
        assert not problem, problem
        return out


@pytest.fixture
def run(device):
    return Runner(device)
