"""torch.ops.mps_ext.rms_norm against transformers' own RMSNorm modules
(Qwen3-MoE and LFM2-MoE: weight * normed in the model's dtype; Qwen3.5-MoE:
normed * (1 + weight), rounded once) on torch's CPU ops, and against
float64; one dispatch reading x and the weight once and writing once."""

import pytest
import torch

import mps_ext
from host_names import host_names
import mps_ext_executor as cpu_metal

from transformers.models.lfm2_moe.modeling_lfm2_moe import Lfm2MoeRMSNorm  # noqa: E402
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeRMSNorm  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm  # noqa: E402

# The oracle is transformers' RMSNorm modules on torch's CPU ops, bit for bit;
# scripts/test.sh runs this file again with torch's CPU kernels capped.
pytestmark = pytest.mark.torch_cpu_oracle

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
MODULES = {"qwen3": (Qwen3MoeRMSNorm, "weight"), "lfm2": (Lfm2MoeRMSNorm, "weight"),
           "qwen3_5": (Qwen3_5MoeRMSNorm, "zero_centred")}
DEVICES = ["executor"] + ([pytest.param("mps", marks=pytest.mark.mac)] if mps_ext.is_available() else [])


def module(kind, n, dtype, eps=1e-6, seed=0):
    cls, variant = MODULES[kind]
    m = cls(n, eps=eps)
    with torch.no_grad():  # trained weights: around 1 (weight variant) or around 0 (zero-centred)
        w = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 0.2
        m.weight.copy_(w + (1 if variant == "weight" else 0))
    return m.to(dtype), variant


def sample(shape, dtype, seed=1):
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)


def rms_norm(device, x, w, eps, variant):
    if device == "mps":
        return torch.ops.mps_ext.rms_norm(x.to("mps"), w.to("mps"), eps, variant).cpu()
    return torch.ops.mps_ext.rms_norm(x, w, eps, variant)


def ulps(got, want):
    """Per element, the distance in units of the dtype's last place of `want`."""
    eps = torch.finfo(want.dtype).eps
    scale = torch.maximum(want.double().abs(), torch.tensor(torch.finfo(want.dtype).tiny)).log2().floor().exp2()
    return (got.double() - want.double()).abs() / (scale * eps)


# Rows of one simdgroup (64), of several (300: a barrier between its
# simdgroups), more rows than a team takes (17 x 128), a decode token's
# hidden state (1 x 2048), the longest row (8192), one element.
SHAPES = [(3, 64), (2, 300), (17, 128), (1, 2048), (1, 8192), (5, 1)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", MODULES)
def test_matches_transformers_modules(device, kind, dtype, shape):
    """Each rounding step where the module rounds: bf16 and fp16 outputs
    bit-identical but for the rare element where mean's sum order (a tree
    here, torch's vectorised order on the CPU) moves a rounding boundary,
    then by one unit in the last place; float32 within 4 ulp for the same
    reason (a relative change of the mean by a few ulp moves every
    element of the row)."""
    m, variant = module(kind, shape[-1], dtype)
    x = sample(shape, dtype)
    with torch.no_grad():
        want = m(x)
    with cpu_metal.record() as rec:
        got = rms_norm(device, x, m.weight.detach(), m.variance_epsilon if hasattr(m, "variance_epsilon") else m.eps,
                       variant)
    assert got.dtype == want.dtype and got.shape == want.shape
    d = ulps(got, want)
    if dtype == torch.float32:
        assert float(d.max()) <= 4, float(d.max())
    else:
        assert float(d.max()) <= 1, float(d.max())
        assert float((got != want).double().mean()) <= 0.01
    # The float64 oracle: within the dtype's rounding.
    xd = x.double()
    normed = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6)
    wd = m.weight.detach().double()
    ref = normed * (1 + wd) if variant == "zero_centred" else normed * wd
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(got.double(), ref, rtol=tol, atol=tol)
    if device == "executor":
        (disp,) = rec.dispatches
        assert disp.kernel == "rms_norm_" + {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}[dtype]


def test_every_kernel_is_tested():
    # test_matches_transformers_modules, test_qk_norm_rope_bit_identical_to_transformers,
    # test_qk_norm_rope_append_is_qk_norm_rope_then_kv_append and
    # test_add_rms_norm_is_torchs_add_then_rms_norm run each dtype's kernels.
    assert host_names("norm") == {f"{op}_{t}" for op in ("rms_norm", "add_rms_norm", "qk_norm_rope",
                                                         "qk_norm_rope_append")
                                  for t in ("f32", "f16", "bf16")}


@pytest.mark.parametrize("rows,n,dtype", [(1, 2048, torch.bfloat16), (32, 128, torch.bfloat16),
                                          (4, 1024, torch.float32)])
