import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def pytest_configure(config):
    config.addinivalue_line("markers", "mac: needs an Apple GPU (MPS)")
    config.addinivalue_line("markers", "torch_cpu_oracle: compares with torch's CPU kernels, whose results can "
                            "change with the instruction set they run; scripts/test.sh runs these tests again with "
                            "torch's CPU kernels capped (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, "
                            "MKL_ENABLE_INSTRUCTIONS)")
    # The suite runs torch.ops.mps_ext ops on CPU tensors through the CPU
    # Metal executor, which on a Mac they reach only when it is asked for
    # (mps_ext/_executor_request.py): the op layer's request, for this
    # thread, for the whole session. (The fp8 modules' own choice, the
    # context variable of request(), is left to each test.)
    try:
        from mps_ext import _C
    except Exception:  # the tests that need it fail on their own import
        return
    _C._set_executor_requested(True)


@pytest.fixture
def cpu_policy():
    """Lets a test apply policy rules to the CPU key (in production they
    apply to MPS only; mps_ext._leave_to_torch or _C.leave_to_torch), and
    removes them afterwards."""
    import mps_ext
    from mps_ext.cpu_metal._model_runner import _clear_policy
    mps_ext.reset_stats()
    yield
    _clear_policy("CPU")
    mps_ext.reset_stats()


@pytest.fixture
def simulate():
    """Sets a simulated failure of the executor backend (the way Metal can
    fail on a Mac: _C._simulate_executor_failure); afterwards the executor
    works again, and the failures remembered (launch.cpp) and recorded per
    family are forgotten (a real failure lasts the process)."""
    import mps_ext
    from mps_ext import _C
    mps_ext.reset_stats()

    def set_failure(library, kernel="", kind="library", max_threads=0):
        _C._simulate_executor_failure(library, kernel, kind, max_threads)

    yield set_failure
    _C._simulate_executor_failure("")
    for fam in mps_ext.families():
        _C._clear_unavailable(fam)
    mps_ext.reset_stats()
