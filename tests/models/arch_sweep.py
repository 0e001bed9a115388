"""The architecture conformance sweep (issue 30, point 5): every causal-LM
architecture the installed transformers ships (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
built from its own default config shrunk to a tiny one, run on CPU in
float32 through mps_ext.optimize, mps_ext.quantize_fp8, both orders, and
compared with the stock model.

What it compares (each check can fail; the bounds are module constants):

- optimize vs stock: greedy generate of NEW_TOKENS tokens after a PROMPT
  token prompt, the same tokens, and each step's logits (prefill, then
  decode through the KV cache) within TIGHT of the stock model's, TIGHT
  relative to the largest stock logit. Optimize's modules on CPU tensors
  without the executor run torch's CPU ops, so what differs from stock is
  only a summation order (a concatenated projection is another GEMM), far
  below a wrong weight, a lost term or a misrecognised router.
- quantize_fp8 vs stock: teacher-forced logits (one forward over the prompt
  and the stock model's generated tokens; a tiny random model's greedy
  tokens flip on near ties, logits do not), against the oracle: the stock
  model holding the weights quantize_fp8 stores (fp8 times scale, back in
  float32; test_fp8_flows.oracle_of), which is mps_ext.fp8's contract.
  Within TIGHT where only FP8Linear was made (it computes in the
  activation's dtype with the weight de-quantised), within BF16 where
  FP8Experts were (they take bfloat16 activations, the fp8 kernels'
  recipe). The error against stock itself is reported, not bounded: what
  fp8 rounding does to logits depends on the model (0.0005 to 0.8 of the
  largest logit across these tiny models with the oracle matched to the
  bit), so no bound would both hold for every architecture and catch a
  wrong scale; the oracle catches it.
- quantize_fp8 then optimize vs quantize_fp8 alone, and optimize then
  quantize_fp8 vs quantize_fp8 alone: the same tokens, each step's logits
  within TIGHT (row scales make quantizing a fused projection the same as
  quantizing its parts), or BF16 where the model has FP8Experts (a shared
  expert fused into them takes bfloat16 activations where quantize_fp8
  alone ran it as FP8Linear in float32).

The executor is not requested: CPU tensors take torch's CPU ops, as they do
for a user on CPU; the kernels' results are the other model tests' subject.
An exception inside optimize or quantize_fp8 is a crash (a failure), except a
ValueError or TypeError with a message: a clear refusal, listed apart. An
architecture whose tiny config, model or stock run fails is skipped with the
exception's first line. `python tests/models/arch_sweep.py --write` writes
docs/architectures.md; `python tests/models/arch_sweep.py ARCH ...` prints
what each pass did to those architectures (a minimal repro of a finding).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import pathlib
import re
import sys
import time
import warnings

import torch
from torch import nn

PROMPT = 6
NEW_TOKENS = 3
VOCAB = 256
SPECIAL = 32  # token ids VOCAB - SPECIAL .. VOCAB - 1 are for a config's special tokens; prompts avoid them
SEED = 0

# Relative to the largest reference logit. TIGHT: 84 float32 units in the
# last place (2^-23 each); optimize's largest on the pinned release is 1.8e-7,
# so it leaves room for other CPUs' summation orders and none for a wrong
# term. BF16: 4 bfloat16 units in the last place (2^-8 each); FP8Experts'
# largest against the oracle is 3.9e-3 (one unit), a wrong expert or scale
# is of the order of the MoE's share of the logits.
TIGHT = 1e-5
BF16 = 2.0 ** -6

# ------------------------------------------------------------------ tiny configs --
# Attribute -> tiny value, taken where the default config is larger (never
# raised: a default of 1 kv head stays 1). Widths keep hidden = heads x
# head_dim (64 = 4 x 16) and experts x top-k small but routed (8, top 2).
TINY = {
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "dim", "embedding_size", "hidden_size_global",
                     "input_size", "adapter_out_dim", "out_hidden_size", "backbone_hidden_size"), 64),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "n_inner", "decoder_ffn_dim", "encoder_ffn_dim",
                     "ffn_hidden_size", "dff", "d_ff", "dim_ff", "intermediate_size_mlp", "mlp_dim", "d_inner",
                     "dense_intermediate_size"), 128),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size", "shared_experts_intermediate_size",
                     "shared_intermediate_size", "expert_ffn_hidden_size", "moe_shared_expert_intermediate_size",
                     "pronunciation_embed_dim", "shape_embed_dim"), 32),
    **dict.fromkeys(("num_attention_heads", "n_head", "num_heads", "n_heads", "decoder_attention_heads",
                     "encoder_attention_heads", "attention_heads", "swa_num_attention_heads", "linear_num_heads",
                     "linear_num_value_heads", "mamba_n_heads", "conf_num_attention_heads"), 4),
    **dict.fromkeys(("num_key_value_heads", "num_kv_heads", "kv_n_heads", "swa_num_key_value_heads",
                     "linear_num_key_heads", "index_n_heads", "n_mamba_heads"), 2),
    **dict.fromkeys(("head_dim", "kv_channels", "dim_head", "d_kv", "attention_head_dim", "swa_head_dim",
                     "linear_key_head_dim", "linear_value_head_dim", "linear_head_dim", "index_head_dim",
                     "qk_head_dim", "v_head_dim", "mamba_d_state", "state_size", "codebook_dim", "d_head"), 16),
    **dict.fromkeys(("mamba_d_head",), 32),  # mamba_n_heads x mamba_d_head = expand x hidden
    **dict.fromkeys(("qk_rope_head_dim", "qk_nope_head_dim", "time_step_rank", "mamba_dt_rank", "rotary_dim",
                     "laurel_rank", "hc_lowrank", "gated_norm_rank"), 8),
    **dict.fromkeys(("q_lora_rank", "kv_lora_rank", "o_lora_rank", "hidden_size_per_layer_input",
                     "ple_embed_dim"), 16),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 8),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "moe_k", "moe_top_k", "num_experts_per_token",
                     "n_group", "num_expert_group", "n_groups"), 2),
    **dict.fromkeys(("topk_group", "n_shared_experts", "num_shared_experts", "moe_num_shared_experts",
                     "num_nextn_predict_layers"), 1),
    "zero_expert_num": 2,  # LongCat's zero-computation experts, beside the routed ones
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "model_max_length",
                     "max_source_positions", "index_topk", "attention_chunk_size", "keep_window_size",
                     "local_attention_window_len", "rel_extent"), 64),
    # Smaller than prompt + new tokens, so that a sliding layer slides.
    **dict.fromkeys(("sliding_window", "sliding_window_size", "window_size"), 8),
    **dict.fromkeys(("chunk_size", "mamba_chunk_size", "conf_attention_chunk_size"), 16),
    **dict.fromkeys(("vocab_size", "vocab_size_per_layer_input", "unpadded_vocab_size", "codebook_size",
                     "encoder_hash_byte_group_vocab", "num_centroids"), VOCAB),
    # Layer periods: every kind of layer within the first few.
    **dict.fromkeys(("attn_layer_period", "global_attn_every_n_layers", "sliding_window_pattern",
                     "_sliding_window_pattern", "no_rope_layer_interval", "interleave_moe_layer_step",
                     "moe_layer_interval", "decoder_sparse_step", "layer_group_size", "full_attention_interval",
                     "n_layers_per_attn_res_block"), 2),
    **dict.fromkeys(("first_k_dense_replace", "num_dense_layers", "moe_layer_start_index", "attn_layer_offset",
                     "num_kv_shared_layers", "max_window_layers"), 1),
}
# The layer count of a config (the first of these it has); its per-layer
# lists and layer-index lists follow the layers kept.
LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "num_decoder_layers",
                "num_layers_per_stack", "depth")
OTHER_COUNTS = ("encoder_layers", "conf_num_hidden_layers", "num_blocks")  # other stacks: 2 layers
_INDEX_LIST = re.compile(r"(layers|idxs|indexes|indices|layer_ids)$")


def _is_config(d) -> bool:
    return isinstance(d, dict) and "model_type" in d


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _per_layer(key: str, v, count: int) -> bool:
    """Whether d[key] = v has one entry per layer: a list of `count`, or a
    pattern string of `count` characters (nemotron_h's "M-M*-")."""
    return (len(v) == count and not _index_list(key, v, count) if isinstance(v, list) else
            isinstance(v, str) and "pattern" in key and len(v) == count)


def _kept_layers(d: dict, count: int) -> list[int]:
    """Layers to keep of `count`: the first of each kind any per-layer list
    of the config names (each distinct value of a list of `count` entries,
    both sides of each layer-index list), at least two."""
    kept = {0}
    for key, v in d.items():
        if _per_layer(key, v, count):
            first = {}
            for i, x in enumerate(v):
                first.setdefault(repr(x), i)
            kept.update(first.values())
        elif _index_list(key, v, count):
            kept.update(v[:1])
            kept.update([i for i in range(count) if i not in v][:1])
    # A pattern shorter than the layers repeats (recurrent_gemma's block_types): one whole period.
    period = max((len(v) for k, v in d.items() if k.endswith("types") and isinstance(v, list) and len(v) < count),
                 default=0)
    kept.update(range(period))
    i = 0
    while len(kept) < min(2, count):
        kept.add(i)
        i += 1
    return sorted(kept)


def _index_list(key, v, count) -> bool:
    """Whether d[key] = v lists layer numbers (llama4's moe_layers, zamba2's hybrid_layer_ids)."""
    return (bool(_INDEX_LIST.search(key)) and isinstance(v, list) and 0 < len(v)
            and all(_is_int(i) and 0 <= i < count for i in v))


def _shrink_layers(d: dict) -> None:
    key = next((k for k in LAYER_COUNTS if _is_int(d.get(k))), None)
    for k in OTHER_COUNTS:
        if _is_int(d.get(k)) and d[k] > 2:
            d[k] = 2
    if key is None or d[key] <= 2:
        return
    count = d[key]
    kept = _kept_layers(d, count)
    for k in LAYER_COUNTS:  # also another name of the same count (whisper's num_hidden_layers, decoder_layers)
        if _is_int(d.get(k)) and d[k] == count:
            d[k] = len(kept)
    for k, v in list(d.items()):
        if _index_list(k, v, count):
            d[k] = [kept.index(i) for i in v if i in kept]
        elif _per_layer(k, v, count):
            d[k] = v[:0].join(v[i] for i in kept) if isinstance(v, str) else [v[i] for i in kept]
        elif isinstance(v, dict) and v and all(isinstance(x, str) and x.isdigit() and int(x) < count for x in v):
            # Per-layer settings keyed by the layer's number as text ("02").
            d[k] = {f"{kept.index(int(x)):0{len(x)}d}": w for x, w in v.items() if int(x) in kept}


def _shrink_tokens(d: dict, ids: dict) -> None:
    """Special token ids beyond the tiny vocabulary to its top SPECIAL ids
    (the same old id to the same new one); ids within it stay (a
    pad_token_id of 1 is also a position embedding's padding index). The
    ids a config names are `ids`' values, which prompts avoid."""

    def new(i):
        if not (_is_int(i) and i >= 0):
            return i
        if i < VOCAB - SPECIAL:
            ids[i] = i
        elif i not in ids:
            top = [j for j in range(VOCAB - SPECIAL, VOCAB)[::-1] if j not in ids.values()]
            if not top:
                raise ValueError(f"more than {SPECIAL} special token ids")
            ids[i] = top[0]
        return ids[i]

    for k, v in d.items():
        if k.endswith(("token_id", "token_ids", "token_index", "_index")) and "layer" not in k:
            d[k] = [new(i) for i in v] if isinstance(v, list) else new(v)


# Sizes a default config leaves unset (None) that its model needs.
FILL_NONE = ("head_dim", "num_key_value_heads", "n_routed_experts", "num_experts_per_tok", "n_shared_experts")
# Widths that are a multiple of the hidden size in the default config keep the multiple.
RATIO_TO_HIDDEN = (
    "attention_hidden_size",
    "lru_width",
    "embedding_dim",
    "mamba_d_ssm",
    "emb_dim",
    "word_embed_proj_dim",
    "output_embedding_size",
    "prompt_mid_dim",
)


def _shrink(d: dict, ids: dict) -> None:
    old = dict(d)
    for k, v in d.items():
        if _is_config(v):
            _shrink(v, ids)
        elif k in TINY and _is_int(v) and v > TINY[k]:
            d[k] = TINY[k]
        elif k in TINY and v is None and k in FILL_NONE:
            d[k] = TINY[k]
    hidden = old.get("hidden_size")
    for k in RATIO_TO_HIDDEN:
        if _is_int(d.get(k)) and _is_int(hidden) and hidden and d[k] % hidden == 0:
            d[k] = d[k] // hidden * d["hidden_size"]
        elif _is_int(d.get(k)) and d[k] > 64:
            d[k] = 64
    _keep_relations(d, old)
    # Multi-head latent attention (DeepSeek): rotary on the qk_rope_head_dim part only.
    if _is_int(old.get("qk_rope_head_dim")) and _is_int(old.get("qk_nope_head_dim")):
        for k in ("head_dim", "swa_head_dim", "qk_head_dim"):
            if old.get(k) == old["qk_rope_head_dim"]:
                d[k] = d["qk_rope_head_dim"]
            elif old.get(k) == old["qk_nope_head_dim"] + old["qk_rope_head_dim"]:
                d[k] = d["qk_nope_head_dim"] + d["qk_rope_head_dim"]
    head = d.get("head_dim")
    rope = d.get("rope_parameters")
    if isinstance(rope, dict) and isinstance(rope.get("mrope_section"), list) and _is_int(head):
        # Sections of the rotary half-dimension, in proportion.
        sec = rope["mrope_section"]
        scaled = [max(1, s * (head // 2) // sum(sec)) for s in sec]
        scaled[0] += head // 2 - sum(scaled)
        rope["mrope_section"] = scaled
    _shrink_layers(d)
    _shrink_tokens(d, ids)


def _keep_relations(d: dict, old: dict) -> None:
    """Equalities among sizes that the default config has and shrinking
    each alone broke: as many kv heads as heads (multi-head latent
    attention, vision towers); a Mamba mixer's heads x head size = its
    inner width (expand x hidden, or mamba_d_ssm)."""
    for heads, kv in (("num_attention_heads", "num_key_value_heads"), ("n_head", "num_kv_heads")):
        if _is_int(old.get(kv)) and old.get(kv) == old.get(heads):
            d[kv] = d[heads]
    expand = d.get("mamba_expand", d.get("expand"))
    if not (_is_int(expand) and _is_int(d.get("hidden_size"))):
        return

    def inner(c):
        return c["mamba_d_ssm"] if _is_int(c.get("mamba_d_ssm")) else expand * c["hidden_size"]

    for heads, dim in (
        ("num_heads", "head_dim"),
        ("mamba_n_heads", "mamba_d_head"),
        ("n_mamba_heads", "mamba_headdim"),
    ):
        if _is_int(old.get(heads)) and _is_int(old.get(dim)) and old[heads] * old[dim] == inner(old):
            d[dim] = inner(d) // d[heads]


# What a default config needs beyond shrinking to build and generate, or to
# have the layers that make the architecture, per architecture (each a gap of
# transformers' defaults, said in the comment).
OVERRIDES = {
    # layer_types defaults to None, which the model indexes.
    "lfm2_moe": dict(layer_types=["conv", "full_attention", "conv"], num_hidden_layers=3),
    # The default is attention only; LFM2's own layers are short convolutions with some attention.
    "lfm2": dict(layer_types=["conv", "full_attention"], full_attn_idxs=[1]),
    # No attention layer by default: generate() asks the cache for its length, which only attention layers keep.
    "bamba": dict(attn_layer_indices=[1]),
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"]),
    # The attention clamps q, k and v to clip_qkv unconditionally; None (the default) fails.
    # and the model reads attn_config.rope_theta, which DbrxAttentionConfig does not define.
    "dbrx": dict(attn_config=dict(rope_theta=10000.0, clip_qkv=8.0)),
    # Its attention_types must describe exactly num_layers layers ([pattern, repeats]).
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]]),
    # Block-sparse attention needs sequences of several 64-token blocks; short ones are full attention.
    "big_bird": dict(attention_type="original_full"),
}


def _merge(d: dict, extra: dict) -> None:
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(d.get(k), dict):
            _merge(d[k], v)
        else:
            d[k] = v


def tiny_config(model_type: str):
    """(config, special token ids) of `model_type`: its default config
    shrunk (TINY, its layers, its special tokens, OVERRIDES), what
    AutoModelForCausalLM builds the sweep's model of."""
    from transformers import CONFIG_MAPPING
    config_class = CONFIG_MAPPING[model_type]
    d = config_class().to_dict()
    ids: dict = {}
    _shrink(d, ids)
    _merge(d, OVERRIDES.get(model_type, {}))
    for k in ("transformers_version", "_name_or_path", "architectures"):
        d.pop(k, None)
    return config_class.from_dict(d), set(ids.values())


# ------------------------------------------------------------------ runs --
@dataclasses.dataclass
class Run:
    """A model's greedy generation: the new tokens, each step's logits
    [steps, vocab], and the teacher-forced logits [tokens, vocab] of the
    stock model's whole sequence (None where not asked for)."""

    tokens: torch.Tensor
    steps: torch.Tensor
    forced: torch.Tensor | None = None


def prompt(special: set[int]) -> torch.Tensor:
    """PROMPT seeded random ids below the special ones, none of `special`."""
    allowed = torch.tensor([i for i in range(VOCAB - SPECIAL) if i not in special])
    return allowed[torch.randint(0, len(allowed), (1, PROMPT), generator=torch.Generator().manual_seed(SEED))]


def generate(model, ids: torch.Tensor) -> Run:
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False, return_dict_in_generate=True,
                             output_logits=True)
    return Run(out.sequences[:, ids.shape[1]:], torch.cat([step.float() for step in out.logits]))


