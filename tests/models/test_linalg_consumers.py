"""Code that uses mps_ext's linear algebra the way its users write it:
MVDR beamforming weights (complex64 solves against a Hermitian spatial
covariance, one per frequency bin), camera geometry (batched 3x3 inverses,
solves and determinants of homographies and intrinsics), and
torch.distributions.MultivariateNormal (its log_prob solves with the
Cholesky factor), against stock torch and float64/complex128."""

import torch

from mps_ext_executor import run_model
from model_compare import RELEASE


def mvdr(x, d):
    """Per frequency bin f: R = X X^H / T + loading, w = R^-1 d / (d^H R^-1 d)."""
    t = x.shape[-1]
    r = x @ x.mH / t
    r = r + 1e-3 * torch.eye(r.shape[-1], dtype=r.dtype) * r.diagonal(dim1=-2, dim2=-1).real.mean(-1)[..., None, None]
    rd = torch.linalg.solve(r, d.unsqueeze(-1)).squeeze(-1)
    return rd / (d.conj() * rd).sum(-1, keepdim=True)


def test_mvdr_beamforming_weights_in_complex64(figures):
    g = torch.Generator().manual_seed(0)
    bins, mics, frames = 257, 6, 24  # a 512-point STFT, a 6-microphone array
    x = torch.randn(bins, mics, frames, dtype=torch.complex64, generator=g)
    d = torch.exp(1j * torch.rand(bins, mics, generator=g) * 6.28).to(torch.complex64)
    ref = mvdr(x.to(torch.complex128), d.to(torch.complex128))
    stock = mvdr(x, d)
    with run_model(RELEASE) as report:
        ours = mvdr(x, d)
    figures.ran(report, {"linalg"})
    assert report.families["linalg"].ops["aten::_linalg_solve_ex"].ran == 1
    figures.no_worse("weights", ours, stock, ref, torch.complex64)


def geometry(h, k, pts):
    """What a vision pipeline does per image: invert a homography, map
    pixels to normalised camera coordinates with K^-1 (as a solve), and
    check orientation with the determinant."""
    h_inv = torch.linalg.inv(h)
    warped = h_inv @ pts
    rays = torch.linalg.solve(k, pts)
    return h_inv, warped[:, :2] / warped[:, 2:], rays, torch.linalg.det(h)


def test_batched_3x3_homographies_and_intrinsics(figures):
    g = torch.Generator().manual_seed(0)
    batch = 1024
    h = torch.eye(3) + 0.1 * torch.randn(batch, 3, 3, generator=g)
    f = 500 + 100 * torch.rand(batch, generator=g)
    k = torch.zeros(batch, 3, 3)
    k[:, 0, 0], k[:, 1, 1], k[:, 2, 2] = f, f, 1
    k[:, 0, 2], k[:, 1, 2] = 320, 240
    pts = torch.cat([torch.rand(batch, 2, 8, generator=g) * 640, torch.ones(batch, 1, 8)], 1)
    ref = geometry(h.double(), k.double(), pts.double())
    stock = geometry(h, k, pts)
    with run_model(RELEASE) as report:
        ours = geometry(h, k, pts)
    figures.ran(report, {"linalg"})
    ops = report.families["linalg"].ops
    assert {op: o.ran for op, o in ops.items()} == {
        "aten::linalg_inv_ex": 1, "aten::_linalg_solve_ex": 1, "aten::_linalg_det": 1}
    for what, i in (("inverse", 0), ("warped", 1), ("rays", 2), ("det", 3)):
        figures.no_worse(what, ours[i], stock[i], ref[i], torch.float32)


def mvn(loc, cov, x, seed):
    dist = torch.distributions.MultivariateNormal(loc, covariance_matrix=cov)
    torch.manual_seed(seed)
    return dist.log_prob(x), dist.rsample((4,))


def mvn_reference(loc, cov, x, seed):
    """mvn in float64 with the float32 run's normal draws (a float64
    generator draws other numbers): loc + L eps, L the Cholesky factor."""
    log_prob = torch.distributions.MultivariateNormal(loc.double(), covariance_matrix=cov.double()).log_prob(x.double())
    torch.manual_seed(seed)
    eps = torch.distributions.utils._standard_normal((4, *loc.shape), dtype=loc.dtype, device=loc.device)
    scale_tril = torch.linalg.cholesky(cov.double())
    return log_prob, loc.double() + (scale_tril @ eps.double().unsqueeze(-1)).squeeze(-1)


def test_multivariate_normal_log_prob_and_rsample(figures):
    g = torch.Generator().manual_seed(0)
    batch, dim = 64, 12
    a = torch.randn(batch, dim, dim, generator=g)
    cov = a @ a.mT / dim + 0.1 * torch.eye(dim)
    loc, x = torch.randn(batch, dim, generator=g), torch.randn(batch, dim, generator=g)
    ref = mvn_reference(loc, cov, x, seed=1)
    stock = mvn(loc, cov, x, seed=1)
    with run_model(RELEASE) as report:
        ours = mvn(loc, cov, x, seed=1)
    figures.ran(report, {"linalg"})
    assert report.families["linalg"].ops["aten::linalg_solve_triangular"].ran >= 1
    figures.no_worse("log_prob", ours[0], stock[0], ref[0], torch.float32)
    figures.no_worse("rsample", ours[1], stock[1], ref[1], torch.float32)
