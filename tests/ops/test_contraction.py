"""Bit-exact claims that must not rest on a compiler's choice: Metal's Safe
math mode may contract `a * b + c` within a statement into one fma (the
executor does, as a Mac's compiler may) or leave it a rounded product and a
rounded sum. So each family whose tests claim bits has its bit-exact tests
run here with the executor's contraction off
(`cpu_metal.math_mode(contract=False)`); with it on they run in their own
files. A kernel whose multiply-add rounding a claim states writes fma()
(one rounding) or two statements (two roundings); moe_combine and
moe_down_combine, which left `acc += w * y` to contraction, failed here.

Families with a bit-exact claim and a multiply-add the executor contracts
(the contracted statements: docs/dev/contributing.md, "Math mode"): the MoE
combine (moe_combine, moe_down_combine, against rounding.fma32). Families
with a bit-exact claim whose arithmetic is written out already (no
contracted statement; here so that they stay so): rms_norm and
add_rms_norm, qk_norm_rope, short_conv_decode (fma()), sigmoid_gate,
LU's pivots. Small shapes of the tests in their own files."""

import functools

import pytest
import torch

import mps_ext_executor as cpu_metal

import test_attention_gate
import test_linalg
import test_moe_layer
import test_norm
import test_short_conv

E = "executor"


def LU_CALL(name, *args):  # test_linalg's `call` fixture on the executor
    return getattr(torch.ops.mps_ext, name)(*args)

CASES = {
    **{f"moe_down_combine-{k}-inter{i}": functools.partial(test_moe_layer.test_down_combine_kernels, E, k, i)
       for k in test_moe_layer.KINDS for i in test_moe_layer.INTERS},
    "moe_layer-residual-bf16": functools.partial(test_moe_layer.test_residual_is_added_in_the_last_dispatch,
                                                 E, 4, 16, 4, 1, torch.bfloat16),
    "moe_layer-sigmoid-scoring": functools.partial(test_moe_layer.test_sigmoid_scoring, E, True, True),
    **{f"add_rms_norm-{d}": functools.partial(test_norm.test_add_rms_norm_rounds_the_sum_as_torch, d)
       for d in test_norm.DTYPES},
    **{f"add_rms_norm-{kind}-{d}": functools.partial(test_norm.test_add_rms_norm_is_torchs_add_then_rms_norm, E,
                                                      kind, d, (2, 300))
       for kind in test_norm.MODULES for d in (torch.float32, torch.bfloat16)},
    **{f"qk_norm_rope-{kind}-{d}": functools.partial(test_norm.test_qk_norm_rope_bit_identical_to_transformers, E,
                                                      kind, test_norm.QK_SHAPES[kind][0], d)
       for kind in test_norm.QK_SHAPES for d in (torch.float32, torch.bfloat16)},
    **{f"short_conv-{d}": functools.partial(test_short_conv.test_matches_transformers_torch_code_bit_for_bit,
                                            (2, 200, 3), d, True)
       for d in (torch.float32, torch.float16, torch.bfloat16)},
    **{f"sigmoid_gate-{d}": functools.partial(test_attention_gate.test_sigmoid_gate_is_the_models_line, E, d,
                                              (1, 1, 4, 16))
       for d in (torch.float16, torch.bfloat16)},
    **{f"lu_pivots-{d}": functools.partial(test_linalg.test_ties_take_the_first_row, LU_CALL, d, 6)
       for d in test_linalg.DTYPES},
    "lu_pivots-complex": functools.partial(test_linalg.test_complex_pivots_compare_re_plus_im_not_the_modulus,
                                           LU_CALL, 5),
}


@pytest.mark.parametrize("case", CASES)
def test_bits_without_contraction(case):
    with cpu_metal.math_mode(contract=False):
        CASES[case]()
