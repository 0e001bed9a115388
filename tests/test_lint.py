"""The code is as the formatters write it (tools/format.py --check): ruff
(configured in pyproject.toml) finds nothing, so an undefined name such as a
lost `import` fails here, not only in the test that reaches the line; and
clang-format (.clang-format) would change nothing in csrc/ or kernels_metal/.
Both are pinned in the test extra. scripts/format.sh fixes what it can."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import format as fmt  # noqa: E402  (tools/format.py)


def test_the_code_is_formatted():
    problems = fmt.check()
    assert not problems, "scripts/format.sh fixes what it can:\n" + "\n".join(problems[:50])


def test_ruff_sees_an_undefined_name(tmp_path):
    """The check is live: a planted file with an undefined name fails it."""
    bad = tmp_path / "planted.py"
    bad.write_text("def f(x):\n    return F.relu(x)\n")
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--select", "F", "--no-cache", str(bad)],
                         capture_output=True, text=True)
    assert out.returncode == 1 and "F821" in out.stdout, out.stdout + out.stderr


def test_ruff_sees_a_long_line(tmp_path):
    """The repository's configuration (pyproject.toml) limits lines to 120."""
    bad = tmp_path / "planted.py"
    bad.write_text("x = " + " + ".join(["1"] * 40) + "\n")
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--config", str(ROOT / "pyproject.toml"),
                          "--no-cache", str(bad)], capture_output=True, text=True)
    assert out.returncode == 1 and "E501" in out.stdout, out.stdout + out.stderr


def planted(tmp_path, name, text, style_dir):
    """clang-format --dry-run -Werror on `text` as file `name`, with the
    configuration of the repository's directory `style_dir`."""
    return subprocess.run([fmt.clang_format(), "--dry-run", "-Werror", f"--assume-filename={ROOT / style_dir / name}"],
                          input=text, capture_output=True, text=True)


def test_clang_format_sees_a_misformatted_op(tmp_path):
    good = "namespace mps_ext {\nint twice(int x) { return 2 * x; }\n}  // namespace mps_ext\n"
    assert planted(tmp_path, "planted.cpp", good, "csrc/ops").returncode == 0
    bad = good.replace("int twice(int x) { return 2 * x; }", "int twice(int x)\n{\n    return 2*x;\n}")
    r = planted(tmp_path, "planted.cpp", bad, "csrc/ops")
    assert r.returncode == 1 and "code should be clang-formatted" in r.stderr, r.stderr


def test_clang_format_reads_metal_as_cpp_with_one_kernel_parameter_per_line(tmp_path):
    """A .metal file is formatted as C++ (the `kernel` and address-space
    words are identifiers to it), with kernels_metal/.clang-format's one
    parameter per line, and MPS_EXT_UNROLL on its own line."""
    good = ("kernel void k(device float* out [[buffer(0)]],\n"
            "              const device float* x [[buffer(1)]],\n"
            "              uint i [[thread_position_in_grid]]) {\n"
            "  MPS_EXT_UNROLL\n"
            "  for (int j = 0; j < 4; ++j) *(device float4*)(out + 4 * j) = float4(x[i]);\n"
            "}\n")
    assert planted(tmp_path, "planted.metal", good, "kernels_metal").returncode == 0
    packed = good.replace(",\n              ", ", ")
    assert planted(tmp_path, "planted.metal", packed, "kernels_metal").returncode == 1
    unrolled = good.replace("MPS_EXT_UNROLL\n  for", "MPS_EXT_UNROLL for")
    assert planted(tmp_path, "planted.metal", unrolled, "kernels_metal").returncode == 1
