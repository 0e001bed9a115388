"""The architecture conformance sweep (tests/models/arch_sweep.py, whose
docstring gives what it compares and the bounds): one test per causal-LM
architecture of the installed transformers, failing on a mismatch or a crash
of optimize or quantize_fp8 (skipped architectures, whose tiny model could
not be built or run stock, pass: the table lists them), and a test that
docs/architectures.md is what the sweep gives on the pinned transformers.

A bug the sweep finds in today's optimize or quantize_fp8 is in KNOWN: its
architecture's case is an expected failure naming the bug, strict, so that
the fix turns it into a failure to remove from KNOWN.

MPS_EXT_SWEEP_TABLE=PATH writes the table of this run to PATH (the job on
the newest transformers release, .github/workflows/transformers-newest.yml,
compares it with the committed one)."""

import difflib
import functools
import os
import pathlib

import pytest
import transformers

import arch_sweep

# Empty today: the sweep's earlier finds (quantize_fp8 converting an nn.Linear whose weight the model
# reads itself, or a Linear subclass with its own forward; Mamba's mixers, the DSA indexers, DeepSeek-V4's
# grouped linear, LongCat-Flash's float router) are fixed: quantize_fp8 leaves those layers.
KNOWN: dict[str, str] = {}


@functools.lru_cache(maxsize=None)
def result(arch: str) -> arch_sweep.ArchResult:
    return arch_sweep.sweep_arch(arch)


def _case(arch):
    if arch in KNOWN:
        return pytest.param(arch, marks=pytest.mark.xfail(strict=True, reason=KNOWN[arch]))
    return arch


@pytest.mark.parametrize("arch", [_case(a) for a in arch_sweep.architectures()])
def test_architecture(arch):
    """Every pass on the tiny `arch` matches stock (or the oracle) as the
    sweep's rules say, or refuses clearly."""
    r = result(arch)
    failures = r.failures()
    assert not failures, "\n".join(failures) + f"\nrepro: python tests/models/arch_sweep.py {arch}"


def test_known_bugs_are_architectures_of_this_release():
    """KNOWN names only architectures the installed transformers has (a
    stale entry would otherwise hide nothing and say nothing)."""
    assert set(KNOWN) <= set(arch_sweep.architectures())


def test_the_table_is_what_the_sweep_gives():
    """docs/architectures.md equals the table of this run on the pinned
    transformers (regenerate: python tests/models/arch_sweep.py --write)."""
    text = arch_sweep.render([result(a) for a in arch_sweep.architectures()], transformers.__version__)
    out = os.environ.get("MPS_EXT_SWEEP_TABLE")
    if out:
        pathlib.Path(out).write_text(text)
    pinned = arch_sweep.pinned_transformers()
    if transformers.__version__ != pinned:
        pytest.skip(f"transformers {transformers.__version__} is not the pinned {pinned}, whose table "
                    f"docs/architectures.md holds" + (f"; this run's is {out}" if out else ""))
    committed = arch_sweep.TABLE.read_text() if arch_sweep.TABLE.exists() else ""
    diff = "".join(difflib.unified_diff(committed.splitlines(True), text.splitlines(True),
                                        "docs/architectures.md", "this run", n=0))
    if text != committed:
        pytest.fail(f"docs/architectures.md is not what the sweep gives; regenerate with "
                    f"`python tests/models/arch_sweep.py --write`:\n{diff[:6000]}")


# ----------------------------------------------------------- the sweep sees what it must --
def _planted(monkeypatch, step, plant):
    """mps_ext.<step> (as the sweep calls it), then plant(model)."""
    import mps_ext
    real = getattr(mps_ext, step)

    def planted(model, *args, **kwargs):
        model = real(model, *args, **kwargs)
        plant(model)
        return model

    monkeypatch.setattr(mps_ext, step, planted)


def _nudge_a_norm(model):
    """One norm weight 1e-3 larger: what a wrong eps or scale does, at the
    size of bfloat16 rounding, far above TIGHT."""
    next(p for n, p in model.named_parameters() if "norm" in n).data.mul_(1 + 1e-3)


@pytest.mark.parametrize("step", ["optimize", "quantize_fp8"])
def test_a_pass_that_changes_what_the_model_computes_is_a_mismatch(monkeypatch, step):
    """llama, whose every check is within TIGHT: a pass that leaves one
    weight 1e-3 off is a mismatch, named with its check and figure."""
    _planted(monkeypatch, step, _nudge_a_norm)
    r = arch_sweep.sweep_arch("llama")
    p = r.passes[step]
    assert p.status == "mismatch" and p.failed, p
    assert "differ from" in p.detail and ("the oracle" if step == "quantize_fp8" else "stock") in p.detail
    assert any(f.startswith(f"llama {step}: mismatch") for f in r.failures())


def test_an_exception_of_a_pass_is_a_crash_and_a_clear_refusal_is_not(monkeypatch):
    """RuntimeError inside optimize: a crash (a failure); ValueError with a
    message inside quantize_fp8: refused, not a failure; the passes that
    start from them are not run."""
    def crash(model):
        raise RuntimeError("planted")

    def refuse(model):
        raise ValueError("planted: this model is not for quantize_fp8")

    _planted(monkeypatch, "optimize", crash)
    _planted(monkeypatch, "quantize_fp8", refuse)
    r = arch_sweep.sweep_arch("llama")
    assert r.passes["optimize"].status == "crash" and "RuntimeError: planted" in r.passes["optimize"].detail
    assert r.passes["quantize_fp8"].status == "refused" and not r.passes["quantize_fp8"].failed
    assert {r.passes[n].status for n in ("quantize_fp8+optimize", "optimize+quantize_fp8")} == {"not run"}
    assert r.failures() == ["llama optimize: crash: RuntimeError: planted"]
