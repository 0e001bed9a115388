"""What the README says about torchao's float8 configs on a Mac, checked
under the pinned torchao: the dynamic-activation config refuses a machine
without CUDA (sm 8.9+), ROCm MI300+ or XPU in torchao's own hardware check;
the weight-only config has no such check, and the only things it does to
float8 tensors are conversions and views, which mps_ext's fp8 family gives
MPS tensors on torch 2.9-2.14."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import torchao.quantization as torchao_quant

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
# Conversions (copy_ underneath on MPS) and views (no kernel).
CONVERSIONS_AND_VIEWS = {"aten._to_copy.default", "aten.t.default", "aten.view.default", "aten.detach.default",
                         "aten.transpose.int", "aten.alias.default", "aten.clone.default"}


def no_cuda():
    return not torch.cuda.is_available() and not torch.xpu.is_available()


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Linear(48, 32)).bfloat16()


@pytest.mark.skipif(not no_cuda(), reason="shows the behaviour without CUDA or XPU (a Mac)")
@pytest.mark.parametrize("granularity", ["tensor", "row", "block"])
def test_dynamic_activation_config_refuses_a_machine_without_cuda(granularity):
    from torchao.quantization import PerBlock, PerRow, PerTensor
    g = {"tensor": PerTensor(), "row": PerRow(), "block": [PerBlock([1, 128]), PerBlock([128, 128])]}[granularity]
    config = torchao_quant.Float8DynamicActivationFloat8WeightConfig(granularity=g)
    with pytest.raises(AssertionError, match="CUDA compute capability"):
        torchao_quant.quantize_(model(), config)


class Float8Ops(TorchDispatchMode):
    """The aten ops that take or give a float8 tensor."""

    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(isinstance(t, torch.Tensor) and t.dtype in FP8 for t in tree_leaves((args, kwargs, out))):
            self.ops.add(str(func))
        return out


def test_weight_only_config_runs_with_conversions_only():
    m = model()
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    with torch.no_grad(), Float8Ops() as seen:
        torchao_quant.quantize_(m, torchao_quant.Float8WeightOnlyConfig())
        y = m(x)
    assert seen.ops and seen.ops <= CONVERSIONS_AND_VIEWS, seen.ops
    # Its product: x @ (fp8 * scale).T in bf16, the weight de-quantised in memory.
    h = x
    for lin in m:
        w = lin.weight
        assert w.qdata.dtype == torch.float8_e4m3fn
        h = h @ (w.qdata.float() * w.scale.float()).bfloat16().t() + lin.bias
    torch.testing.assert_close(y, h, rtol=1.6e-2, atol=1e-3)
