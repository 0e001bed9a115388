"""The GitHub workflows parse (GitHub's workflow schema, as check-jsonschema
vendors it: pinned in the test extra, no network), the Linux workflow runs
what .ci/run runs, and the release workflow builds one wheel per supported
torch minor release, each saying which torch it is for."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.yml"))
sys.path.insert(0, str(ROOT / "tools"))
import build_config  # noqa: E402


def schema_check(*paths):
    return subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.github-workflows",
                           *map(str, paths)], capture_output=True, text=True)


def load(name):
    return yaml.safe_load((ROOT / ".github" / "workflows" / name).read_text())


def steps(workflow, job):
    return workflow["jobs"][job]["steps"]


def test_every_workflow_parses():
    assert {p.name for p in WORKFLOWS} >= {"ci.yml", "release.yml", "macos.yml"}
    r = schema_check(*WORKFLOWS)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_schema_check_finds_a_broken_workflow(tmp_path):
    """The check is live: a misspelt key (`step:`) fails it."""
    bad = tmp_path / "bad.yml"
    bad.write_text((ROOT / ".github" / "workflows" / "ci.yml").read_text().replace("    steps:", "    step:"))
    r = schema_check(bad)
    assert r.returncode == 1 and "'step' was unexpected" in r.stdout, r.stdout + r.stderr


def test_linux_ci_runs_what_ci_run_runs():
    runs = [s["run"].strip() for s in steps(load("ci.yml"), "ci") if "run" in s]
    assert runs == ["bash .ci/run"]


def test_release_builds_one_pinned_wheel_per_supported_torch_minor():
    wf = load("release.yml")
    assert wf[True]["push"]["tags"] == ["v*"] and "workflow_dispatch" in wf[True]  # YAML reads `on:` as True
    job = wf["jobs"]["wheel"]
    assert job["runs-on"].startswith("macos-")
    pins = job["strategy"]["matrix"]["torch"]
    assert all(re.fullmatch(r"\d+\.\d+\.\d+", p) for p in pins), pins
    minors = [build_config.torch_minor(p) for p in pins]
    want = [(2, m) for m in range(build_config.TORCH_OLDEST[1], build_config.TORCH_NEWEST[1] + 1)]
    assert build_config.TORCH_OLDEST[0] == build_config.TORCH_NEWEST[0] == 2 and minors == want
    script = "\n".join(s.get("run", "") for s in steps(wf, "wheel"))
    build = next(s for s in steps(wf, "wheel") if "pip wheel" in s.get("run", ""))
    assert build["env"] == {build_config.PIN_TORCH_ENV: "1"}
    assert 'pip install "torch==${{ matrix.torch }}"' in build["run"]
    assert "pip wheel --no-build-isolation --no-deps" in build["run"]
    assert 'tools/check_wheel.py dist/*.whl --torch "${{ matrix.torch }}"' in script
    assert any(s.get("uses", "").startswith("actions/upload-artifact@") for s in steps(wf, "wheel"))


def test_the_build_requirement_and_the_supported_range_agree():
    import tomllib
    build = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    assert build_config.torch_requirement() in build, build


def metadata(tmp_path, env):
    out = tmp_path / "egg"
    out.mkdir(parents=True)
    r = subprocess.run([sys.executable, "setup.py", "-q", "egg_info", "-e", str(out)], cwd=ROOT,
                       env={**os.environ, **env}, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    text = next(out.glob("*.egg-info")).joinpath("PKG-INFO").read_text()
    return (re.search(r"^Version: (.*)$", text, re.M).group(1),
            [line for line in text.splitlines() if line.startswith("Requires-Dist: torch<")])


def test_a_release_build_is_for_the_torch_it_is_built_against(tmp_path):
    import mps_ext
    import torch
    major, minor = build_config.torch_minor(torch.__version__)
    assert metadata(tmp_path / "pinned", {build_config.PIN_TORCH_ENV: "1"}) == (
        f"{mps_ext.__version__}+torch{major}.{minor}", [f"Requires-Dist: torch<{major}.{minor + 1},>={major}.{minor}"])
    assert metadata(tmp_path / "plain", {build_config.PIN_TORCH_ENV: ""}) == (
        mps_ext.__version__, [f"Requires-Dist: torch<{build_config.TORCH_NEWEST[0]}.{build_config.TORCH_NEWEST[1] + 1},"
                              f">={build_config.TORCH_OLDEST[0]}.{build_config.TORCH_OLDEST[1]}"])


@pytest.mark.parametrize("version", ["2.8.0", "2.16.0", "3.0"])
def test_a_pin_outside_the_supported_releases_is_refused(version):
    with pytest.raises(ValueError, match="not a supported release"):
        build_config.torch_requirement(version)
