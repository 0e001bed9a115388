"""torch's own decode SDPA kernels (the release's DecodeAttention.h) on the
executor: benchmarks/release_sdpa.py launches them as their text requires
(checked against the attention in float64 inside `run`), and what they read
is what the census's long-context rows rest on."""

import pytest

from benchmarks import census, release_sdpa


@pytest.mark.parametrize("keys", [1000, 1100])  # one pass below census.SDPA_TWO_PASS_KEYS, two from it
@pytest.mark.parametrize("q_heads,kv_heads", [(4, 2), (4, 1)])
def test_the_release_decode_sdpa_reads_the_cache_once_per_query_head(keys, q_heads, kv_heads):
    shape = release_sdpa.Shape(q_heads, kv_heads, 128, keys)
    counted = release_sdpa.count(shape)
    assert counted.dispatches == census.sdpa_dispatches(keys) == (1 if keys < census.SDPA_TWO_PASS_KEYS else 2)
    # every query head reads its key-value head's keys and values itself: gqa_factor times the cache
    assert counted.cache_bytes_read == shape.gqa * shape.cache_bytes()


def test_a_shape_torch_does_not_take_is_refused():
    with pytest.raises(ValueError, match="query heads a multiple"):
        release_sdpa.run(release_sdpa.Shape(3, 2, 128, 64))


@pytest.mark.parametrize("keys", [100, 1000, 1100])  # one block; several (the merge's dispatch)
@pytest.mark.parametrize("q_heads,kv_heads,head_dim", [(4, 2, 128), (8, 1, 64), (16, 2, 256)])
def test_ours_reads_the_cache_once_and_its_table_rule_is_what_the_executor_counts(keys, q_heads, kv_heads,
                                                                                  head_dim):
    """mps_ext's kv_decode_attention requests the cache's bytes once
    whatever the gqa factor, and release_sdpa.ours (the long-context
    table's figures, by kv_cache.cpp's launch rule) gives the dispatches
    and bytes the executor counts. Planted: OURS_MIN_BLOCK_KEYS = 256
    (another block rule) fails the 1000- and 1100-key cases; a kernel that
    loads each key row per simdgroup fails the cache check."""
    shape = release_sdpa.Shape(q_heads, kv_heads, head_dim, keys)
    counted = release_sdpa.count_ours(shape)
    assert counted.cache_bytes_read == shape.cache_bytes()
    assert counted == release_sdpa.ours(shape)
