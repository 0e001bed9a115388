"""Fine-grained FP8 checkpoints from the Hub (DeepSeek-V3 / Qwen3-FP8 format)
loaded with their weights kept in float8_e4m3fn:

    model = mps_ext.load_fp8("Qwen/Qwen3-30B-A3B-FP8", device="mps", dtype=torch.bfloat16)

The format: each quantized nn.Linear weight is float8_e4m3fn with a float32
`weight_scale_inv` beside it, one per 128 x 128 block ([ceil(N/128),
ceil(K/128)]), and weight = fp8 value * weight_scale_inv; config.json says
{"quant_method": "fp8", "weight_block_size": [128, 128], ...}.

transformers' own loader (FineGrainedFP8HfQuantizer) keeps these weights in
fp8 only with CUDA or XPU: anywhere else it sets `dequantize=True` and
expands every weight to bf16 at load. load_fp8 uses the same from_pretrained
machinery (weight renaming, the merge of per-expert tensors into 3-D banks,
sharded files, the Hub cache) through a quantizer registered under its own
method name, which differs from transformers' only in not forcing that
dequantization; then it swaps transformers' CUDA-only FP8 modules for
mps_ext's:

    FP8Linear (transformers)  -> mps_ext.FP8Linear, granularity "block": the
                                 fp8 bytes and the scales as stored (exact)
    FP8Experts (transformers) -> mps_ext.FP8Experts: one fp32 scale per expert
                                 output row, so each row's 128-column blocks
                                 are brought to one scale (see _row_scaled)
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .fp8 import BLOCK, E4M3_MAX, FP8Experts, FP8Linear
from .passes.projections import ProjectionRows

__all__ = ["fine_grained_state_dict", "load_fp8"]

# The name our quantizer is registered under in transformers' registries;
# it never reaches a saved config (load_fp8 puts the checkpoint's back).
QUANT_METHOD = "mps_ext_fp8"
# Memory for the float32 copy of an expert bank while its rows are re-scaled.
_REQUANT_BYTES = 256 << 20
_HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder",
               "trust_remote_code")


def load_fp8(model_id_or_path, device="mps", *, model_class=None, **from_pretrained_kwargs) -> nn.Module:
    """Load a fine-grained FP8 checkpoint (config.json's quantization_config:
    quant_method "fp8", weight_block_size [128, 128] or null (one scale per
    tensor; expert banks must be block-wise)) with transformers' from_pretrained, its quantized Linear weights
    and expert banks kept in float8_e4m3fn as mps_ext.FP8Linear /
    mps_ext.FP8Experts, then move the model to `device`.

    model_class: the transformers class to load with (default
    AutoModelForCausalLM); other keyword arguments go to its
    from_pretrained (dtype, revision, token, trust_remote_code...), except
    device_map and quantization_config: the placement is `device` and the
    quantization the checkpoint's. Activations stay in their dtype (the
    checkpoint's "dynamic" or "static" activation scheme is not applied):
    more accurate than quantizing them, for the same weight traffic.
    output_loading_info=True returns (model, transformers' loading info)."""
    for key in ("device_map", "quantization_config"):
        if key in from_pretrained_kwargs:
            raise ValueError(f"load_fp8 takes no {key!r}: the model is placed on `device` ({device!r}) and "
                             "quantized as its checkpoint says")
    device = torch.device(device)
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError("load_fp8: device 'mps' requested but torch sees no Metal GPU "
                         "(torch.backends.mps.is_available() is False); pass device='cpu' to load on the CPU")
    import transformers

    _register()
    hub = {k: from_pretrained_kwargs[k] for k in _HUB_KWARGS if k in from_pretrained_kwargs}
    config = transformers.AutoConfig.from_pretrained(model_id_or_path, **hub)
    owner = config if getattr(config, "quantization_config", None) else config.get_text_config(decoder=True)
    original = getattr(owner, "quantization_config", None)
    qc = _checked_quantization_config(original, model_id_or_path)
    owner.quantization_config = {**qc, "quant_method": QUANT_METHOD, "dequantize": False}
    cls = model_class or transformers.AutoModelForCausalLM
    want_info = from_pretrained_kwargs.pop("output_loading_info", False)
    model, info = cls.from_pretrained(model_id_or_path, config=config, output_loading_info=True,
                                      **from_pretrained_kwargs)
    _check_scales_loaded(info, model_id_or_path)
    # Saved or printed, the config says what the checkpoint is, not how we loaded it.
    model.config.quantization_config = original
    if owner is not config:
        owner.quantization_config = original
    _swap_modules(model, device)
    model = model.to(device)
    return (model, info) if want_info else model


def _check_scales_loaded(info: dict, where) -> None:
    """transformers only reports (and loads on regardless) a scale with no
    fp8 module to take it, e.g. a quantized router that is not an nn.Linear
    (its fp8 values would be read as weights, unscaled), an fp8 module whose
    scale the file lacks (left uninitialized), and with
    ignore_mismatched_sizes a scale of the wrong shape (re-initialized)."""
    problems = []
    for kind in ("unexpected_keys", "missing_keys", "mismatched_keys"):
        keys = sorted(k if isinstance(k, str) else k[0] for k in info.get(kind, ()))
        bad = [k for k in keys if "scale_inv" in k]
        if bad:
            problems.append(f"{kind.replace('_', ' ')}: {', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''}")
    if problems:
        raise ValueError(f"load_fp8: {where}'s fp8 scales do not match the model's fp8 modules (transformers "
                         f"converts nn.Linear and experts modules only); {'; '.join(problems)}")


def _checked_quantization_config(qc, where) -> dict:
    if qc is None:
        raise ValueError(f"{where} has no quantization_config in its config.json: load_fp8 loads fine-grained "
                         "FP8 checkpoints (quant_method 'fp8'); quantize a bf16 model with mps_ext.quantize_fp8")
    qc = dict(qc) if isinstance(qc, dict) else qc.to_dict()
    method = qc.get("quant_method")
    if method != "fp8":
        raise ValueError(f"load_fp8 loads fine-grained FP8 checkpoints (quant_method 'fp8'); {where} has "
                         f"quant_method {method!r}")
    block = qc.get("weight_block_size")
    if block is not None and list(block) != [BLOCK, BLOCK]:
        raise ValueError(f"load_fp8 takes weight_block_size [{BLOCK}, {BLOCK}] (mps_ext's block-wise fp8 "
                         f"kernels) or null (one scale per tensor); {where} has {list(block)}")
    if qc.get("expert_dtype", "fp8") != "fp8":
        raise ValueError(f"load_fp8 takes float8 expert weights; {where} has expert_dtype {qc['expert_dtype']!r}")
    if qc.get("modules_to_convert"):
        raise ValueError(f"load_fp8 does not take fp8 embeddings (quantization_config.modules_to_convert "
                         f"{qc['modules_to_convert']}) in {where}")
    return qc


_registered = False


def _register() -> None:
    """Register, once, a quantization method that loads fine-grained FP8
    checkpoints as transformers' FP8 modules without dequantizing them
    (transformers' public extension points; nothing of transformers is
    patched)."""
    global _registered
    if _registered:
        return
    from transformers.quantizers.auto import (AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING,
                                              register_quantization_config, register_quantizer)
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer
    from transformers.utils.quantization_config import FineGrainedFP8Config

    class MpsExtFP8Config(FineGrainedFP8Config):
        """transformers' FineGrainedFP8Config under mps_ext's method name."""

    class MpsExtFP8Quantizer(FineGrainedFP8HfQuantizer):
        """FineGrainedFP8HfQuantizer without its environment check: that one
        wants accelerate and a CUDA or XPU device, and otherwise turns on
        dequantization. load_fp8 swaps the modules for mps_ext's after loading.
        The models load_fp8 and quantize_fp8 give hold it as their
        hf_quantizer, so that save_pretrained writes the fine-grained format
        (fine_grained_state_dict) or refuses."""

        def validate_environment(self, *args, **kwargs):
            if self.quantization_config.dequantize or not self.pre_quantized:
                raise ValueError("mps_ext's fp8 method loads fp8 checkpoints as they are (mps_ext.load_fp8)")

        def get_state_dict_and_metadata(self, model):
            return fine_grained_state_dict(model), {}

    if QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(QUANT_METHOD)(MpsExtFP8Config)
    if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(QUANT_METHOD)(MpsExtFP8Quantizer)
    _registered = True


def save_quantizer():
    """The quantizer quantize_fp8 gives a transformers model (as
    model.hf_quantizer): save_pretrained asks it for the state to write."""
    from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING

    _register()
    config = AUTO_QUANTIZATION_CONFIG_MAPPING[QUANT_METHOD](weight_block_size=[BLOCK, BLOCK])
    return AUTO_QUANTIZER_MAPPING[QUANT_METHOD](config, pre_quantized=True)


def _fp8_linears(model: nn.Module, state: dict) -> dict[str, str]:
    """{the state dict's name of each fp8 linear layer: its granularity}:
    each FP8Linear under its own name, and the members of a projection
    optimize fused under theirs (the fused layer's state-dict hook writes
    them so, passes/projections.py), with the scales they save: a fused
    layer of tensor-scaled members repeats their scales over its rows
    ("row") and saves each member's one scale back ("tensor")."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, FP8Linear) and f"{name}.weight_scale" in state:
            out[name] = m.granularity
        elif isinstance(m, ProjectionRows) and isinstance(m.fused, FP8Linear):
            g = m.fused.granularity
            out[name] = "tensor" if g == "row" and state[f"{name}.weight_scale"].numel() == 1 else g
    return out


def fine_grained_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """`model`'s state dict in transformers' fine-grained FP8 format, for
    save_pretrained, and its config's quantization_config set to say so: each
    FP8Linear's `weight` (float8_e4m3fn) and `weight_scale` renamed
    `weight_scale_inv` (both multiply: the bytes and scales unchanged, so the
    checkpoint reloads to the same logits), weight_block_size [128, 128] for
    granularity "block" or null for "tensor", and every nn.Linear or experts
    module left unconverted in modules_to_not_convert (transformers would
    otherwise expect fp8 weights for it). A model with nothing in fp8 is
    saved as it is.

    ValueError for what the format cannot hold without rounding the weights
    again (nothing is written): FP8Linear's granularity "row" (one scale per
    output row; the format has one per 128 x 128 block or per tensor), mixed
    granularities (one weight_block_size per checkpoint), 128 x 128 blocks
    at a weight's ragged edge (transformers' de-quantizing loader refuses
    them), and FP8Experts
    (one scale per expert output row, what the grouped kernels take)."""
    fp8 = {n: m for n, m in model.named_modules() if isinstance(m, (FP8Linear, FP8Experts))}
    state = model.state_dict()
    if not fp8:
        return state
    experts = [n for n, m in fp8.items() if isinstance(m, FP8Experts)]
    if experts:
        raise ValueError(f"save_pretrained: {_names(experts)} are FP8Experts, which hold one scale per expert "
                         f"output row (what mps_ext's grouped fp8 kernels take); transformers' fine-grained FP8 "
                         f"format has one per 128 x 128 block, and converting would round the weights again. "
                         f"Save the model before quantize_fp8 (or quantize it with a filter that leaves the "
                         f"experts) and quantize after loading")
    linears = _fp8_linears(model, state)
    by_granularity: dict[str, list[str]] = {}
    for name, granularity in linears.items():
        by_granularity.setdefault(granularity, []).append(name)
    if "row" in by_granularity:
        raise ValueError(f"save_pretrained: {_names(by_granularity['row'])} hold one fp8 scale per output row "
                         f"(quantize_fp8's granularity 'row', its default); transformers' fine-grained FP8 format "
                         f"has one per 128 x 128 block or one per tensor, and converting would round the weights "
                         f"again. Quantize with quantize_fp8(model, granularity='block') (or 'tensor') to save")
    if len(by_granularity) > 1:
        raise ValueError(f"save_pretrained: the model mixes fp8 granularities {sorted(by_granularity)}; a "
                         f"fine-grained FP8 checkpoint has one weight_block_size for every weight")
    ragged = [n for n in by_granularity.get("block", ())
              if model.get_submodule(n).in_features % BLOCK or model.get_submodule(n).out_features % BLOCK]
    if ragged:
        # transformers' loader (its Fp8Dequantize, used wherever there is no
        # CUDA) takes the block size from the scale grid and wants it to
        # divide the weight; load_fp8 would read them, transformers not.
        raise ValueError(f"save_pretrained: {_names(ragged)} have a dimension that is not a multiple of {BLOCK}, "
                         f"so their 128 x 128 blocks are ragged, which transformers' own loader refuses to "
                         f"de-quantize; quantize with quantize_fp8(model, granularity='tensor') to save them")
    for name in linears:
        state[f"{name}.weight_scale_inv"] = state.pop(f"{name}.weight_scale")
    unconverted = [n for n, m in model.named_modules()
                   if n and (type(m) is nn.Linear or (isinstance(m, ProjectionRows) and type(m.fused) is nn.Linear)
                             or (n.endswith(".experts") and not isinstance(m, FP8Experts)))
                   and f"{n}.weight" in state]
    model.config.quantization_config = {
        "quant_method": "fp8", "activation_scheme": "dynamic",
        "weight_block_size": [BLOCK, BLOCK] if "block" in by_granularity else None,
        "modules_to_not_convert": unconverted}
    return state


def _names(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _swap_modules(model: nn.Module, device: torch.device) -> None:
    from transformers.integrations import finegrained_fp8 as hf

    for name, mod in list(model.named_modules()):
        if isinstance(mod, getattr(hf, "FP8GroupedLinear", ())):
            raise ValueError(f"{name}: block-diagonal grouped FP8 linears ({type(mod).__name__}) are not "
                             "supported by load_fp8")
        if isinstance(mod, hf.FP8Linear):
            new = _linear(name, mod, device)
        elif isinstance(mod, hf.FP8Experts):
            new = _experts(name, mod, device)
        else:
            continue
        model.set_submodule(name, new)


def _scales_fp32(scale: torch.Tensor) -> torch.Tensor:
    if scale.dtype == torch.uint8:  # e8m0 exponents stored as bytes
        return (scale.float() - 127.0).exp2()
    return scale.float()


def _linear(name: str, mod: nn.Module, device: torch.device) -> FP8Linear:
    if mod.weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name}: weight is {mod.weight.dtype}; load_fp8 takes float8_e4m3fn weights")
    n, k = mod.weight.shape
    granularity = "tensor" if mod.block_size is None else "block"
    scale = _scales_fp32(mod.weight_scale_inv.detach())
    bias = mod.bias
    new = FP8Linear(k, n, bias is not None, granularity, device=device,
                    dtype=bias.dtype if bias is not None else torch.bfloat16)
    # transformers' weight_scale_inv multiplies the fp8 value to dequantize
    # (integrations/finegrained_fp8.py, _dequantize_fp8_weight), as
    # FP8Linear's weight_scale does: the bytes and scales move unchanged.
    new.weight.copy_(mod.weight.detach())
    new.weight_scale.copy_(scale.reshape(new.weight_scale.shape))
    if bias is not None:
        new.bias.data.copy_(bias.detach())
    return new


def _experts(name: str, mod: nn.Module, device: torch.device) -> FP8Experts:
    why = _experts_unsupported(mod)
    if why:
        raise ValueError(f"{name}: mps_ext.FP8Experts runs SiLU-gated experts with [gate; up] banks and no "
                         f"bias; this module has {why}")
    e, two_i, h = mod.gate_up_proj.shape
    i = two_i // 2
    new = FP8Experts(e, h, i, device=device)
    # A fused [gate; up] bank's scale rows: transformers concatenates the two
    # checkpoint tensors' scales, so the up half's blocks start at row I, not
    # at a multiple of 128 when I is not one.
    halves = mod.gate_up_proj_scale_inv.shape[-2] == 2 * math.ceil(i / BLOCK)
    for target, bank, scale, rows_in in (
            ("gate_up", mod.gate_up_proj, mod.gate_up_proj_scale_inv, (i, i) if halves else (two_i,)),
            ("down", mod.down_proj, mod.down_proj_scale_inv, (h,))):
        # Scales to fp32 before moving: MPS before torch 2.15 has no e8m0.
        q, s = _row_scaled(bank.detach().to(device), _scales_fp32(scale.detach()).to(device), rows_in)
        getattr(new, target + "_proj").copy_(q)
        getattr(new, target + "_scale").copy_(s)
    return new


def _experts_unsupported(mod: nn.Module) -> str | None:
    if not getattr(mod, "has_gate", True):
        return "no gate (up_proj only)"
    if getattr(mod, "has_bias", False):
        return "biases"
    if getattr(mod, "is_transposed", False) or not getattr(mod, "is_concatenated", True):
        return "a transposed or interleaved gate/up layout"
    for attr in ("swiglu_alpha", "limit", "gate_softcap", "up_softcap"):
        if getattr(mod, attr, None) is not None:
            return f"a clamped or soft-capped gate ({attr}={getattr(mod, attr)})"
    if mod.gate_up_proj.dtype != torch.float8_e4m3fn:
        return f"{mod.gate_up_proj.dtype} weights"
    if mod.block_size is None:
        return "one scale per tensor (load_fp8 takes block-wise expert scales)"
    # By value: transformers' activations are its own classes (SiLUActivation).
    probe = torch.linspace(-8, 8, 33)
    try:
        same = torch.allclose(mod.act_fn(probe), nn.functional.silu(probe), rtol=1e-5, atol=1e-6)
    except Exception:
        same = False
    return None if same else f"activation {mod.act_fn!r}, not SiLU"


def _row_scaled(bank: torch.Tensor, scale: torch.Tensor,
                rows_in: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp8 bank [E, N, K] with a scale per 128 x 128 block as e4m3 with
    one fp32 scale per row [E, N]. rows_in: the lengths of the row ranges
    whose blocks were scaled apart (both halves of a fused [gate; up] bank),
    summing to N; scale: [E, sum(ceil(length/128)), ceil(K/128)].

    A row takes the largest scale among its column blocks that hold a
    non-zero value: the values of that block keep their exact fp8 bytes, the
    others are rounded once more to e4m3, multiplied by that block's scale
    over the row's (<= 1: no overflow; e4m3 keeps its relative precision down
    to 2^-6, so only values more than 2^14.8 below 448 lose bits). All-zero
    blocks are ignored: writers give them scale 1."""
    e, n, k = bank.shape
    dev = bank.device
    parts, start = [], 0
    for length in rows_in:
        parts.append(start + torch.arange(length, device=dev) // BLOCK)
        start += math.ceil(length / BLOCK)
    row_block = torch.cat(parts)
    kb = math.ceil(k / BLOCK)
    if scale.dim() != 3 or tuple(scale.shape) != (e, start, kb):
        raise ValueError(f"expert scales {tuple(scale.shape)} do not match a bank of {tuple(bank.shape)} "
                         f"(expected [{e}, {start}, {kb}])")
    col_block = torch.arange(k, device=dev) // BLOCK
    q_out = torch.empty_like(bank)
    s_out = torch.empty(e, n, dtype=torch.float32, device=dev)
    chunk = max(1, _REQUANT_BYTES // max(1, n * k * 4))
    for lo in range(0, e, chunk):
        hi = min(e, lo + chunk)
        q = bank[lo:hi].float()
        s = scale[lo:hi][:, row_block]                                        # [c, N, KB]
        # A row's largest |q| in each of its column blocks.
        seg = nn.functional.pad(q.abs(), (0, kb * BLOCK - k)).view(hi - lo, n, kb, BLOCK).amax(-1)
        row_scale = torch.where(seg > 0, s, torch.zeros_like(s)).amax(-1)   # [c, N]
        row_scale = torch.where(row_scale > 0, row_scale, torch.ones_like(row_scale))
        ratio = (s / row_scale[..., None])[..., col_block]                   # [c, N, K]
        q_out[lo:hi] = (q * ratio).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        s_out[lo:hi] = row_scale
    return q_out, s_out
