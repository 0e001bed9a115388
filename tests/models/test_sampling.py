"""The last step of every generated token and of every training step over a
real vocabulary (Qwen3's 151,936; Llama 3's 128,256): softmax of long rows
and sampling from it, and the cross-entropy loss with its backward."""

import pytest
import torch
import torch.nn.functional as F

from mps_ext_executor import run_model
from model_compare import RELEASE


def sample(logits, temperature, seed):
    """transformers' sampling step: temperature, softmax in fp32, one
    multinomial draw per row from a seeded generator."""
    probs = torch.softmax(logits.float() / temperature, -1)
    return probs, torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_sampling_over_a_151936_token_vocabulary(figures, dtype):
    logits = (torch.randn(4, 151936, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    ref = torch.softmax(logits.double() / 0.7, -1)
    stock, stock_draws = sample(logits, 0.7, seed=1)
    with run_model(RELEASE) as report:
        ours, ours_draws = sample(logits, 0.7, seed=1)
    figures.ran(report, {"softmax"})
    assert report.families["softmax"].ops["aten::_softmax"].ran == 1
    figures.no_worse("probabilities", ours, stock, ref, torch.float32)
    # The same generator draws the same tokens: a draw can only move where a
    # uniform lands within the probabilities' rounding difference (~1e-7) of
    # a boundary of the cumulative sum, and the run is deterministic.
    assert torch.equal(ours_draws, stock_draws)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cross_entropy_and_its_backward_over_a_128256_token_vocabulary(figures, dtype):
    g = torch.Generator().manual_seed(0)
    logits, target = torch.randn(4, 128256, generator=g) * 2, torch.randint(0, 128256, (4,), generator=g)

    def loss_and_grad(x):
        x = x.detach().requires_grad_()
        loss = F.cross_entropy(x, target)
        loss.backward()
        return loss.detach(), x.grad

    ref = loss_and_grad(logits.double())
    stock = loss_and_grad(logits.to(dtype))
    with run_model(RELEASE) as report:
        ours = loss_and_grad(logits.to(dtype))
    figures.ran(report, {"softmax"})
    ops = report.families["softmax"].ops
    assert ops["aten::_log_softmax"].ran == 1 and ops["aten::_log_softmax_backward_data"].ran == 1
    figures.no_worse("loss", ours[0], stock[0], ref[0], dtype)
    figures.no_worse("grad", ours[1], stock[1], ref[1], dtype)
