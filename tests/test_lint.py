"""ruff (pinned in the test extra, configured in pyproject.toml) finds
nothing: an undefined name such as a lost `import` fails here, not only in
the test that reaches the line."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", str(ROOT)],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_ruff_sees_an_undefined_name(tmp_path):
    """The check is live: a planted file with an undefined name fails it."""
    bad = tmp_path / "planted.py"
    bad.write_text("def f(x):\n    return F.relu(x)\n")
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--select", "F", "--no-cache", str(bad)],
                         capture_output=True, text=True)
    assert out.returncode == 1 and "F821" in out.stdout, out.stdout + out.stderr
