"""Check mode reports nothing on Metal that Apple's compiler builds every
day: the kernel headers of the mlx-metal macOS wheel and PyTorch's Metal
headers of every supported torch release (tools/metal_corpus.py). A file
the executor cannot take is in metal_corpus.EXCEPTED with the reason, and
must still fail (so the list shrinks when the executor learns it). A failed
download fails the test."""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import metal_corpus  # noqa: E402


def test_check_mode_passes_the_apple_compiled_corpus():
    corpus = metal_corpus.entries()
    assert sum(e.name.startswith("mlx/") for e in corpus) > 90  # the wheel's kernels directory, all of it
    assert sum(e.name.startswith("torch-") for e in corpus) > 30
    results = metal_corpus.check(corpus, jobs=min(2, os.cpu_count() or 1), include_excepted=True)
    failed = [r for r in results if r.findings and not r.excepted]
    stale = [r.entry.name for r in results if r.excepted and not r.findings]
    assert not failed, metal_corpus.report(failed)
    assert not stale, f"these pass now: take them out of metal_corpus.EXCEPTED: {stale}"
