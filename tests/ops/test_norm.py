"""torch.ops.mps_ext.rms_norm against transformers' own RMSNorm modules
(Qwen3-MoE and LFM2-MoE: weight * normed in the model's dtype; Qwen3.5-MoE:
normed * (1 + weight), rounded once) on torch's CPU ops, and against
float64; one dispatch reading x and the weight once and writing once."""

import pytest
import torch

import mps_ext
from host_names import host_names
from mps_ext import cpu_metal

import transformers  # the test extra pins it: the modules are the reference
from transformers.models.lfm2_moe.modeling_lfm2_moe import Lfm2MoeRMSNorm  # noqa: E402
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeRMSNorm  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm  # noqa: E402

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
    # test_matches_transformers_modules runs each dtype's kernel.
    assert host_names("norm") == {"rms_norm_f32", "rms_norm_f16", "rms_norm_bf16"}


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
