import os
import sys

# One torch (OpenMP) thread per test process, this one's and its
# subprocesses': the suite's parallelism is pytest-xdist's workers, one a
# core, and a second intra-op thread a worker oversubscribes the cores:
# OpenMP's threads then wait on each other's barriers, and a tiny op takes
# milliseconds (torch.conv1d of LFM2's short convolution, measured on this
# 2-core machine under load: tests/models/test_optimize_short_conv.py 165 s
# with 2 threads, 37 s with 1). Set before torch is imported; a value given
# outside is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The CPU Metal executor is a package of its own (executor/), which
# scripts/setup.sh installs; the checkout's copy comes first, as mps_ext's
# does, for this process and for the Python subprocesses tests start.
EXECUTOR = os.path.join(ROOT, "executor")
for path in (EXECUTOR, ROOT):
    if path not in sys.path:
        sys.path.insert(0, path)
os.environ["PYTHONPATH"] = os.pathsep.join([ROOT, EXECUTOR] + [p for p in os.environ.get("PYTHONPATH", "").split(
    os.pathsep) if p and p not in (ROOT, EXECUTOR)])


# How pytest-xdist shares the suite between the workers (--dist loadgroup in
# pyproject.toml): by groups, each run whole by one worker, so a file's module
# fixtures are made once. A file is a group, except the long files whose
# parts are independent, which split by one parameter (SPLIT_BY), and the
# groups start longest first: the workers share the tail instead of one
# running a 7-minute file after the other has finished. Measured on CI's
# 2 cores (--durations): test_budgets.py about 450 s (its fp8 cases 203 s),
# test_torch_matrix.py 40-90 s per torch release, the Apple corpus 113 s,
# test_docs.py's decode census 2-5 min and its prefill census about 3 min, test_prefill_census.py 1-3 min.
SPLIT_BY = {"tests/test_budgets.py": "op", "tests/test_torch_matrix.py": "version"}
LONGEST_FIRST = ("tests/test_budgets.py", "tests/test_docs.py", "tests/test_torch_matrix.py",
                 "tests/cpu_metal/test_corpus.py", "tests/models/test_architecture_sweep.py",
                 "tests/test_prefill_census.py")


def xdist_group_of(item) -> str:
    path = item.nodeid.split("::")[0]
    by = SPLIT_BY.get(path)
    params = getattr(item, "callspec", None) and item.callspec.params or {}
    if by == "op" and "kernel" in params:  # a budget of one kernel: measured by its op's cases
        return f"{path}::{item.module.BUDGETS[params['kernel']].op}"
    if by in params:
        return f"{path}::{params[by]}"
    return path


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the marks
def pytest_collection_modifyitems(config, items):
    sizes: dict[str, int] = {}
    for item in items:
        group = xdist_group_of(item)
        item.add_marker(pytest.mark.xdist_group(group))
        sizes[group] = sizes.get(group, 0) + 1

    def rank(item):  # the listed long files first, then (as xdist would) the groups with most tests
        group = xdist_group_of(item)
        path = group.split("::")[0]
        listed = LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)
        return listed, -sizes[group], group

    items.sort(key=rank)  # stable: a group's tests keep their order


def pytest_configure(config):
    config.addinivalue_line("markers", "mac: needs an Apple GPU (MPS)")
    config.addinivalue_line("markers", "torch_cpu_oracle: compares with torch's CPU kernels, whose results can "
                            "change with the instruction set they run; scripts/test.sh runs these tests again with "
                            "torch's CPU kernels capped (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, "
                            "MKL_ENABLE_INSTRUCTIONS)")
    # The suite runs torch.ops.mps_ext ops on CPU tensors through the CPU
    # Metal executor: installed as mps_ext's backend of CPU tensors, and, as
    # on a Mac they reach it only when it is asked for, asked for by the op
    # layer's request of this thread for the whole session. (The fp8
    # modules' own choice, the context variable of request(), is left to
    # each test.)
    try:
        import mps_ext
        import mps_ext_executor
    except Exception:  # the tests that need them fail on their own import
        return
    if mps_ext._C is None:  # the tests that need it fail, saying why (mps_ext._load_error)
        return
    mps_ext_executor.install()
    mps_ext_executor._C._set_requested(True)


@pytest.fixture
def cpu_policy():
    """Lets a test apply policy rules to the CPU key (in production they
    apply to MPS only; mps_ext._leave_to_torch or _C.leave_to_torch), and
    removes them afterwards."""
    import mps_ext
    from mps_ext_executor._model_runner import _clear_policy
    mps_ext.reset_stats()
    yield
    _clear_policy("CPU")
    mps_ext.reset_stats()


@pytest.fixture
def simulate():
    """Sets a simulated failure of the executor backend (the way Metal can
    fail on a Mac: mps_ext_executor._C._simulate_failure); afterwards the
    executor works again, and the failures remembered (launch.cpp) and
    recorded per family are forgotten (a real failure lasts the process)."""
    import mps_ext
    import mps_ext_executor
    from mps_ext import _C
    mps_ext.reset_stats()

    def set_failure(library, kernel="", kind="library", max_threads=0):
        mps_ext_executor._C._simulate_failure(library, kernel, kind, max_threads)

    yield set_failure
    mps_ext_executor._C._simulate_failure("")
    for fam in mps_ext.families():
        _C._clear_unavailable(fam)
    mps_ext.reset_stats()
