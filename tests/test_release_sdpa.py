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