def test_one_dispatch_reads_once_and_writes_once(rows, n, dtype):
    """x read once, out written once; the weight once per team of threads
    (a team takes up to 8 rows: once for a decode token's hidden state, 4
    times for its 32 query heads); coalesced."""
    x, w = sample((rows, n), dtype), sample((n,), dtype, seed=2)
    with cpu_metal.record(counters=True) as rec:
        torch.ops.mps_ext.rms_norm(x, w, 1e-6, "weight")
    (d,) = rec.dispatches
    teams = -(-rows // 8)
    assert (d.bytes_read[1], d.bytes_read[2]) == (x.nbytes, w.nbytes * teams)  # 3: the constant parameters
    assert d.bytes_written == {0: x.nbytes}
    assert max(d.coalescing.values()) <= 1.1, d.coalescing
    assert d.kernel_info.private_bytes == 0 and d.bank_conflict_cycles == 0 and d.int64_divisions == 0


def test_strided_rows_and_leading_dimensions():
    """Rows of a wider tensor (a view), and a 4-D [batch, tokens, heads,
    head_dim] input as the attention's q and k norms see it."""
    m, _ = module("qwen3", 64, torch.bfloat16)
    w = m.weight.detach()
    wide = sample((5, 100), torch.bfloat16)
    x = wide[:, 10:74]
    with torch.no_grad():
        torch.testing.assert_close(torch.ops.mps_ext.rms_norm(x, w, 1e-6, "weight"), m(x), rtol=0, atol=0.02)
        x4 = sample((2, 3, 4, 64), torch.bfloat16)
        got = torch.ops.mps_ext.rms_norm(x4, w, 1e-6, "weight")
        assert got.shape == x4.shape and got.is_contiguous()
        torch.testing.assert_close(got, m(x4), rtol=0, atol=0.02)
        x4t = x4.transpose(1, 2)  # last dimension contiguous, the others not collapsible: copied first
        torch.testing.assert_close(torch.ops.mps_ext.rms_norm(x4t, w, 1e-6, "weight"), m(x4t), rtol=0, atol=0.02)
    empty = torch.ops.mps_ext.rms_norm(torch.empty(0, 64, dtype=torch.bfloat16), w, 1e-6, "weight")
    assert empty.shape == (0, 64)


def test_special_values():
    """A NaN or inf in a row makes that row NaN (torch: inf^2 / n = inf,
    x * 0 = NaN for the inf, finite / inf = 0 elsewhere: compare with the
    module); a zero row gives zeros (eps keeps the root finite)."""
    m, _ = module("qwen3", 64, torch.float32)
    x = sample((4, 64), torch.float32)
    x[0, 3] = float("nan")
    x[1, 5] = float("inf")
    x[2] = 0
    with torch.no_grad():
        want = m(x)
    got = torch.ops.mps_ext.rms_norm(x, m.weight.detach(), 1e-6, "weight")
    torch.testing.assert_close(got, want, equal_nan=True)


@pytest.mark.parametrize("args,message", [
    ((torch.zeros(2, 8, dtype=torch.float64), torch.zeros(8, dtype=torch.float64), 1e-6, "weight"),
     "x must be float32, float16 or bfloat16, got Double"),
    ((torch.zeros(2, 8), torch.zeros(8, dtype=torch.bfloat16), 1e-6, "weight"),
     r"weight must be 1-D of x's last dimension \(8\) in x's dtype \(Float\), got \[8\] BFloat16"),
    ((torch.zeros(2, 8), torch.zeros(9), 1e-6, "weight"), r"weight must be 1-D of x's last dimension \(8\)"),
    ((torch.zeros(2, 8), torch.zeros(8), 1e-6, "gemma"), "variant must be 'weight' .* or 'zero_centred' .*got 'gemma'"),
    ((torch.zeros(1, 8193), torch.zeros(8193), 1e-6, "weight"), "rows of 1 to 8192 elements are supported .*got 8193"),
    ((torch.zeros(()), torch.zeros(1), 1e-6, "weight"), "a last dimension to normalise, got a 0-d tensor"),
])
def test_bad_input(args, message):
    with pytest.raises(RuntimeError, match=message):
        torch.ops.mps_ext.rms_norm(*args)


def test_meta_kernel_gives_shape_and_dtype():
    x = torch.empty(2, 3, 64, dtype=torch.bfloat16, device="meta")
    out = torch.ops.mps_ext.rms_norm(x, torch.empty(64, dtype=torch.bfloat16, device="meta"), 1e-6, "weight")
    assert out.shape == x.shape and out.dtype == x.dtype and out.device.type == "meta"


# ------------------------------------------------------ qk_norm_rope --
# The attention's q_norm, k_norm and rotary embedding of transformers'
# models, as their forward runs them: norm(q.view(heads)).transpose(1, 2),
# then apply_rotary_pos_emb from the model's own modeling file.
from transformers.models.lfm2_moe.modeling_lfm2_moe import apply_rotary_pos_emb as lfm2_rope  # noqa: E402
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import apply_rotary_pos_emb as qwen3_5_rope  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import apply_rotary_pos_emb as qwen3_rope  # noqa: E402

from mps_ext.passes.norm import FusedRMSNorm, qk_norm_rope  # noqa: E402

ROPE = {"qwen3": qwen3_rope, "lfm2": lfm2_rope, "qwen3_5": qwen3_5_rope}
KERNEL = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


def rotary(batch, tokens, r, dtype, start=1000, base=1e6):
    """cos, sin [batch, tokens, r] as transformers' default rotary
    embedding computes them (float32 angles, cat(freqs, freqs), cast to the
    model's dtype), at positions start + batch row * 7 + token."""
    inv_freq = 1.0 / (base ** (torch.arange(0, r, 2, dtype=torch.float) / r))
    pos = (start + torch.arange(batch)[:, None] * 7 + torch.arange(tokens)[None, :]).float()
    emb = torch.cat([pos[..., None] * inv_freq] * 2, dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def heads(b, t, hq, hk, d, dtype, kind, exact=False, seed=3):
    """q [b, t, hq, d] and k [b, t, hk, d] as the attention views them:
    Qwen3.5's q is the first half of each head of a [.., hq, 2d] projection
    (torch.chunk), the others' q and k are column blocks of one fused q/k/v
    projection output (mps_ext.optimize's fused projection). exact: values
    k/8, |k| <= 64, whose squares sum exactly in float32 in any order."""
    g = torch.Generator().manual_seed(seed)
    if exact:
        draw = lambda *s: (torch.randint(-64, 65, s, generator=g).float() / 8).to(dtype)  # noqa: E731
    else:
        draw = lambda *s: (torch.randn(s, generator=g) * 3).to(dtype)  # noqa: E731
    if kind == "qwen3_5":
        q = torch.chunk(draw(b, t, hq * 2 * d).view(b, t, -1, 2 * d), 2, dim=-1)[0]
        return q, draw(b, t, hk * d).view(b, t, hk, d)
    qkv = draw(b, t, (hq + 2 * hk) * d)
    return qkv[..., :hq * d].view(b, t, hq, d), qkv[..., hq * d:(hq + hk) * d].view(b, t, hk, d)


def reference(kind, q, k, cos, sin, qm, km):
    with torch.no_grad():
        qs = (qm(q) if qm is not None else q).transpose(1, 2)
        ks = (km(k) if km is not None else k).transpose(1, 2)
        return ROPE[kind](qs, ks, cos, sin)


def run_qk(device, q, k, cos, sin, qw, kw, eps, variant):
    if device == "mps":
        mps = lambda t: None if t is None else t.to("mps")  # noqa: E731
        qo, ko = torch.ops.mps_ext.qk_norm_rope(mps(q), mps(k), mps(cos), mps(sin), mps(qw), mps(kw), eps, variant)
        return qo.cpu(), ko.cpu()
    return torch.ops.mps_ext.qk_norm_rope(q, k, cos, sin, qw, kw, eps, variant)


# (batch, tokens, q heads, k heads, head_dim, rotary_dim): decode of each
# model's head shape (heads spread over threadgroups), a prefill (a token's
# heads in one threadgroup, more heads than simdgroups), a partial rotary
# dimension that is no multiple of 64 (lanes without a pair).
QK_SHAPES = {"qwen3": [(1, 1, 8, 2, 128, 128), (2, 20, 9, 3, 64, 64)],
             "lfm2": [(1, 1, 4, 2, 64, 64), (1, 17, 6, 2, 64, 64)],
             "qwen3_5": [(1, 1, 4, 2, 256, 64), (2, 18, 10, 1, 256, 64), (1, 3, 2, 1, 128, 40)]}
QK_CASES = [(kind, s) for kind, shapes in QK_SHAPES.items() for s in shapes]


def qk_modules(kind, d, dtype):
    return module(kind, d, dtype, seed=4)[0], module(kind, d, dtype, seed=5)[0]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind,shape", QK_CASES, ids=[f"{k}-{'x'.join(map(str, s))}" for k, s in QK_CASES])
def test_qk_norm_rope_bit_identical_to_transformers(device, kind, shape, dtype):
    """Where the float32 steps are the model's in its order, the result is
    the model's bit for bit: q and k values whose squares sum exactly (so
    that mean's order cannot matter), each norm rounding where the module
    rounds, the rotary embedding in the model's dtype, each product rounded
    before the sum as torch rounds it."""
    b, t, hq, hk, d, r = shape
    qm, km = qk_modules(kind, d, dtype)
    q, k = heads(b, t, hq, hk, d, dtype, kind, exact=True)
    cos, sin = rotary(b, t, r, dtype)
    want_q, want_k = reference(kind, q, k, cos, sin, qm, km)
    with cpu_metal.record() as rec:
        got_q, got_k = run_qk(device, q, k, cos, sin, qm.weight.detach(), km.weight.detach(), 1e-6, MODULES[kind][1])
    assert got_q.shape == want_q.shape and got_k.shape == want_k.shape and got_q.dtype == dtype
    assert got_q.is_contiguous() and got_k.is_contiguous()  # [B, H, T, D], as attention takes it
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    if device == "executor":
        (disp,) = rec.dispatches
        assert disp.kernel == "qk_norm_rope_" + KERNEL[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind,shape", QK_CASES, ids=[f"{k}-{'x'.join(map(str, s))}" for k, s in QK_CASES])
def test_qk_norm_rope_near_transformers(kind, shape, dtype):
    """Any values: only mean's summation order differs from torch's (as
    rms_norm), so an element differs from the model's by at most a few
    units in the last place of the rotation's terms, and rarely at all in
    half and bfloat16; within the dtype's rounding of a float64 oracle."""
    b, t, hq, hk, d, r = shape
    qm, km = qk_modules(kind, d, dtype)
    q, k = heads(b, t, hq, hk, d, dtype, kind)
    cos, sin = rotary(b, t, r, dtype)
    want = reference(kind, q, k, cos, sin, qm, km)
    got = torch.ops.mps_ext.qk_norm_rope(q, k, cos, sin, qm.weight.detach(), km.weight.detach(), 1e-6,
                                         MODULES[kind][1])
    eps_t = torch.finfo(dtype).eps
    zero_centred = MODULES[kind][1] == "zero_centred"
    c64, s64 = cos.double().unsqueeze(1), sin.double().unsqueeze(1)
    for x, m, g, w in zip((q, k), (qm, km), got, want):
        # The oracle: float64 throughout, from the same rounded inputs.
        xd = x.double().transpose(1, 2)
        wd = m.weight.detach().double()
        y = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * ((1 + wd) if zero_centred else wd)
        y_rot, y_pass = y[..., :r], y[..., r:]
        rot = torch.cat([-y_rot[..., r // 2:], y_rot[..., :r // 2]], dim=-1)
        oracle = torch.cat([y_rot * c64 + rot * s64, y_pass], dim=-1)
        # The terms' size: the rotation's error scale per element.
        scale = torch.cat([y_rot.abs() * c64.abs() + rot.abs() * s64.abs(), y_pass.abs()], dim=-1)
        diff = (g.double() - w.double()).abs()
        ulps_allowed = 8 if dtype == torch.float32 else 3
        assert bool((diff <= ulps_allowed * eps_t * scale).all()), float((diff / (eps_t * scale)).max())
        if dtype != torch.float32:
            assert float((g != w).double().mean()) <= 0.02
        # Rounding of the norm (about 2 ulp) and of three steps of the rotation.
        assert bool(((g.double() - oracle).abs() <= 6 * eps_t * scale + 1e-30).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_qk_rope_without_norms_is_bit_identical(kind, dtype):
    """No norm weights (a model without q and k norms): the rotary embedding
    alone, any values, bit for bit; one norm only, the other tensor as it
    came. A k batch of cos and sin of 1 broadcasts over the batch."""
    b, t, hq, hk, d, r = (2, 3, 4, 2, 128, 32 if kind == "qwen3_5" else 128)
    q, k = heads(b, t, hq, hk, d, dtype, kind)
    cos, sin = rotary(1, t, r, dtype)
    got = torch.ops.mps_ext.qk_norm_rope(q, k, cos, sin, None, None, 1e-6)
    want = ROPE[kind](q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    qm, _ = qk_modules(kind, d, dtype)
    qe, ke = heads(b, t, hq, hk, d, dtype, kind, exact=True)
    got = torch.ops.mps_ext.qk_norm_rope(qe, ke, cos, sin, qm.weight.detach(), None, 1e-6, MODULES[kind][1])
    want = reference(kind, qe, ke, cos, sin, qm, None)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_qk_norm_rope_one_dispatch_reads_once_and_writes_once():
    """A decode token of Qwen3-30B-A3B (32 q heads, 4 k heads of 128): q and
    k read once, both outputs written once, cos, sin and each weight once
    per threadgroup (heads spread over 36 / 8 = 5 threadgroups), coalesced,
    no private stack, no bank conflicts, no 64-bit division."""
    dtype = torch.bfloat16
    # Tensors of their own: the executor counts a buffer's bytes by address.
    q, k = (x.clone() for x in heads(1, 1, 32, 4, 128, dtype, "qwen3"))
    cos, sin = rotary(1, 1, 128, dtype)
    qm, km = qk_modules("qwen3", 128, dtype)
    with cpu_metal.record(counters=True) as rec:
        torch.ops.mps_ext.qk_norm_rope(q, k, cos, sin, qm.weight.detach(), km.weight.detach(), 1e-6)
    (disp,) = rec.dispatches
    groups = 5  # ceil(36 heads / 8 simdgroups): the last group's heads are q's 32 and k's 4
    assert disp.bytes_read[2] == q.nbytes and disp.bytes_read[3] == k.nbytes
    assert disp.bytes_read[4] == cos.nbytes * groups and disp.bytes_read[5] == sin.nbytes * groups
    assert disp.bytes_read[6] == qm.weight.nbytes * 4 and disp.bytes_read[7] == km.weight.nbytes * 1
    assert disp.bytes_written == {0: q.nbytes, 1: k.nbytes}
    assert max(disp.coalescing.values()) <= 1.1, disp.coalescing
    assert disp.kernel_info.private_bytes == 0 and disp.bank_conflict_cycles == 0 and disp.int64_divisions == 0


def test_qk_norm_rope_special_values():
    """A NaN or inf in a head makes that head's row NaN after its norm, as
    the model computes it; other heads are untouched."""
    q, k = heads(1, 2, 3, 1, 64, torch.float32, "qwen3")
    q = q.clone()
    q[0, 0, 1, 3] = float("nan")
    q[0, 1, 2, 5] = float("inf")
    cos, sin = rotary(1, 2, 64, torch.float32)
    qm, km = qk_modules("qwen3", 64, torch.float32)
    want = reference("qwen3", q, k, cos, sin, qm, km)
    got = torch.ops.mps_ext.qk_norm_rope(q, k, cos, sin, qm.weight.detach(), km.weight.detach(), 1e-6)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, equal_nan=True, rtol=1e-5, atol=1e-5)


def _qk_args(**change):
    q, k = torch.zeros(1, 2, 4, 64), torch.zeros(1, 2, 2, 64)
    args = dict(q=q, k=k, cos=torch.zeros(1, 2, 64), sin=torch.zeros(1, 2, 64), q_weight=torch.zeros(64),
                k_weight=torch.zeros(64), eps=1e-6, variant="weight")
    args.update(change)
    return args


@pytest.mark.parametrize("change,message", [
    (dict(q=torch.zeros(1, 2, 4, 64, dtype=torch.float64)), "q must be float32, float16 or bfloat16, got Double"),
    (dict(q=torch.zeros(2, 4, 64)), r"q and k must be 4-D \[batch, tokens, heads, head_dim\]"),
    (dict(k=torch.zeros(1, 2, 2, 32)), r"k must be \[1, 2, heads, 64\]"),
    (dict(cos=torch.zeros(2, 64)), "cos and sin must be 3-D"),
    (dict(sin=torch.zeros(1, 2, 32)), "cos and sin must be 3-D .* of one shape"),
    (dict(cos=torch.zeros(1, 3, 64), sin=torch.zeros(1, 3, 64)), r"must be \[1 or 1, 2, rotary_dim\]"),
    (dict(cos=torch.zeros(1, 2, 33), sin=torch.zeros(1, 2, 33)), "rotary_dim .* must be even and 2 to head_dim "
                                                                  r"\(64\), got 33"),
    (dict(cos=torch.zeros(1, 2, 66), sin=torch.zeros(1, 2, 66)), "must be even and 2 to head_dim \\(64\\), got 66"),
    (dict(q=torch.zeros(1, 2, 4, 320), k=torch.zeros(1, 2, 2, 320), q_weight=torch.zeros(320),
          k_weight=torch.zeros(320)), "head_dim of 2 to 256 is supported .*got 320"),
    (dict(cos=torch.zeros(1, 2, 64, dtype=torch.bfloat16), sin=torch.zeros(1, 2, 64, dtype=torch.bfloat16)),
     "q, k, cos and sin must have one dtype .*got q Float and BFloat16"),
    (dict(k_weight=torch.zeros(32)), r"k_weight must be 1-D of head_dim \(64\) in q's dtype \(Float\).*got \[32\]"),
    (dict(q_weight=torch.zeros(64, dtype=torch.float16)), r"must be 1-D of head_dim \(64\) .*got \[64\] Half"),
    (dict(variant="gemma"), "variant must be 'weight' .* or 'zero_centred' .*got 'gemma'"),
    (dict(q=torch.zeros(1, 2, 4, 256), k=torch.zeros(1, 2, 2, 256), q_weight=torch.zeros(256),
          k_weight=torch.zeros(256), cos=torch.zeros(1, 2, 96), sin=torch.zeros(1, 2, 96)),
     r"a lane holds 8 elements .*multiples of 64 at 256\), got head_dim 256 and rotary_dim 96"),
])
def test_qk_norm_rope_bad_input(change, message):
    with pytest.raises(RuntimeError, match=message):
        torch.ops.mps_ext.qk_norm_rope(**_qk_args(**change))


def test_qk_norm_rope_meta_and_compile():
    """The fake kernel gives [B, H, T, D] of q's dtype; compiled whole
    (aot_eager traces it on fake tensors), the op gives the eager result."""
    meta = {n: (t.to("meta") if isinstance(t, torch.Tensor) else t) for n, t in _qk_args().items()}
    qo, ko = torch.ops.mps_ext.qk_norm_rope(**meta)
    assert qo.shape == (1, 4, 2, 64) and ko.shape == (1, 2, 2, 64) and qo.device.type == "meta"
    q, k = heads(1, 2, 4, 2, 64, torch.float32, "lfm2")
    cos, sin = rotary(1, 2, 64, torch.float32)
    qm, km = qk_modules("lfm2", 64, torch.float32)
    args = (q, k, cos, sin, qm.weight.detach(), km.weight.detach(), 1e-5)
    fn = torch.compile(lambda *a: torch.ops.mps_ext.qk_norm_rope(*a), fullgraph=True, backend="aot_eager")
    for g, w in zip(fn(*args), torch.ops.mps_ext.qk_norm_rope(*args)):
        assert torch.equal(g, w)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_qk_norm_rope_python_function(kind):
    """mps_ext.passes.norm.qk_norm_rope with the attention's pieces: the op
    where the executor was asked for and the norms are FusedRMSNorm (one
    dispatch), torch's ops without it (no dispatch), the model's modules
    left as they are where they are not FusedRMSNorm; the model's values
    each way."""
    dtype, (b, t, hq, hk, d, r) = torch.bfloat16, QK_SHAPES[kind][0]
    qm, km = qk_modules(kind, d, dtype)
    variant = MODULES[kind][1]
    fq, fk = FusedRMSNorm(qm.weight, 1e-6, variant), FusedRMSNorm(km.weight, 1e-6, variant)
    q, k = heads(b, t, hq, hk, d, dtype, kind, exact=True)
    cos, sin = rotary(b, t, r, dtype)
    want = reference(kind, q, k, cos, sin, qm, km)
    with torch.no_grad():
        with cpu_metal.request(), cpu_metal.record() as rec:
            got = qk_norm_rope(q, k, cos, sin, fq, fk)
        assert [d.kernel for d in rec.dispatches] == ["qk_norm_rope_bf16"]
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        with cpu_metal.record() as rec:
            got = qk_norm_rope(q, k, cos, sin, fq, fk)  # CPU tensors without the executor: torch's ops
        assert rec.dispatches == []
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        with cpu_metal.request(), cpu_metal.record() as rec:
            got = qk_norm_rope(q, k, cos, sin, qm, km)  # transformers' own modules: their forward
        assert not any(d.kernel.startswith("qk_norm_rope") for d in rec.dispatches)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_qk_norm_rope_in_a_qwen3_5_attention():
    """The documented integration (docs/optimize.md) on transformers' own
    Qwen3.5-MoE attention and rotary embedding (partial rotary 0.25 of a
    128 head, multimodal-RoPE recomposed cos and sin, q the query half of
    torch.chunk), its norms made FusedRMSNorm by the norm pass: one dispatch,
    the forward's q and k."""
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (Qwen3_5MoeAttention,
                                                                      Qwen3_5MoeTextRotaryEmbedding)

    from mps_ext.passes import NormPass, run_pass

    torch.manual_seed(0)
    cfg = Qwen3_5MoeTextConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                               rms_norm_eps=1e-6)
    attn, rot = Qwen3_5MoeAttention(cfg, layer_idx=3), Qwen3_5MoeTextRotaryEmbedding(cfg)
    with torch.no_grad():
        for norm in (attn.q_norm, attn.k_norm):
            norm.weight.normal_(0, 0.2)
    attn = attn.to(torch.bfloat16)
    hidden = torch.randn(1, 3, 64).to(torch.bfloat16)
    cos, sin = rot(hidden, torch.arange(3)[None] + 500)
    assert cos.shape == (1, 3, 32)  # partial: 32 of 128 rotate
    with torch.no_grad():
        # The forward's lines (Qwen3_5MoeAttention.forward, transformers 5.23).
        input_shape = hidden.shape[:-1]
        hidden_shape = (*input_shape, -1, attn.head_dim)
        q, _gate = torch.chunk(attn.q_proj(hidden).view(*input_shape, -1, attn.head_dim * 2), 2, dim=-1)
        k = attn.k_proj(hidden).view(hidden_shape)
        want = qwen3_5_rope(attn.q_norm(q.view(hidden_shape)).transpose(1, 2),
                            attn.k_norm(k).transpose(1, 2), cos, sin)
        assert sorted(run_pass(NormPass(), attn).converted) == ["k_norm", "q_norm"]
        with cpu_metal.request(), cpu_metal.record() as rec:
            got = qk_norm_rope(q.view(hidden_shape), k, cos, sin, attn.q_norm, attn.k_norm)
    assert [d.kernel for d in rec.dispatches] == ["qk_norm_rope_bf16"]
    for g, w in zip(got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=0.016, atol=0.016)  # bfloat16's last place at 1 to 2
        assert float((g != w).double().mean()) <= 0.02  # mean's sum order: rarely a rounding


# ------------------------------------------------ qk_norm_rope_append --
# qk_norm_rope with the KV cache append in its dispatch: what it replaces is
# qk_norm_rope, then kv_append of its k and of v (the model's
# v_proj(...).view(heads).transpose(1, 2)) into the cache.
# (batch, tokens, q heads, k heads, head_dim, rotary_dim): a decode token of
# each model the census counts (Qwen3-30B-A3B, Qwen3.6-35B-A3B,
# LFM2.5-8B-A1B: their real head counts, heads spread over threadgroups),
# and a prefill of 17 tokens (a token's heads in one threadgroup).
APPEND_CASES = [("qwen3", (1, 1, 32, 4, 128, 128)), ("qwen3_5", (1, 1, 16, 2, 256, 64)),
                ("lfm2", (1, 1, 32, 8, 64, 64)), ("lfm2", (1, 17, 6, 2, 64, 64))]
APPEND_CAPACITY, APPEND_START = 32, 7


def append_inputs(kind, shape, dtype):
    """q, k, v as the attention views them (v: the last block of a fused
    q/k/v projection's columns, strided), cos, sin, the norm weights, and
    caches [b, hk, capacity, d] holding other values (so that a row written
    where it should not be shows)."""
    b, t, hq, hk, d, r = shape
    q, k = heads(b, t, hq, hk, d, dtype, kind)
    v = sample((b, t, 3 * hk * d), dtype, seed=6)[..., hk * d:2 * hk * d].view(b, t, hk, d)
    cos, sin = rotary(b, t, r, dtype)
    qm, km = qk_modules(kind, d, dtype)
    caches = [sample((b, hk, APPEND_CAPACITY, d), dtype, seed=s) for s in (7, 8)]
    return q, k, v, cos, sin, qm.weight.detach(), km.weight.detach(), caches


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind,shape", APPEND_CASES, ids=[f"{k}-{'x'.join(map(str, s))}" for k, s in APPEND_CASES])
def test_qk_norm_rope_append_is_qk_norm_rope_then_kv_append(device, kind, shape, dtype):
    """Any values: q_out and both whole caches bit for bit what qk_norm_rope
    then kv_append (two dispatches) leave, in one dispatch that writes q_out
    and the new k and v rows once, and nothing else of the caches."""
    q, k, v, cos, sin, qw, kw, caches = append_inputs(kind, shape, dtype)
    variant = MODULES[kind][1]
    on = (lambda t: t.to("mps")) if device == "mps" else (lambda t: t)
    want_q, k_rows = torch.ops.mps_ext.qk_norm_rope(*map(on, (q, k, cos, sin, qw, kw)), 1e-6, variant)
    want_kc, want_vc = (on(c.clone()) for c in caches)
    torch.ops.mps_ext.kv_append(want_kc, want_vc, k_rows, on(v).transpose(1, 2), APPEND_START)
    kc, vc = (on(c.clone()) for c in caches)
    with cpu_metal.record(counters=device == "executor") as rec:
        got_q = torch.ops.mps_ext.qk_norm_rope_append(*map(on, (q, k, v, cos, sin, qw, kw)), 1e-6, variant, kc, vc,
                                                       APPEND_START)
    assert got_q.shape == want_q.shape and got_q.is_contiguous()
    assert torch.equal(got_q.cpu(), want_q.cpu())
    assert torch.equal(kc.cpu(), want_kc.cpu()) and torch.equal(vc.cpu(), want_vc.cpu())
    if device == "executor":
        (disp,) = rec.dispatches
        assert disp.kernel == "qk_norm_rope_append_" + KERNEL[dtype]
        assert disp.bytes_written == {0: got_q.nbytes, 1: k.nbytes, 2: v.nbytes}


def test_qk_norm_rope_append_one_dispatch_for_two():
    """A Qwen3-30B-A3B decode token: the fused dispatch moves what the two
    it replaces move but the k rows' round trip through memory (written by
    qk_norm_rope, read by kv_append), coalesced, no private stack, no bank
    conflicts, no 64-bit division."""
    dtype = torch.bfloat16
    q, k, v, cos, sin, qw, kw, caches = append_inputs("qwen3", APPEND_CASES[0][1], dtype)
    # Tensors of their own: the executor counts a buffer's bytes by address.
    q, k, v = (x.clone() for x in (q, k, v))
    with cpu_metal.record(counters=True) as two:
        _, k_rows = torch.ops.mps_ext.qk_norm_rope(q, k, cos, sin, qw, kw, 1e-6)
        torch.ops.mps_ext.kv_append(*(c.clone() for c in caches), k_rows, v.transpose(1, 2), APPEND_START)
    with cpu_metal.record(counters=True) as one:
        torch.ops.mps_ext.qk_norm_rope_append(q, k, v, cos, sin, qw, kw, 1e-6, "weight", *caches, APPEND_START)
    (disp,) = one.dispatches
    assert len(two.dispatches) == 2
    # The tensors' bytes (not the parameter struct, the last buffer, which every thread reads).
    moved = [sum(n for i, n in d.bytes_read.items() if i != max(d.bytes_read)) + sum(d.bytes_written.values())
             for d in (*two.dispatches, disp)]
    # The fused kernel spreads v's rows over threadgroups of their own, which
    # read cos, sin and the weights too: at most those more.
    staged = 2 * cos.nbytes + qw.nbytes + kw.nbytes
    assert moved[0] + moved[1] - 2 * k.nbytes <= moved[2] <= moved[0] + moved[1] - 2 * k.nbytes + staged
    assert max(disp.coalescing.values()) <= 1.1, disp.coalescing
    assert disp.kernel_info.private_bytes == 0 and disp.bank_conflict_cycles == 0 and disp.int64_divisions == 0


def _append_args(**change):
    args = dict(_qk_args(), v=torch.zeros(1, 2, 2, 64), k_cache=torch.zeros(1, 2, 8, 64),
                v_cache=torch.zeros(1, 2, 8, 64), start=3)
    args.update(change)
    return args


@pytest.mark.parametrize("change,message", [
    (dict(v=torch.zeros(1, 2, 3, 64)), r"qk_norm_rope_append: v must be k's shape \[1, 2, 2, 64\]"),
    (dict(v=torch.zeros(1, 2, 2, 64, dtype=torch.float16)), "v must be k's shape .* dtype and device, got .* Half"),
    (dict(start=7), "qk_norm_rope_append: rows 7 to 9 do not fit a cache of capacity 8"),
    (dict(start=-1), "rows -1 to 1 do not fit"),
    (dict(k_cache=torch.zeros(1, 3, 8, 64), v_cache=torch.zeros(1, 3, 8, 64)),
     r"k_cache and v_cache must be contiguous \[1, 2, capacity, 64\] of one shape, got \[1, 3, 8, 64\]"),
    (dict(v_cache=torch.zeros(1, 2, 9, 64)), "of one shape, got .* and \\[1, 2, 9, 64\\]"),
    (dict(k_cache=torch.zeros(1, 2, 64, 8).transpose(2, 3)), r"\(not contiguous\)"),
    (dict(k_cache=torch.zeros(1, 2, 8, 64, dtype=torch.float16)), "k_cache and v_cache must be q's dtype"),
    (dict(q=torch.zeros(2, 4, 64)), r"qk_norm_rope_append: q and k must be 4-D"),
])
def test_qk_norm_rope_append_bad_input(change, message):
    with pytest.raises(RuntimeError, match=message):
        torch.ops.mps_ext.qk_norm_rope_append(**_append_args(**change))


def test_qk_norm_rope_append_meta():
    """The fake kernel gives q_out [B, Hq, T, D] of q's dtype; the caches
    are written in place (the schema's (a!), (b!))."""
    meta = {n: (t.to("meta") if isinstance(t, torch.Tensor) else t) for n, t in _append_args().items()}
    qo = torch.ops.mps_ext.qk_norm_rope_append(**meta)
    assert qo.shape == (1, 4, 2, 64) and qo.device.type == "meta"
    schema = torch.ops.mps_ext.qk_norm_rope_append.default._schema
    assert [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write] == [
        "k_cache", "v_cache"]


# ------------------------------------------------------ add_rms_norm --
# A decoder layer's `h = residual + x; normed = post_attention_layernorm(h)`.
def add_rms_norm(device, x, r, w, eps, variant):
    if device == "mps":
        return tuple(t.cpu() for t in torch.ops.mps_ext.add_rms_norm(x.to("mps"), r.to("mps"), w.to("mps"), eps,
                                                                      variant))
    return torch.ops.mps_ext.add_rms_norm(x, r, w, eps, variant)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES + [(3, 2, 77)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", MODULES)
def test_add_rms_norm_is_torchs_add_then_rms_norm(device, kind, dtype, shape):
    """The sum is torch's CPU add to the bit; the normed rows are
    rms_norm's of that sum to the bit (the same rows, teams and sum order),
    so a layer gives what add then FusedRMSNorm give; and within
    test_matches_transformers_modules' bound of the module itself. One
    dispatch."""
    m, variant = module(kind, shape[-1], dtype)
    w, eps = m.weight.detach(), m.variance_epsilon if hasattr(m, "variance_epsilon") else m.eps
    x, r = sample(shape, dtype), sample(shape, dtype, seed=5) * 20  # a residual stream larger than the update
    with cpu_metal.record() as rec:
        total, normed = add_rms_norm(device, x, r, w, eps, variant)
    want = x + r
    assert total.dtype == normed.dtype == dtype and total.shape == normed.shape == x.shape
    assert torch.equal(total, want)
    assert torch.equal(normed, rms_norm(device, want, w, eps, variant))
    with torch.no_grad():
        module_out = m(want)
    d = ulps(normed, module_out)
    assert float(d.max()) <= (4 if dtype == torch.float32 else 1), float(d.max())
    if device == "executor":
        (disp,) = rec.dispatches
        assert disp.kernel == f"add_rms_norm_{KERNEL[dtype]}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_add_rms_norm_rounds_the_sum_as_torch(dtype):
    """Pairs whose magnitudes differ by 2^0 to 2^30, of either sign (ties,
    cancellations, carries into the next binade, a term below half a unit of
    the other): every sum is torch's add to the bit."""
    g = torch.Generator().manual_seed(9)
    a = torch.randn(16, 512, generator=g)
    b = torch.randn(16, 512, generator=g) * torch.pow(2.0, -torch.randint(0, 31, (16, 512), generator=g).float())
    a, b = a.to(dtype), b.to(dtype)
    total, _ = torch.ops.mps_ext.add_rms_norm(a, b, torch.ones(512, dtype=dtype), 1e-6, "weight")
    assert torch.equal(total, a + b)


def test_add_rms_norm_one_dispatch_reads_once_and_writes_once():
    """x and the residual read once, the sum and the normed rows written
    once, the weight once per team: the two dispatches' traffic less the
    sum's read back."""
    x, r, w = (sample(s, torch.bfloat16, seed=i) for i, s in enumerate([(1, 2048), (1, 2048), (2048,)]))
    with cpu_metal.record(counters=True) as rec:
        torch.ops.mps_ext.add_rms_norm(x, r, w, 1e-6, "weight")
    (d,) = rec.dispatches
    assert (d.bytes_read[2], d.bytes_read[3], d.bytes_read[4]) == (x.nbytes, r.nbytes, w.nbytes)
    assert d.bytes_written == {0: x.nbytes, 1: x.nbytes}
    assert max(d.coalescing.values()) <= 1.1, d.coalescing


def test_add_rms_norm_non_contiguous_inputs():
    """Rows of a wider tensor, a transposed 3-D input and a residual of
    other strides than x: the kernel reads each with its row stride (or a
    contiguous copy); outputs contiguous."""
    m, variant = module("qwen3", 64, torch.bfloat16)
    w = m.weight.detach()
    x = sample((5, 100), torch.bfloat16)[:, 10:74]
    r = sample((5, 64), torch.bfloat16, seed=4)
    r3 = sample((4, 3, 64), torch.bfloat16, seed=6).transpose(0, 1)
    x3 = sample((3, 4, 64), torch.bfloat16, seed=7)
    for a, b in ((x, r), (r, x), (x3, r3), (r3, x3)):
        total, normed = torch.ops.mps_ext.add_rms_norm(a, b, w, 1e-6, variant)
        assert total.is_contiguous() and normed.is_contiguous()
        assert torch.equal(total, a + b)
        assert torch.equal(normed, torch.ops.mps_ext.rms_norm(a + b, w, 1e-6, variant))
    total, normed = torch.ops.mps_ext.add_rms_norm(torch.empty(0, 64, dtype=torch.bfloat16),
                                                   torch.empty(0, 64, dtype=torch.bfloat16), w, 1e-6, variant)
    assert total.shape == normed.shape == (0, 64)


@pytest.mark.parametrize("args,message", [
    ((torch.zeros(2, 8), torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(8), 1e-6, "weight"),
     r"residual must have x's shape \[2, 8\] and dtype Float \(no broadcasting\), got \[2, 8\] BFloat16"),
    ((torch.zeros(2, 8), torch.zeros(1, 8), torch.zeros(8), 1e-6, "weight"),
     r"residual must have x's shape \[2, 8\] .*got \[1, 8\] Float"),
    ((torch.zeros(2, 8), torch.zeros(2, 8), torch.zeros(9), 1e-6, "weight"),
     r"add_rms_norm: weight must be 1-D of x's last dimension \(8\)"),
    ((torch.zeros(2, 8, dtype=torch.float64), torch.zeros(2, 8, dtype=torch.float64),
      torch.zeros(8, dtype=torch.float64), 1e-6, "weight"), "x must be float32, float16 or bfloat16, got Double"),
    ((torch.zeros(2, 8), torch.zeros(2, 8), torch.zeros(8), 1e-6, "gemma"), "variant must be 'weight' .*got 'gemma'"),
    ((torch.zeros(1, 8193), torch.zeros(1, 8193), torch.zeros(8193), 1e-6, "weight"),
     "rows of 1 to 8192 elements are supported .*got 8193"),
])
def test_add_rms_norm_bad_input(args, message):
    with pytest.raises(RuntimeError, match=message):
        torch.ops.mps_ext.add_rms_norm(*args)


def test_add_rms_norm_python_function_and_meta():
    """mps_ext.passes.norm.add_rms_norm: the op where FusedRMSNorm would run
    its own (the executor asked for), torch's add and the module elsewhere
    (plain CPU tensors, autograd, a residual that broadcasts), the same
    values; the meta kernel gives the shapes torch.compile traces with."""
    from mps_ext.passes.norm import add_rms_norm as fused
    norm = FusedRMSNorm(sample((64,), torch.bfloat16, seed=2), 1e-6, "weight")
    x, r = sample((2, 3, 64), torch.bfloat16), sample((2, 3, 64), torch.bfloat16, seed=4)
    with torch.no_grad():
        plain = fused(x, r, norm)  # plain CPU tensors: torch's ops
        with cpu_metal.record() as rec, cpu_metal.request():
            op = fused(x, r, norm)
            fused(x, r[:1], norm)  # broadcasts: torch's add
    assert [d.kernel for d in rec.dispatches] == ["add_rms_norm_bf16", "rms_norm_bf16"]
    assert torch.equal(op[0], plain[0]) and torch.equal(op[0], x + r)
    assert torch.equal(op[1], torch.ops.mps_ext.rms_norm(x + r, norm.weight, 1e-6, "weight"))
    meta = torch.ops.mps_ext.add_rms_norm(x.to("meta"), r.to("meta"), norm.weight.to("meta"), 1e-6, "weight")
    assert all(t.shape == x.shape and t.dtype == x.dtype and t.device.type == "meta" for t in meta)
