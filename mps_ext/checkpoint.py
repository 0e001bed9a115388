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

load_fp8 also takes a bf16 / fp16 / fp32 safetensors checkpoint (no
quantization_config) and quantizes it as it reads it, never holding the
bf16 model:

    model = mps_ext.load_fp8("Qwen/Qwen3-30B-A3B", device="mps", granularity="row")

again through from_pretrained, with a second quantizer of ours
(QUANTIZE_METHOD) in transformers' on-the-fly quantization hooks: the model
is built on the meta device, quantize_fp8's own choice of modules (fp8._plan)
is made on that skeleton and those modules are replaced by empty FP8Linear /
FP8Experts, and transformers reads the checkpoint one parameter at a time
(its renamings and WeightConverters: per-expert tensors merged into the
gate_up_proj / down_proj banks as for any load), each weight of a converted
module handed to our quantize op as it is read, quantized by the code
quantize_fp8 uses, and let go. The result is quantize_fp8(from_pretrained(
path, ...), granularity, filter), bit for bit.
"""

from __future__ import annotations

import math
import os

import torch
from torch import nn

from . import fp8
from .fp8 import BLOCK, E4M3_MAX, FP8Experts, FP8Linear
from .passes.projections import ProjectionRows

__all__ = ["fine_grained_state_dict", "load_fp8"]

# The name our quantizer is registered under in transformers' registries;
# it never reaches a saved config (load_fp8 puts the checkpoint's back).
QUANT_METHOD = "mps_ext_fp8"
# The method of our on-the-fly quantizer (load_fp8 of a bf16 checkpoint);
# the loaded model's config does not keep it either.
QUANTIZE_METHOD = "mps_ext_fp8_quantize"
# Checkpoint tensor dtypes (safetensors' names) load_fp8 quantizes or copies.
_FLOAT_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}
# Memory for the float32 copy of an expert bank while its rows are re-scaled.
_REQUANT_BYTES = 256 << 20
_HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder",
               "trust_remote_code")


def load_fp8(model_id_or_path, device="mps", *, model_class=None, granularity: str | None = None,
             filter=None, lm_head: bool = False, **from_pretrained_kwargs) -> nn.Module:
    """Load a bf16 / fp16 / fp32 safetensors checkpoint (no
    quantization_config) quantized to fp8 as it is read, shard by shard and
    tensor by tensor (the peak is about the fp8 model plus one converted
    parameter's bf16 tensors, never the bf16 model): the model
    quantize_fp8(from_pretrained(model_id_or_path, **from_pretrained_kwargs),
    granularity, filter, lm_head) is, bit for bit (granularity default "row";
    filter and lm_head as quantize_fp8's), with its fp8_summary; then moved
    to `device`.

    Or load a fine-grained FP8 checkpoint (config.json's quantization_config:
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
    cls = model_class or transformers.AutoModelForCausalLM
    want_info = from_pretrained_kwargs.pop("output_loading_info", False)
    if original is None:
        model, info = _load_quantizing(model_id_or_path, cls, config, granularity or "row", filter, lm_head, hub,
                                       from_pretrained_kwargs)
        model = model.to(device)
        return (model, info) if want_info else model
    if granularity is not None or filter is not None or lm_head:
        raise ValueError(f"load_fp8: {model_id_or_path} is an fp8 checkpoint, loaded as it was quantized; "
                         f"granularity, filter and lm_head choose how a bf16 checkpoint is quantized")
    qc = _checked_quantization_config(original, model_id_or_path)
    owner.quantization_config = {**qc, "quant_method": QUANT_METHOD, "dequantize": False}
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


def _load_quantizing(where, cls, config, granularity: str, filter, lm_head: bool, hub: dict, kwargs: dict):
    """(model, loading info) of a bf16 / fp16 / fp32 checkpoint quantized
    as it is read (load_fp8's first case): from_pretrained with our
    on-the-fly quantizer (_register) and the checkpoint as a state dict of
    lazy tensors (_LazyTensor, each read when transformers wants it), the model
    then left as quantize_fp8 leaves one (no quantization_config;
    fp8_summary; the save format)."""
    if granularity not in fp8.GRANULARITIES:
        raise ValueError(f"granularity must be one of {fp8.GRANULARITIES}, got {granularity!r}")
    from transformers import GenerationConfig
    from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING

    if hasattr(cls, "_model_mapping"):  # an Auto class: from_pretrained(None, ...) needs the model's own
        from transformers.models.auto.auto_factory import _get_model_class

        if type(config) not in cls._model_mapping:
            raise ValueError(f"load_fp8: {where}'s config ({type(config).__name__}) has no class in "
                             f"{cls.__name__}; pass model_class, the model's class")
        cls = _get_model_class(config, cls._model_mapping)
    state = _lazy_state_dict(where, hub)
    _register()
    qc = AUTO_QUANTIZATION_CONFIG_MAPPING[QUANTIZE_METHOD](granularity=granularity, filter=filter, lm_head=lm_head)
    # from_pretrained(path) opens every shard for the whole load (safetensors maps each file, memory
    # torch counts); given a state dict it reads the tensors from it, so the path goes no further, and
    # what from_pretrained(path) also reads from it, the generation config, is read here.
    try:
        generation = GenerationConfig.from_pretrained(where, **hub)
    except OSError:
        generation = None
    try:
        model, info = cls.from_pretrained(None, config=config, state_dict=state, quantization_config=qc,
                                          generation_config=generation, output_loading_info=True,
                                          **{k: v for k, v in kwargs.items() if k not in _HUB_KWARGS})
    except RuntimeError as e:  # transformers reports an error of our quantize op as its own, with a traceback
        if qc.error is not None:
            raise qc.error from e
        raise
    model.config.name_or_path = str(where)
    quantizer = model.hf_quantizer
    missing = sorted(info.get("missing_keys", ()))
    if missing:
        raise ValueError(f"load_fp8: {where} lacks {len(missing)} tensor(s) the model needs: "
                         f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")
    # As quantize_fp8 leaves a model: no quantization_config, our save format, the summary.
    quantizer.remove_quantization_config(model)
    del model.is_quantized  # (remove_quantization_config sets it False; a model quantize_fp8 converts has none)
    for module in model.modules():  # what transformers' postprocess_model set on each model's config
        if "_is_quantized" in getattr(getattr(module, "config", None), "__dict__", {}):
            del module.config._is_quantized
    model.hf_quantizer = None
    fp8._finish(model, quantizer.plan, quantizer.bytes_before, stacklevel=3, head_error=quantizer.head_error)
    return model, info


class _LazyTensor:
    """A checkpoint tensor, read from its file when transformers
    materializes it (it indexes its state dict's values with [...], as it
    does safetensors' slices) into memory of its own size: safetensors'
    safe_open maps a whole shard (memory torch's allocator counts) and
    from_pretrained(path) keeps every shard open for the whole load. The
    dtype is what its dtype="auto" looks at."""

    def __init__(self, file: str, key: str, dtype: torch.dtype, shape: list[int], start: int, stop: int):
        self.file, self.key, self.dtype, self.shape, self.start, self.stop = file, key, dtype, shape, start, stop

    def __getitem__(self, index) -> torch.Tensor:
        raw = torch.empty(self.stop - self.start, dtype=torch.uint8)
        with open(self.file, "rb") as f:
            f.seek(self.start)
            got = f.readinto(raw.numpy())
        if got != raw.numel():
            raise ValueError(f"load_fp8: {os.path.basename(self.file)} ends inside {self.key} (truncated file)")
        return raw.view(self.dtype).reshape(self.shape)[index]

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point


def _checkpoint_files(where, hub: dict) -> list[str]:
    """The safetensors files of a checkpoint (a directory or a Hub name):
    the shards its model.safetensors.index.json lists, or
    model.safetensors; ValueError if there are none."""
    import json

    from transformers.utils import cached_file

    def find(name):
        if os.path.isdir(where):
            path = os.path.join(where, hub.get("subfolder", ""), name)
            return path if os.path.isfile(path) else None
        return cached_file(where, name, _raise_exceptions_for_missing_entries=False, **hub)

    index = find("model.safetensors.index.json")
    if index is not None:
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        files = [find(shard) for shard in shards]
        absent = [shard for shard, f in zip(shards, files) if f is None]
        if absent:
            raise ValueError(f"load_fp8: {where}'s model.safetensors.index.json lists shards that are not there: "
                             f"{', '.join(absent)}")
        return files
    single = find("model.safetensors")
    if single is None:
        raise ValueError(f"load_fp8: {where} has no safetensors checkpoint (model.safetensors or "
                         f"model.safetensors.index.json); load_fp8 reads safetensors only")
    return [single]


def _lazy_state_dict(where, hub: dict) -> dict[str, _LazyTensor]:
    """The checkpoint's tensors, unread, from the safetensors headers (8
    bytes of little-endian length, then JSON: per tensor its dtype, shape
    and data_offsets from the end of the header). Every one must be
    floating point (bf16, fp16, fp32, fp64): transformers would cast
    anything else to the model's dtype without a word (an fp8 checkpoint
    without its quantization_config, integer weights)."""
    import json

    state = {}
    for file in _checkpoint_files(where, hub):
        name = os.path.basename(file)
        with open(file, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            try:
                header = json.loads(f.read(length))
            except ValueError as e:
                raise ValueError(f"load_fp8: {name} is not a safetensors file (its header: {e})") from None
        header.pop("__metadata__", None)
        for key, entry in header.items():
            dtype = _FLOAT_DTYPES.get(entry["dtype"])
            if dtype is None:
                raise ValueError(f"load_fp8: {key} in {name} is {entry['dtype']}; a checkpoint without a "
                                 f"quantization_config is quantized from {', '.join(_FLOAT_DTYPES)} tensors (an fp8 "
                                 f"checkpoint needs its quantization_config, quant_method 'fp8')")
            start, stop = (8 + length + offset for offset in entry["data_offsets"])
            if stop - start != math.prod(entry["shape"]) * dtype.itemsize:
                raise ValueError(f"load_fp8: {key} in {name}: {stop - start} bytes for {entry['dtype']} "
                                 f"{entry['shape']}")
            state[key] = _LazyTensor(file, key, dtype, entry["shape"], start, stop)
    return state


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
    qc = dict(qc) if isinstance(qc, dict) else qc.to_dict()
    method = qc.get("quant_method")
    if method != "fp8":
        raise ValueError(f"load_fp8 loads fine-grained FP8 checkpoints (quant_method 'fp8') and bf16 / fp16 / "
                         f"fp32 ones (no quantization_config); {where} has quant_method {method!r}")
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
    config_cls, quantizer_cls = _quantizing_classes()
    if QUANTIZE_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(QUANTIZE_METHOD)(config_cls)
    if QUANTIZE_METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(QUANTIZE_METHOD)(quantizer_cls)
    _registered = True


def _quantizing_classes():
    """transformers' extension points for quantizing while loading: a
    quantization config (our granularity and filter), a quantizer that
    replaces quantize_fp8's modules by empty fp8 ones before any weight is
    read, and the op it hands each of their weights to."""
    from transformers.core_model_loading import ConversionOps
    from transformers.quantizers.base import HfQuantizer
    from transformers.utils.quantization_config import QuantizationConfigMixin

    class QuantizeConfig(QuantizationConfigMixin):
        """quantize_fp8's options; `error`: the first ValueError of the
        quantize op (transformers reports it as a RuntimeError)."""

        def __init__(self, granularity="row", filter=None, lm_head=False, **kwargs):
            self.quant_method = QUANTIZE_METHOD
            self.granularity, self.filter, self.lm_head, self.error = granularity, filter, lm_head, None

        def to_dict(self):
            return {"quant_method": QUANTIZE_METHOD, "granularity": self.granularity, "lm_head": self.lm_head}

    class Quantizer(HfQuantizer):
        """Quantizes a bf16 checkpoint while transformers reads it."""

        requires_calibration = False

        def validate_environment(self, *args, **kwargs):
            if self.pre_quantized:
                raise ValueError("mps_ext's quantizing loader reads bf16 / fp16 / fp32 checkpoints")

        def _process_model_before_weight_loading(self, model, **kwargs):
            """quantize_fp8's choice of modules on the meta skeleton, each
            replaced by an empty fp8 module of its shapes."""
            self.bytes_before = fp8._model_bytes(model)
            config = self.quantization_config
            self.plan = fp8._plan(model, config.filter, on_meta=True, lm_head=config.lm_head)
            self.head_error = None  # the LM head's, measured by the quantize op as it converts it
            tied = getattr(model, "all_tied_weights_keys", None) or {}
            tied_names = {n.rpartition(".")[0] for pair in tied.items() for n in pair}
            self.layout = {}
            granularity = config.granularity
            for name, kind in self.plan.targets:
                mod = model.get_submodule(name)
                if name in tied_names:
                    raise ValueError(f"load_fp8: {name}'s weight is tied to another ({tied}); load the model with "
                                     f"from_pretrained and quantize it with quantize_fp8, or leave it to the filter")
                if kind == "FP8Linear":
                    bias = mod.bias
                    new = FP8Linear(mod.in_features, mod.out_features, bias is not None, granularity, device="meta",
                                    dtype=bias.dtype if bias is not None else torch.bfloat16)
                else:
                    gate_up, down, concatenated = fp8._bank_views(mod, on_meta=True)
                    e, two_i, h = gate_up.shape
                    new = FP8Experts(e, h, two_i // 2, device="meta")
                    self.layout[name] = (bool(getattr(mod, "is_transposed", False)), concatenated)
                model.set_submodule(name, new)

        def param_needs_quantization(self, model, param_name, **kwargs):
            prefix, _, leaf = param_name.rpartition(".")
            mod = model.get_submodule(prefix)
            return ((isinstance(mod, FP8Linear) and leaf == "weight")
                    or (isinstance(mod, FP8Experts) and leaf in ("gate_up_proj", "down_proj")))

        def get_quantize_ops(self):
            return QuantizeOp(self)

        def is_serializable(self):
            return True

        @property
        def is_trainable(self):
            return True

        def get_state_dict_and_metadata(self, model):
            return fine_grained_state_dict(model), {}

    class QuantizeOp(ConversionOps):
        """Each weight of an fp8 module, as transformers read it (renamed,
        merged, in the model's dtype) -> its fp8 weight and scales, by the
        code quantize_fp8 runs (quantize_weight, fp8._quantize_bank)."""

        def __init__(self, quantizer):
            self.quantizer = quantizer

        def convert(self, input_dict, model=None, **kwargs):
            out = {}
            try:
                for key, value in input_dict.items():
                    out.update(self.quantize(model, key, value[0] if isinstance(value, list) else value))
            except ValueError as e:
                config = self.quantizer.quantization_config
                config.error = config.error or e
                raise
            return out

        def quantize(self, model, key, tensor):
            prefix, _, leaf = key.rpartition(".")
            mod = model.get_submodule(prefix)
            if isinstance(mod, FP8Linear):
                _check_shape(key, tensor, (mod.out_features, mod.in_features))
                q, s = fp8.quantize_weight(tensor, mod.granularity)
                if prefix == self.quantizer.plan.head:
                    self.quantizer.head_error = fp8.head_error(tensor, q, s, mod.granularity)
                return {key: q, f"{prefix}.weight_scale": s}
            transposed, concatenated = self.quantizer.layout[prefix]
            e, h, i = mod.num_experts, mod.hidden, mod.intermediate
            gate_up = leaf == "gate_up_proj"
            want = (e, 2 * i, h) if gate_up else (e, h, i)  # FP8Experts' orientation
            _check_shape(key, tensor, (want[0], want[2], want[1]) if transposed else want)
            bank = tensor.transpose(1, 2) if transposed else tensor
            q, s = fp8._quantize_bank(bank, concatenated or not gate_up)
            return {key: q, f"{prefix}.{'gate_up' if gate_up else 'down'}_scale": s}

    return QuantizeConfig, Quantizer


def _check_shape(key: str, tensor: torch.Tensor, want: tuple) -> None:
    """The quantize op's own shape check: transformers compares shapes only
    for what it does not quantize."""
    if tuple(tensor.shape) != want:
        raise ValueError(f"load_fp8: {key} is {list(tensor.shape)} in the checkpoint (after transformers' "
                         f"renaming and merging); the model wants {list(want)}")


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
    them), an fp8 LM head tied to the input embedding, and FP8Experts
    (one scale per expert output row, what the grouped kernels take)."""
    in_fp8 = {n: m for n, m in model.named_modules() if isinstance(m, (FP8Linear, FP8Experts))}
    state = model.state_dict()
    if not in_fp8:
        return state
    experts = [n for n, m in in_fp8.items() if isinstance(m, FP8Experts)]
    if experts:
        raise ValueError(f"save_pretrained: {_names(experts)} are FP8Experts, which hold one scale per expert "
                         f"output row (what mps_ext's grouped fp8 kernels take); transformers' fine-grained FP8 "
                         f"format has one per 128 x 128 block, and converting would round the weights again. "
                         f"Save the model before quantize_fp8 (or quantize it with a filter that leaves the "
                         f"experts) and quantize after loading")
    head = fp8._lm_head_name(model)
    text = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    if head in in_fp8 and getattr(text, "tie_word_embeddings", False):
        # transformers saves one tensor for the pair and ties them again on loading (it then fails
        # comparing the bf16 embedding with the fp8 head).
        raise ValueError(f"save_pretrained: the LM head {head} is in fp8 but tied to the input embedding "
                         f"(tie_word_embeddings), which a checkpoint stores once, in the embedding's dtype; "
                         f"save the model before quantize_fp8(..., lm_head=True) and convert the head after "
                         f"loading")
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
