"""torch.ops.mps_ext.kv_decode_attention, a decoded token's grouped-query
attention over the KV cache (csrc/ops/kv_cache.cpp, kernels_metal/kv_cache.metal:
kv_decode_attention, kv_decode_merge) on the executor: against the attention
in float64 on the same (rounded) inputs; each key and value row read from
device memory once for all the query heads sharing it (torch's decode
kernels read it once per query head); one dispatch for one block of keys,
two for more; clear errors.

Tolerance: the kernel computes in float and rounds the output to the dtype
once, so |got - want| <= the rounding of the output (half an ulp of the
dtype: 2^-24, 2^-11, 2^-8 of |want| for float32, float16, bfloat16) plus
float32 accumulation. The output is a convex combination of value rows, so
the accumulation error is at most (terms summed in one chain + the exp2 and
scaling roundings) ulps of float32 times max |v|: a chain is at most the
keys of a block (kv_cache.cpp's blocks) plus the blocks merged, below 4 *
keys + 64 here; float32's unit roundoff 2^-24 times that is the bound used.
Planted bugs (a kernel that skips a key, mixes up key-value heads, or merges
blocks with the wrong weight) are off by 0.1 to 0.75 (test docstrings)."""

import math

import pytest
import torch

import mps_ext  # noqa: F401  (registers torch.ops.mps_ext)
from host_names import host_names
import mps_ext_executor as cpu_metal

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
KERNEL_TYPE = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
HALF_ULP = {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}


def reference(q, k, v, scale):
    """softmax(q k^T * scale) v in float64, key-value head h // gqa for query head h."""
    gqa = q.shape[1] // k.shape[1]
    kk = k.double().repeat_interleave(gqa, dim=1)
    vv = v.double().repeat_interleave(gqa, dim=1)
    return torch.softmax(q.double() @ kk.transpose(-1, -2) * scale, dim=-1) @ vv


def bound(want, v, dtype, keys):
    return HALF_ULP[dtype] * want.abs() + 2.0 ** -24 * (4 * keys + 64) * v.double().abs().max()


def cache_views(b, hk, n, d, dtype, seed, spare=5):
    """k and v as mps_ext's cache pass holds them: the first n rows of
    buffers [b, hk, n + spare, d]; q as qk_norm_rope gives it, and a
    strided one (the model's view(...).transpose(1, 2))."""
    g = torch.Generator().manual_seed(seed)
    k_buf, v_buf = (torch.randn(b, hk, n + spare, d, generator=g).to(dtype) for _ in range(2))
    return k_buf[:, :, :n], v_buf[:, :, :n]


def query(b, hq, d, dtype, seed, strided):
    g = torch.Generator().manual_seed(seed)
    if strided:  # [b, 1, hq, d] viewed as [b, hq, 1, d]: q's heads and batch strided, not contiguous as a whole
        return torch.randn(b, 1, hq, 2 * d, generator=g).to(dtype)[..., :d].transpose(1, 2)
    return torch.randn(b, hq, 1, d, generator=g).to(dtype)


