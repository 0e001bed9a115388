"""Inputs of the decode-step ops that hold a layer's state (Gated DeltaNet's
linear_attention_decode, LFM2's short_conv_decode), shared by their own
tests (tests/ops) and the tests of what happens when a kernel cannot run
(test_fallback.py, test_pipeline_limits.py)."""

import torch


def linear_attention_inputs(batch, k_heads, v_heads, dk, dv, conv_k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)
    conv_dim = 2 * k_heads * dk + v_heads * dv
    return dict(qkv=r(batch, conv_dim), z=r(batch, v_heads * dv), b=r(batch, v_heads), a=r(batch, v_heads),
                conv_state=r(batch, conv_dim, conv_k), recurrent_state=torch.randn(batch, v_heads, dk, dv, generator=g),
                conv_weight=r(conv_dim, conv_k, scale=0.5), A_log=r(v_heads, scale=0.5).abs().log(),
                dt_bias=r(v_heads), norm_weight=(1 + r(dv, scale=0.1).float()).to(dtype))


def linear_attention(d, k_heads, eps=1e-6):
    return torch.ops.mps_ext.linear_attention_decode(d["qkv"], d["z"], d["b"], d["a"], d["conv_state"],
                                                    d["recurrent_state"], d["conv_weight"], d["A_log"],
                                                    d["dt_bias"], d["norm_weight"], k_heads, eps)


def short_conv_inputs(batch, hidden, k, dtype, bias=True, row_extra=0, seed=0):
    """BCx as in_proj gives it ([batch, 1, 3 * hidden], or a view of a wider
    row: `row_extra` more features a row), the state, weight and bias."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)
    rows = r(batch, 1, 3 * hidden + row_extra, scale=2.0)
    return dict(BCx=rows[..., row_extra:], conv_state=r(batch, hidden, k, scale=2.0), weight=r(hidden, k),
                bias=r(hidden) if bias else None)


def short_conv(d):
    return torch.ops.mps_ext.short_conv_decode(d["BCx"], d["conv_state"], d["weight"], d["bias"])
