"""torch 2.15's own _grouped_mm tile (GroupedMM.metal, read from the torch
sources cache) on the executor: benchmarks/release_gemm.py launches it as
GroupedMM.mm does and checks it against the grouped product in float64 inside
`run`; its counted share is the one benchmarks/prefill.py costs 2.15's
_grouped_mm with."""

import pytest
import torch

from benchmarks import efficiency, prefill, release_gemm


@pytest.fixture(autouse=True)
def _source():
    if not (release_gemm.torch_sources() / release_gemm.SOURCE_PATH).is_file():
        pytest.skip(str(release_gemm.SourceMissing(f"torch's {release_gemm.SOURCE_PATH} is not at "
                                                   f"{release_gemm.torch_sources()} (commit "
                                                   f"{release_gemm.SOURCE_COMMIT}; the wheel ships its header only)")))


@pytest.mark.parametrize("rows,bm", [(16, 16), (24, 16), (25, 32), (48, 32), (49, 64)])
def test_the_tile_is_the_one_grouped_mm_tile_rows_picks(rows, bm):
    """GroupedMM.mm's cut points: 64 rows above 48 a group, 32 above 24."""
    assert release_gemm.Shape(rows, 64, 64, 2).bm == bm


@pytest.mark.parametrize("shape", [
    release_gemm.Shape(16, 64, 128, 3),            # bm16: 2 simdgroups, a padding threadgroup per group
    release_gemm.Shape(40, 48, 96, 2),             # bm32, K not a multiple of the 16-deep k tile, N of 64
    release_gemm.Shape(64, 32, 64, 2, nk=False),   # bm64 (4 simdgroups), weights [E, K, N] (b_stride_n == 1)
])
def test_the_release_grouped_mm_tile_is_the_grouped_product(shape):
    """`run` raises unless the output is the float64 product within bf16's
    rounding. Planted: offsets of rows - 1 per group (a launch that is not
    torch's) and the a/b strides swapped in _params both fail here."""
    out, stats = release_gemm.run(shape)
    assert stats.kernel == release_gemm.kernel_name(torch.bfloat16, shape.bm)
    assert stats.total_threadgroups == shape.threadgroups[0] * shape.threadgroups[1]
    # every MMA the tiles issue: BM x 64 per k tile of 16 for each real row tile (the padding threadgroups leave)
    tiles = -(-shape.rows // shape.bm) * shape.groups * -(-shape.n // release_gemm.TILE_N)
    assert stats.matrix_flops == 2 * tiles * shape.bm * release_gemm.TILE_N * -(-shape.k // 16) * 16


def test_a_shape_torch_sends_to_its_few_rows_kernel_is_refused():
    with pytest.raises(ValueError, match="few-rows"):
        release_gemm.run(release_gemm.Shape(1, 64, 64, 8))


def test_the_prefill_figure_is_the_counter():
    """prefill.RELEASE_COUNTED's torch 2.15 _grouped_mm figure is what the
    counter gives at release_gemm.BUDGET_CASE, torch's and steel's (steel
    with every row used, as gmm_tiled_bf16's figure is taken): a kernel or
    launch that changes it fails here until prefill.py has the new one."""
    c = prefill.RELEASE_COUNTED["torch _grouped_mm (2.15)"]
    s = release_gemm.BUDGET_CASE
    assert c.kernel == release_gemm.kernel_name(torch.bfloat16, s.bm)
    torch_share = release_gemm.figures(s).useful_slot_fraction
    steel = efficiency.steel_figures(efficiency.Shape(torch.bfloat16, s.rows, s.n, s.k, s.groups, s.rows, s.full_n,
                                                      2, 2))
    assert (round(torch_share, 3), round(steel.matrix_slot_fraction, 3)) == (c.torch, c.steel)
    assert c.steel == prefill._COUNTED["gmm_tiled_bf16"].steel  # the same steel figure as ours is compared with