def blocks_of(b, hk, n, d):
    """kv_cache.cpp's blocks of keys: 256 threadgroups over b * hk, at least 128 keys, whole tiles of 2048 / d."""
    tile = 2048 // d
    per_block = -(-max(128, -(-n // max(1, -(-256 // (b * hk))))) // tile) * tile
    return -(-n // per_block)


CASES = [  # b, q heads, kv heads, head_dim, keys
    (1, 8, 1, 128, 1),      # one key: the output is its value row
    (1, 32, 4, 128, 37),    # Qwen3-30B-A3B's heads, an odd length, one block
    (1, 16, 2, 256, 1000),  # Qwen3.6's heads, several blocks
    (2, 8, 2, 64, 301),     # LFM2.5's head_dim and gqa 4, two sequences
    (1, 4, 4, 128, 129),    # gqa 1 (streams of 8 simdgroups), two blocks, the second of one key
    (1, 6, 2, 64, 50),      # gqa 3: streams 2 of 6 simdgroups
    (1, 16, 1, 64, 200),    # gqa 16: a simdgroup per query head, no streams
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("b,hq,hk,d,n", CASES, ids=[f"b{c[0]}-{c[1]}x{c[2]}-d{c[3]}-n{c[4]}" for c in CASES])
def test_decode_attention_is_the_attention_reading_the_cache_once(dtype, b, hq, hk, d, n):
    """Within the bound of the module docstring of float64 attention; one
    dispatch per block count (1, else 2); the keys and values read from
    device memory exactly once (their bytes, not gqa times), coalesced.
    Planted bugs: `r < rows` -> `r + 1 < rows` in the tile loop (a key
    skipped) fails at 0.1; `hq = hk * p.gqa + g` -> `hq = g * p.kv_heads +
    hk` fails every case of more than one key-value head and gqa > 1 (0.75);
    exp2 -> exp in kv_decode_merge fails the several-block cases (0.1). In
    float32: each fails 7, 4 and 4 of the 7 cases."""
    k, v = cache_views(b, hk, n, d, dtype, seed=n)
    q = query(b, hq, d, dtype, seed=n + 1, strided=b > 1)
    scale = 1 / math.sqrt(d)
    with cpu_metal.record(counters=True) as rec:
        got = torch.ops.mps_ext.kv_decode_attention(q, k, v, scale)
    want = reference(q, k, v, scale)
    assert got.shape == (b, hq, 1, d) and got.dtype == dtype and got.is_contiguous()
    err = (got.double() - want).abs()
    assert (err <= bound(want, v, dtype, n)).all(), f"max error {err.max().item():.3g}"
    blocks = blocks_of(b, hk, n, d)
    names = [x.kernel for x in rec.dispatches]
    t = KERNEL_TYPE[dtype]
    assert names == [f"kv_decode_attention_{t}_{d}"] + ([f"kv_decode_merge_{t}"] if blocks > 1 else []), names
    first = rec.dispatches[0]
    cache = b * hk * n * d * k.element_size()  # the filled rows of the keys (and of the values)
    assert (first.bytes_read[1], first.bytes_read[2]) == (cache, cache), "each cache row read once"
    assert max(first.coalescing.values()) <= 1.1, first.coalescing


def test_decode_attention_with_scale_and_large_scores():
    """A scale other than 1/sqrt(d) and scores far from 0 (the online
    softmax's running maximum, not a fixed offset, keeps exp2 in range:
    a kernel that does not rescale overflows to inf or nan)."""
    k, v = cache_views(1, 2, 700, 128, torch.float32, seed=7)
    q = query(1, 8, 128, torch.float32, seed=8, strided=False) * 30
    got = torch.ops.mps_ext.kv_decode_attention(q, k, v, 0.5)
    want = reference(q, k, v, 0.5)
    assert torch.isfinite(got).all()
    # scores of |s| ~ 500: exp2's relative error grows with |s| (float32 ulps of s * log2(e))
    assert (got.double() - want).abs().max() <= 2.0 ** -24 * 4096 * v.abs().max()


def test_decode_attention_errors():
    q, k = torch.randn(1, 8, 1, 128), torch.randn(1, 2, 10, 128)
    with pytest.raises(RuntimeError, match=r"kv_decode_attention: q must be \[batch, q_heads, 1, head_dim\]"):
        torch.ops.mps_ext.kv_decode_attention(torch.randn(1, 8, 2, 128), k, k, 1.0)
    with pytest.raises(RuntimeError, match=r"kv_decode_attention: k and v must be \[1, kv_heads, keys, 128\]"):
        torch.ops.mps_ext.kv_decode_attention(q, k, torch.randn(1, 2, 11, 128), 1.0)
    with pytest.raises(RuntimeError, match=r"query heads \(8\) must be a multiple of the key-value heads \(3\)"):
        torch.ops.mps_ext.kv_decode_attention(q, torch.randn(1, 3, 10, 128), torch.randn(1, 3, 10, 128), 1.0)
    with pytest.raises(RuntimeError, match="at most 16 query heads per key-value head, got 32"):
        torch.ops.mps_ext.kv_decode_attention(torch.randn(1, 32, 1, 64), *(torch.randn(1, 1, 4, 64),) * 2, 1.0)
    with pytest.raises(RuntimeError, match="head_dim must be 64, 128 or 256, got 96"):
        torch.ops.mps_ext.kv_decode_attention(torch.randn(1, 8, 1, 96), *(torch.randn(1, 2, 4, 96),) * 2, 1.0)
    with pytest.raises(RuntimeError, match=r"no keys to attend to \(k has 0 rows\)"):
        torch.ops.mps_ext.kv_decode_attention(q, *(torch.randn(1, 2, 0, 128),) * 2, 1.0)
    with pytest.raises(RuntimeError, match="q, k and v must have one dtype"):
        torch.ops.mps_ext.kv_decode_attention(q, k.half(), k.half(), 1.0)
    with pytest.raises(RuntimeError, match="kv_decode_attention: q must be float32, float16 or bfloat16"):
        torch.ops.mps_ext.kv_decode_attention(q.long(), k.long(), k.long(), 1.0)
    with pytest.raises(RuntimeError, match="scale must be finite, got inf"):
        torch.ops.mps_ext.kv_decode_attention(q, k, k, math.inf)


def test_every_kernel_is_tested():
    """test_decode_attention_is_the_attention_reading_the_cache_once runs
    every dtype's kernels at head_dim 64, 128 and 256 and the merge;
    test_kv_cache.py the appends."""
    decode = {f"kv_decode_attention_{t}_{d}" for t in KERNEL_TYPE.values() for d in (64, 128, 256)}
    merge = {f"kv_decode_merge_{t}" for t in KERNEL_TYPE.values()}
    assert host_names("kv_cache") - {f"kv_append_{t}" for t in KERNEL_TYPE.values()} == decode | merge


def test_meta_kernel_and_compile():
    """The fake kernel's shape, and the op traced by torch.compile
    (aot_eager) gives the eager result."""
    meta = torch.ops.mps_ext.kv_decode_attention(torch.empty(2, 8, 1, 64, device="meta"),
                                                 *(torch.empty(2, 2, 9, 64, device="meta"),) * 2, 0.125)
    assert meta.shape == (2, 8, 1, 64)
    k, v = cache_views(1, 2, 20, 64, torch.float32, seed=9)
    q = query(1, 8, 64, torch.float32, seed=10, strided=False)

    def f(q, k, v):
        return torch.ops.mps_ext.kv_decode_attention(q, k, v, 0.125) * 2

    assert torch.equal(torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v), f(q, k, v))