def forced(model, sequence: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(sequence, attention_mask=torch.ones_like(sequence)).logits[0].float()


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest |got - want| over the largest |want|, in float64."""
    got, want = got.double(), want.double()
    if got.shape != want.shape:
        return math.inf
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


# ------------------------------------------------------------------ what the passes recorded --
def _sections(model: nn.Module) -> dict[str, tuple[dict[str, str], dict[str, str]]]:
    """{section: (converted name -> what, left name -> why)} of what
    mps_ext.optimize and mps_ext.quantize_fp8 recorded on `model`: the one
    place that reads their summaries."""
    out = {}
    s = getattr(model, "optimize_summary", None)
    if s is not None:
        for name, section in s.sections.items():
            out[name] = ({**section.converted, **{n: "already" for n in section.already}}, section.left)
    f = getattr(model, "fp8_summary", None)
    if f is not None:
        out["fp8"] = ({n: kind for kind, names in f.converted.items() for n in names}, f.left)
    return out


OPTIMIZE_SECTIONS = ("moe", "norms", "linear_attention", "short_conv", "projections", "attention", "decoder_layers",
                     "rotary")
FP8_SECTIONS = ("fp8",)
# The passes, in order: (name, steps applied to a copy of the model, the sections its last step records).
PASSES = (("optimize", ("optimize",), OPTIMIZE_SECTIONS),
          ("quantize_fp8", ("quantize_fp8",), FP8_SECTIONS),
          ("quantize_fp8+optimize", ("quantize_fp8", "optimize"), OPTIMIZE_SECTIONS),
          ("optimize+quantize_fp8", ("optimize", "quantize_fp8"), FP8_SECTIONS))


@dataclasses.dataclass
class PassResult:
    """One pass on one architecture. status: "match" (every check held),
    "mismatch" (a check failed: `detail` says which), "crash" (an exception
    inside the pass or the converted model's run), "refused" (a ValueError or
    TypeError of the pass, with its message), "not run" (a pass it needs did
    not convert). sections: what the pass's last step recorded (_sections).
    errors: each check's relative error."""

    status: str
    sections: dict[str, tuple[dict[str, str], dict[str, str]]] = dataclasses.field(default_factory=dict)
    detail: str = ""
    errors: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return self.status in ("mismatch", "crash")


@dataclasses.dataclass
class ArchResult:
    arch: str
    model_class: str
    skipped: str | None = None  # why the architecture did not run: "config|build|stock run: first line"
    passes: dict[str, PassResult] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0

    def failures(self) -> list[str]:
        return [f"{self.arch} {name}: {p.status}: {p.detail}" for name, p in self.passes.items() if p.failed]


def first_line(e: BaseException) -> str:
    """The exception's type and first line (and the next, where the first
    only introduces it: transformers' config validation errors)."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()] or [""]
    text = " ".join(lines[:2]) if lines[0].endswith(":") else lines[0]
    return f"{type(e).__name__}: {text}".strip()


def _apply(model: nn.Module, steps) -> nn.Module:
    import mps_ext
    for step in steps:
        model = getattr(mps_ext, step)(model)
    return model


def _checks(got: Run, want: Run, bound: float, what: str, errors: dict) -> list[str]:
    """Greedy tokens equal and each step's logits within `bound` of want's."""
    problems = []
    if not torch.equal(got.tokens, want.tokens):
        problems.append(f"tokens {got.tokens.tolist()} != {what}'s {want.tokens.tolist()}")
    errors[f"steps vs {what}"] = err = rel_err(got.steps, want.steps)
    if not err <= bound:
        problems.append(f"logits of each step differ from {what}'s by {err:.3g} > {bound:g}")
    return problems


def _forced_check(got: torch.Tensor, want: torch.Tensor, bound: float, what: str, errors: dict) -> list[str]:
    errors[f"forced vs {what}"] = err = rel_err(got, want)
    return [] if err <= bound else [f"teacher-forced logits differ from {what}'s by {err:.3g} > {bound:g}"]


def _run_pass(model: nn.Module, steps, sections, check) -> tuple[PassResult, nn.Module | None]:
    """The pass `steps` on a copy of `model`, then check(converted) -> list
    of problems (filling errors). Returns (result, converted model)."""
    m = copy.deepcopy(model)
    try:
        m = _apply(m, steps)
    except (ValueError, TypeError) as e:
        if str(e).strip():
            return PassResult("refused", detail=first_line(e)), None
        return PassResult("crash", detail=first_line(e)), None
    except Exception as e:
        return PassResult("crash", detail=first_line(e)), None
    recorded = _sections(m)
    result = PassResult("match", {s: recorded.get(s, ({}, {})) for s in sections})
    try:
        problems = check(m, result.errors)
    except Exception as e:
        result.status, result.detail = "crash", f"running the converted model: {first_line(e)}"
        return result, m
    if problems:
        result.status, result.detail = "mismatch", "; ".join(problems)
    return result, m


def sweep_arch(arch: str) -> ArchResult:
    """Every pass on the tiny `arch` (ArchResult); never raises for what a
    model or pass does."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from test_fp8_flows import oracle_of
    start = time.perf_counter()
    result = ArchResult(arch, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[arch])
    try:
        _sweep(arch, result, oracle_of)
    finally:
        result.seconds = time.perf_counter() - start
    return result


def _sweep(arch: str, result: ArchResult, oracle_of) -> None:
    import transformers
    with sweeping():
        try:
            config, special = tiny_config(arch)
        except Exception as e:
            result.skipped = f"config: {first_line(e)}"
            return
        try:
            torch.manual_seed(SEED)
            model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
        except Exception as e:
            result.skipped = f"build: {first_line(e)}"
            return
        ids = prompt(special)
        try:
            stock = generate(model, ids)
            sequence = torch.cat([ids, stock.tokens], 1)
            stock.forced = forced(model, sequence)
        except Exception as e:
            result.skipped = f"stock run: {first_line(e)}"
            return
        runs: dict[str, Run] = {}
        quantized_kinds: set[str] = set()
        converted: dict[str, nn.Module] = {}

        def optimize_check(m, errors):
            runs["optimize"] = got = generate(m, ids)
            return _checks(got, stock, TIGHT, "stock", errors)

        def quantize_check(m, errors):
            runs["quantize_fp8"] = got = generate(m, ids)
            got.forced = forced(m, sequence)
            errors["forced vs stock"] = rel_err(got.forced, stock.forced)  # a figure: model-dependent, no bound
            quantized_kinds.update(_sections(m)["fp8"][0].values())
            return _forced_check(got.forced, forced(oracle_of(m, model), sequence), fp8_bound(), "the oracle",
                                 errors)

        def fp8_bound():
            """TIGHT, or BF16 where quantize_fp8 made FP8Experts (bfloat16 activations by design)."""
            return BF16 if "FP8Experts" in quantized_kinds else TIGHT

        def against_quantized(m, errors):
            return _checks(generate(m, ids), runs["quantize_fp8"], fp8_bound(), "quantize_fp8 alone", errors)

        checks = {"optimize": optimize_check, "quantize_fp8": quantize_check,
                  "quantize_fp8+optimize": against_quantized, "optimize+quantize_fp8": against_quantized}
        for name, steps, sections in PASSES:
            # A pass of two steps starts from the first step's converted model.
            base = steps[0] if len(steps) > 1 else None
            if base is not None and converted.get(base) is None:
                result.passes[name] = PassResult("not run", detail=f"{base} did not run")
                continue
            if base is not None and "quantize_fp8" not in runs:
                result.passes[name] = PassResult("not run", detail="quantize_fp8 did not run")
                continue
            p, m = _run_pass(converted[base] if base else model, steps[1:] if base else steps, sections,
                             checks[name])
            result.passes[name] = p
            if not base:
                converted[name] = m if p.status in ("match", "mismatch") else None


class sweeping:
    """How the sweep runs a model: transformers' and mps_ext's log and
    warnings silenced (tiny configs make many), and torch on one thread
    (tiny shapes gain nothing from more; on a shared 2-core machine a second
    thread's spin-waits made each product 100 times slower)."""

    def __enter__(self):
        import transformers
        self._threads = torch.get_num_threads()
        torch.set_num_threads(1)
        self._verbosity = transformers.logging.get_verbosity()
        transformers.logging.set_verbosity_error()
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.simplefilter("ignore")
        self._level = logging.getLogger("mps_ext").level
        logging.getLogger("mps_ext").setLevel(logging.WARNING)
        return self

    def __exit__(self, *exc):
        import transformers
        logging.getLogger("mps_ext").setLevel(self._level)
        self._warnings.__exit__(*exc)
        transformers.logging.set_verbosity(self._verbosity)
        torch.set_num_threads(self._threads)


def architectures() -> list[str]:
    """Every causal-LM architecture (model_type) of the installed transformers."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def pinned_transformers() -> str:
    """The transformers release of pyproject.toml's test extra: the one
    whose table docs/architectures.md holds."""
    text = (ROOT / "pyproject.toml").read_text()
    return re.search(r'"transformers==([^"]+)"', text).group(1)


# ------------------------------------------------------------------ the table --
ROOT = pathlib.Path(__file__).resolve().parents[2]
TABLE = ROOT / "docs" / "architectures.md"
SHORT = {"moe": "MoE", "norms": "norm", "linear_attention": "DeltaNet", "short_conv": "conv", "projections": "proj",
         "attention": "attn", "decoder_layers": "layer", "rotary": "rope"}
WHAT = {"moe": "MoE blocks on moe_layer", "norms": "RMSNorms -> FusedRMSNorm",
        "linear_attention": "Gated DeltaNet layers", "short_conv": "LFM2 short convolutions",
        "projections": "projections that read one input, fused (one per group)",
        "attention": "attention layers on qk_norm_rope", "decoder_layers": "decoder layers on add_rms_norm",
        "rotary": "rotary embeddings as one gather from a table",
        "fp8": "quantize_fp8: nn.Linear -> FP8Linear, expert banks -> FP8Experts"}
STAGES = ("config", "build", "stock run")


def _cell(p: PassResult) -> str:
    if p.status in ("crash", "refused", "not run"):
        return f"**{p.status}**" if p.failed else p.status
    parts = []
    for section, (done, left) in p.sections.items():
        if section == "fp8":
            kinds = list(done.values())
            parts += [f"{k.removeprefix('FP8')} {kinds.count(k)}" for k in ("FP8Linear", "FP8Experts") if k in kinds]
            parts += [f"left {len(left)}"] if left else []
        elif done or left:
            parts.append(f"{SHORT[section]} {len(done)}" + (f"/{len(left)}" if left else ""))
    cell = " · ".join(parts) or "nothing"
    return f"**mismatch**: {cell}" if p.status == "mismatch" else cell


def render(results: list[ArchResult], version: str) -> str:
    """docs/architectures.md: the sweep's results on transformers `version`."""
    ran = [r for r in results if not r.skipped]
    skipped = [r for r in results if r.skipped]
    names = [name for name, _, _ in PASSES]
    out = [f"# Architectures: what optimize and quantize_fp8 do to each (transformers {version})", "",
           "Generated by `python tests/models/arch_sweep.py --write` from the sweep of every causal-LM "
           "architecture transformers ships (`tests/models/arch_sweep.py`, whose docstring gives the rules); "
           "`tests/models/test_architecture_sweep.py` fails when this file differs from what the sweep gives "
           "on the pinned release. Each architecture is its default config shrunk to a tiny one "
           f"(hidden {TINY['hidden_size']}, 2 layers or one of each kind, {TINY['num_experts']} experts, "
           f"vocabulary {VOCAB}), float32 on CPU; each pass runs on a copy of the stock model.", "",
           "A cell counts the modules converted (`/n`: n left, with reasons below): MoE (blocks on moe_layer), "
           "norm (RMSNorms), DeltaNet (Gated DeltaNet layers), conv (LFM2 short convolutions), proj (groups "
           "of projections fused), attn (attention layers on qk_norm_rope), layer (decoder layers on "
           "add_rms_norm), rope (rotary embeddings as one gather from a table); Linear / Experts (FP8Linear, "
           "FP8Experts). **mismatch** and **crash** are bugs (listed below); refused is a clear ValueError or "
           "TypeError of the pass; not run: the pass it starts from did not run.", "", "## Totals", "",
           f"{len(results)} architectures; {len(ran)} built and ran; {len(skipped)} skipped ("
           + ", ".join(f"{sum(r.skipped.startswith(st + ':') for r in skipped)} at {st}" for st in STAGES) + ").",
           "", "| pass | converted something | converted nothing | mismatch | crash | refused | not run |",
           "|---|---|---|---|---|---|---|"]
    for name in names:
        ps = [r.passes[name] for r in ran]
        some = sum(p.status == "match" and any(c for c, _ in p.sections.values()) for p in ps)
        none = sum(p.status == "match" for p in ps) - some
        out.append(f"| {name} | {some} | {none} | "
                   + " | ".join(str(sum(p.status == st for p in ps)) for st in ("mismatch", "crash", "refused",
                                                                            "not run")) + " |")
    out += ["", "| what (optimize on the float32 model; quantize_fp8) | architectures converting | converted | "
            "architectures leaving some | left |", "|---|---|---|---|---|"]
    for name, section in [("optimize", s) for s in OPTIMIZE_SECTIONS] + [("quantize_fp8", "fp8")]:
        got = [r.passes[name].sections[section] for r in ran if section in r.passes[name].sections]
        out.append(f"| {WHAT[section]} | {sum(bool(c) for c, _ in got)} | {sum(len(c) for c, _ in got)} | "
                   f"{sum(bool(l) for _, l in got)} | {sum(len(l) for _, l in got)} |")
    out += ["", "## Per architecture", "", "| architecture | model class | " + " | ".join(names) + " |",
            "|---|---|" + "---|" * len(names)]
    for r in results:
        cells = [f"skipped ({r.skipped.split(':')[0]})"] * len(names) if r.skipped else \
            [_cell(r.passes[n]) for n in names]
        out.append(f"| {r.arch} | {r.model_class} | " + " | ".join(cells) + " |")
    failures = [(r.arch, n, p) for r in ran for n, p in r.passes.items() if p.failed or p.status == "refused"]
    out += ["", "## Mismatches, crashes and refusals", ""]
    out += ["| architecture | pass | status | what |", "|---|---|---|---|"] if failures else ["None."]
    out += [f"| {a} | {n} | {p.status} | {_escape(p.detail)} |" for a, n, p in failures]
    out += ["", "## Left, and why", "",
            "Per pass, each distinct reason the pass gave for a module it left, and the architectures it gave "
            "it for.", ""]
    for name, _, _ in PASSES:
        reasons: dict[tuple[str, str], list[str]] = {}
        for r in ran:
            for section, (_, left) in r.passes[name].sections.items():
                for why in sorted(set(left.values())):
                    reasons.setdefault((section, why), []).append(r.arch)
        if reasons:
            out += [f"### {name}", "", "| what | why | architectures |", "|---|---|---|"]
            out += [f"| {SHORT.get(sec, sec)} | {_escape(why)} | {', '.join(archs)} |"
                    for (sec, why), archs in sorted(reasons.items())]
            out.append("")
    out += ["## Skipped", "", "| architecture | stage | why |", "|---|---|---|"]
    out += [f"| {r.arch} | {r.skipped.split(':')[0]} | {_escape(r.skipped.split(':', 1)[1].strip())} |"
            for r in skipped]
    return "\n".join(out) + "\n"


def _escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def main(argv: list[str]) -> None:
    import argparse
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("arch", nargs="*", help="architectures to run (default: all), printing what each pass did")
    parser.add_argument("--write", nargs="?", const=str(TABLE), metavar="PATH",
                        help=f"write the table of all architectures (default {TABLE.relative_to(ROOT)})")
    args = parser.parse_args(argv)
    import transformers
    start = time.perf_counter()
    results = []
    for arch in args.arch or architectures():
        r = sweep_arch(arch)
        results.append(r)
        if args.write:
            continue
        print(f"{arch} ({r.seconds:.1f}s): " + (f"skipped: {r.skipped}" if r.skipped else ""))
        for name, p in r.passes.items():
            figures = ", ".join(f"{k} {v:.2g}" for k, v in p.errors.items())
            print(f"  {name}: {_cell(p)} [{figures}] {p.detail}")
            for section, (_, left) in p.sections.items():
                for why in sorted(set(left.values())):
                    print(f"    left ({section}): {why}")
    if args.write:
        pathlib.Path(args.write).write_text(render(results, transformers.__version__))
    print(f"{len(results)} architectures in {time.perf_counter() - start:.0f}s"
          + (f"; wrote {args.write}" if args.write else ""), file=sys.stderr)


if __name__ == "__main__":
    here = pathlib.Path(__file__).resolve().parent
    sys.path[:0] = [str(here), str(here.parents[1])]  # test_fp8_flows; this checkout's mps_ext
    main(sys.argv[1:])
