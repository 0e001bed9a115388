"""The benchmark runner (`python -m benchmarks`) on its tiny configuration:
every op's markdown table, the kernel table, and a PNG that decodes."""

import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks import __main__ as runner
from benchmarks import common, plot

import mps_ext

ROOT = Path(__file__).resolve().parents[1]


def decode_png(data: bytes) -> np.ndarray:
    """An 8-bit RGB PNG without filters back to pixels, checking every chunk's CRC."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert crc == zlib.crc32(kind + body), kind
        chunks.append((kind, body))
        pos += 12 + length
    assert [k for k, _ in chunks][0] == b"IHDR" and chunks[-1] == (b"IEND", b"")
    width, height, depth, colour, compression, filtering, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (depth, colour, compression, filtering, interlace) == (8, 2, 0, 0, 0)
    raw = zlib.decompress(b"".join(body for kind, body in chunks if kind == b"IDAT"))
    assert len(raw) == height * (1 + 3 * width)
    rows = np.frombuffer(raw, np.uint8).reshape(height, 1 + 3 * width)
    assert (rows[:, 0] == 0).all()  # filter type none on every scanline
    return rows[:, 1:].reshape(height, width, 3)


def test_png_round_trip():
    image = np.random.default_rng(0).integers(0, 256, (7, 13, 3), dtype=np.uint8)
    assert np.array_equal(decode_png(plot.png(image)), image)
    with pytest.raises(ValueError, match="height x width x 3 uint8"):
        plot.png(image.astype(np.float32))


def test_the_runner_on_its_tiny_configuration(tmp_path, capsys):
    png = tmp_path / "plot.png"
    results = runner.main(["--tiny", "--no-mac", "--png", str(png)])
    out = capsys.readouterr().out
    for op in runner.OPS:
        cases = runner.op_cases(op, "tiny")
        assert cases and [r.case.id for r in results if r.case.op == op] == [c.id for c in cases]
        table = out.split(f"## {op}\n\n")[1].split("\n\n")[0].splitlines()
        assert table[0].startswith("| ") and len(table) == 2 + len(cases)
        assert "| lines / min |" in table[0] and "| registers |" in table[0]
    # Every dispatch was measured with the counters on, and every kernel of
    # kernels_metal/ has a row in the kernel table.
    assert all(d.counters for r in results for d in r.stats)
    kernels = out.split("## Kernels\n\n")[1].split("\n\n")[0]
    for names in common.library_kernels().values():
        for name in names:
            assert f"| {name} |" in kernels
    reached = {d.kernel for r in results for d in r.stats}
    assert "softmax_segment_f16_f32_i32" in reached and "gemv_cols_f16_r2_vec" in reached
    # The plot: a group of bars per op, and each op's sums in the legend.
    image = decode_png(png.read_bytes())
    group = len(plot.SERIES) * (plot.BAR + plot.GAP) + plot.GROUP_GAP
    assert image.shape[1] == 2 * plot.MARGIN + len(runner.OPS) * group
    blue = np.all(image == plot.SERIES["mps_ext projected"], axis=2)
    assert blue.any(axis=0).sum() == len(runner.OPS) * plot.BAR  # one bar per op
    legend = out.split("## Plot\n\n")[1].split("\n\n")[1].splitlines()
    assert len(legend) == 2 + len(runner.OPS)
    for i, op in enumerate(runner.OPS):
        mine = [r for r in results if r.case.op == op]
        cells = [c.strip() for c in legend[2 + i].strip("|").split("|")]
        assert cells[:3] == [str(i + 1), op, str(len(mine))]
        assert float(cells[3]) == pytest.approx(sum(r.limit_us("M3 Ultra") for r in mine), rel=1e-3)
        assert float(cells[4]) == pytest.approx(sum(r.projected_us("M3 Ultra") for r in mine), rel=1e-3)
        assert cells[5:] == ["-", "-"]  # no Mac here


def test_a_case_that_reaches_no_kernel_is_an_error():
    case = common.Case("none", "nothing", {}, lambda: common.Prepared(lambda: None, 1))
    with pytest.raises(RuntimeError, match="made no dispatch"):
        common.measure(case, mac=False)


def test_unknown_op_is_refused(capsys):
    with pytest.raises(SystemExit):
        runner.main(["softmx", "--tiny"])
    assert "no benchmark for softmx; the ops are softmax, linear, pad, linalg, fp8, moe" in capsys.readouterr().err


def test_a_bench_script_runs_the_runner_on_its_op(tmp_path):
    r = subprocess.run([sys.executable, "benchmarks/bench_pad.py", "--tiny", "--no-mac", "--png", str(tmp_path / "p.png")],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "## pad" in r.stdout and "## softmax" not in r.stdout
    decode_png((tmp_path / "p.png").read_bytes())


def test_the_routing_benchmark_times_every_case_and_restores_what_it_set(capsys):
    from benchmarks import bench_routing

    rows = runner.main(["routing", "--tiny"])
    assert rows == []  # no kernel cases
    table = capsys.readouterr().out.split("## routing\n\n")[1].split("\n\n")[1].splitlines()
    assert len(table) == 2 + len(bench_routing.CASES)
    for line, (_, what, _) in zip(table[2:], bench_routing.CASES):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[0] == what and all(float(c) > 0 for c in cells[1:3])
    # The benchmark's switch and rule are undone: pad on, F.linear's one row runs mps_ext's kernel.
    assert mps_ext.family_status("pad").startswith("on")
    mps_ext.reset_stats()
    torch.ops.mps_ext.linear(torch.randn(1, 8), torch.randn(4, 8), None)
    assert mps_ext.stats()["linear"]["ran"] == 1
