import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def pytest_configure(config):
    config.addinivalue_line("markers", "mac: needs an Apple GPU (MPS)")


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
