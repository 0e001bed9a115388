"""Model tests (tests/models/model_compare.py says how they compare runs):
each records its figures, and `pytest tests/models -s` prints them at the
end."""

import time

import pytest

from model_compare import Figures

_FIGURES: list = []


@pytest.fixture
def figures(request):
    f = Figures(request.node.name)
    yield f
    f.seconds = time.perf_counter() - f.start
    _FIGURES.append(f)


def pytest_terminal_summary(terminalreporter):
    if not _FIGURES:
        return
    tr = terminalreporter
    tr.section("model tests: error vs float64 (stock -> mps_ext), families that ran kernels, time")
    for f in _FIGURES:
        errs = "; ".join(f"{k} {s:.2e} -> {o:.2e}" for k, (s, o) in f.errors.items())
        tr.write_line(f"{f.name}: [{', '.join(sorted(f.families))}] {f.seconds:.1f}s  {errs}")
