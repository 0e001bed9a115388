"""torch.ops.mps_ext.kv_append, the KV cache append (csrc/ops/kv_cache.cpp,
kernels_metal/kv_cache.metal) on the executor: against torch's copy into the
same rows; one dispatch, every byte moved once, coalesced; clear errors."""

import pytest
import torch

import mps_ext
from host_names import host_names
import mps_ext_executor as cpu_metal

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
KERNEL_TYPE = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
DEVICES = ["executor"] + ([pytest.param("mps", marks=pytest.mark.mac)] if mps_ext.is_available() else [])


def on(device, *ts):
    return [t.to("mps") for t in ts] if device == "mps" else list(ts)


# ------------------------------------------------------------------ kv_append --
def new_rows(b, h, t, d, dtype, seed):
    """k as qk_norm_rope gives it ([b, h, t, d] contiguous) and v as the
    models' v_proj(...).view(b, t, h, d).transpose(1, 2) (strided)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(b, h, t, d, generator=g).to(dtype)
    v = torch.randn(b, t, h, d, generator=g).to(dtype).transpose(1, 2)
    return k, v


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("b,h,t,d,start", [(1, 2, 1, 256, 7), (2, 3, 5, 16, 0), (1, 4, 1, 300, 12)],
                         ids=["decode-256", "prefill", "long-row"])
def test_kv_append_writes_the_rows_in_place(device, dtype, b, h, t, d, start):
    """The new rows land at start .. start + t - 1 of each head, bit for
    bit, and nothing else of the caches changes; one dispatch writing only
    the new rows (k and v once each), coalesced."""
    cap = 16
    g = torch.Generator().manual_seed(3)
    k_cache, v_cache = (torch.randn(b, h, cap, d, generator=g).to(dtype) for _ in range(2))
    k, v = new_rows(b, h, t, d, dtype, seed=4)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want_k[:, :, start:start + t] = k
    want_v[:, :, start:start + t] = v
    kc, vc, kk, vv = on(device, k_cache, v_cache, k, v)
    with cpu_metal.record(counters=True) as rec:
        torch.ops.mps_ext.kv_append(kc, vc, kk, vv, start)
    assert torch.equal(kc.cpu(), want_k) and torch.equal(vc.cpu(), want_v)
    if device == "executor":
        (disp,) = rec.dispatches
        assert disp.kernel == "kv_append_" + KERNEL_TYPE[dtype]
        assert disp.bytes_written == {0: k.nbytes, 1: v.nbytes}
        assert (disp.bytes_read[2], disp.bytes_read[3]) == (k.nbytes, v.nbytes)
        if d * k.element_size() % 128 == 0:  # rows whole 128-byte lines (else a simdgroup's row straddles one more)
            assert max(disp.coalescing.values()) <= 1.1, disp.coalescing


def test_kv_append_errors():
    kc, vc = torch.zeros(1, 2, 8, 16), torch.zeros(1, 2, 8, 16)
    k = torch.randn(1, 2, 1, 16)
    with pytest.raises(RuntimeError, match="kv_append: rows 8 to 9 do not fit a cache of capacity 8"):
        torch.ops.mps_ext.kv_append(kc, vc, k, k, 8)
    with pytest.raises(RuntimeError, match="kv_append: rows -1 to 0 do not fit"):
        torch.ops.mps_ext.kv_append(kc, vc, k, k, -1)
    with pytest.raises(RuntimeError, match=r"kv_append: k and v must be \[1, 2, tokens, 16\]"):
        torch.ops.mps_ext.kv_append(kc, vc, torch.randn(1, 3, 1, 16), torch.randn(1, 3, 1, 16), 0)
    with pytest.raises(RuntimeError, match="kv_append: the caches and the new rows must have one dtype"):
        torch.ops.mps_ext.kv_append(kc, vc, k.half(), k.half(), 0)
    with pytest.raises(RuntimeError, match=r"kv_append: k_cache and v_cache must be contiguous .* \(not contiguous\)"):
        torch.ops.mps_ext.kv_append(kc.transpose(2, 3), vc.transpose(2, 3), k, k, 0)
    with pytest.raises(RuntimeError, match="kv_append: k_cache must be float32, float16 or bfloat16"):
        torch.ops.mps_ext.kv_append(kc.long(), vc.long(), k.long(), k.long(), 0)


def test_every_kernel_is_tested():
    # test_kv_append_writes_the_rows_in_place runs each dtype's kernel (test_kv_cache_decode.py the decode attention's).
    assert {n for n in host_names("kv_cache") if n.startswith("kv_append")} == {
        f"kv_append_{t}" for t in ("f32", "f16", "bf16")}


def test_meta_kernel_and_compile():
    """The fake kernel returns nothing (in place); compiled (aot_eager traces
    it on fake tensors, functionalised), the eager caches."""
    assert torch.ops.mps_ext.kv_append(*(torch.empty(1, 2, 4, 16, device="meta") for _ in range(2)),
                                       *(torch.empty(1, 2, 1, 16, device="meta") for _ in range(2)), 3) is None
    k, v = new_rows(1, 2, 1, 16, torch.float32, seed=5)

    def step(k_cache, v_cache, k, v):
        torch.ops.mps_ext.kv_append(k_cache, v_cache, k, v, 2)
        return k_cache + v_cache

    caches = [torch.zeros(1, 2, 4, 16) for _ in range(4)]
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(caches[0], caches[1], k, v)
    want = step(caches[2], caches[3], k, v)
    assert torch.equal(got, want) and torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[0][:, :, 2:3].equal(k)
