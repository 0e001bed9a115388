"""The model layer as a package of passes (mps_ext/passes), checked on
transformers' own models (tiny configs, CPU), pass by pass and as a user
runs a model: the registry's order; what the summary calls converted is
what runs in generate; a pass's probe catches a module that computes
something else, a cache that would be left otherwise, a release whose
calls it does not know; and the workflows around a model: torch.save,
deepcopy, save_pretrained then from_pretrained, load_state_dict, training
(requires_grad, gradients, router logits), accelerate's offload, the
memory optimize needs, and the cache past recording of transformers'
deferred stop check (a Mac's generate)."""

import copy
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import transformers

import mps_ext
from mps_ext import passes
from mps_ext_executor import run_model
from model_compare import RELEASE
from test_optimize import COMMON, MODELS, make

T = transformers
DENSE = {
    "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM),
    "lfm2": (T.Lfm2Config, T.Lfm2ForCausalLM),
}
LFM2 = dict(layer_types=["conv", "full_attention", "conv"], num_hidden_layers=3, conv_bias=True)
NAMES = ["qwen3_moe", "qwen3_5_moe", "lfm2_moe", "qwen3", "lfm2"]
NO_EXPERTS = {k: v for k, v in COMMON.items() if k not in ("num_experts_per_tok", "experts_implementation")}


def build(name, dtype=torch.float32):
    if name in MODELS:
        return make(name, dtype)
    config_class, model_class = DENSE[name]
    torch.manual_seed(0)
    return model_class(config_class(**{**NO_EXPERTS, **(LFM2 if name == "lfm2" else {})})).to(dtype).eval()


def batch():
    """Two prompts, the second left-padded (generate's padding side)."""
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(2, COMMON["vocab_size"], (2, 6), generator=g)
    mask = torch.ones_like(prompt)
    mask[1, :2] = 0
    return prompt, mask


def generate(model, tokens=4, **kwargs):
    prompt, mask = batch()
    with torch.no_grad():
        return model.generate(input_ids=prompt, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens,
                              do_sample=False, pad_token_id=0, **kwargs)


class _Reads(TorchDispatchMode):
    """The storages of every tensor an mps_ext op (or a linear product:
    the fused projections' GEMV; or a gather: the rotary table's) reads."""

    def __init__(self):
        super().__init__()
        self.storages = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        if name.startswith("mps_ext::") or name in ("aten::linear", "aten::mm", "aten::addmm", "aten::t",
                                                    "aten::index.Tensor"):
            for a in (*args, *(kwargs or {}).values()):
                if isinstance(a, torch.Tensor):
                    self.storages.add(a.untyped_storage().data_ptr())
        return func(*args, **(kwargs or {}))


def unrun(model) -> list[str]:
    """The summary's conversions whose kernel did not read their witness
    tensor in a batched, padded greedy generate on the kernels' path, or in
    one of its prompts alone (without padding, generate lets the model make
    its positions: the rotary table's gather runs there, not under
    generate's positions of a padded batch)."""
    prompt, _ = batch()
    with run_model(RELEASE), _Reads() as reads:
        generate(model)
        with torch.no_grad():
            model.generate(input_ids=prompt[:1], max_new_tokens=2, do_sample=False, pad_token_id=0)
    return [f"{p.name} {name}" for p in passes.PASSES for name in model.optimize_summary[p.name].converted
            if p.witness(model, name).untyped_storage().data_ptr() not in reads.storages]


# ----------------------------------------------------------- the registry --
def test_the_registry_runs_each_pass_after_the_passes_it_needs():
    names = [p.name for p in passes.PASSES]
    assert len(set(names)) == len(names) == 8
    for i, p in enumerate(passes.PASSES):
        assert set(p.after) <= set(names[:i]), p.name
        assert p.title and (not p.stateful or type(p).revert is not passes.Pass.revert)
    with pytest.raises(RuntimeError, match="runs before"):
        passes._check_order(tuple(reversed(passes.PASSES)))


# ----------------------------------------------------------- what runs --
@pytest.mark.parametrize("name", NAMES)
def test_every_conversion_the_summary_reports_runs_in_generate(name):
    model = build(name)
    want = generate(model)
    mps_ext.optimize(model)
    s = model.optimize_summary
    assert sum(len(s[p.name].converted) for p in passes.PASSES) >= 5
    assert unrun(model) == []
    with run_model(RELEASE):
        assert torch.equal(generate(model), want)


def test_a_layer_called_as_the_pass_does_not_know_is_left_not_reported(monkeypatch):
    """A release whose decoder layer hands the Gated DeltaNet its cache under
    another name (5.24 renamed cache_params to cache; here, a name no release
    used): the layer's fused path would never run; the episode finds that
    and leaves it, so the summary says only what runs."""
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as qm
    own = qm.Qwen3_5MoeGatedDeltaNet.forward

    def renamed(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
        return own(self, hidden_states, cache_params=kwargs.pop("the_cache", cache_params),
                   attention_mask=attention_mask, **kwargs)

    def layer_forward(self, hidden_states, position_embeddings, attention_mask=None, position_ids=None,
                      past_key_values=None, **kwargs):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        if hasattr(self, "linear_attn"):
            hidden_states = self.linear_attn(hidden_states=hidden_states, the_cache=past_key_values,
                                             attention_mask=attention_mask)
        else:
            hidden_states, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask,
                                              position_ids=position_ids, past_key_values=past_key_values,
                                              position_embeddings=position_embeddings, **kwargs)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        return residual + self.mlp(hidden_states)

    monkeypatch.setattr(qm.Qwen3_5MoeGatedDeltaNet, "forward", renamed)
    monkeypatch.setattr(qm.Qwen3_5MoeDecoderLayer, "forward", layer_forward)
    model = build("qwen3_5_moe")
    want = generate(model)
    mps_ext.optimize(model)
    left = model.optimize_summary["linear_attention"].left
    assert "took none of its" in left["model.layers.0.linear_attn"]
    assert unrun(model) == []
    assert torch.equal(generate(model), want)


# ----------------------------------------------------------- every pass --
def _model_where_it_converts(p):
    """(model name, the names the pass converts in it)."""
    for name in NAMES:
        model = mps_ext.optimize(build(name))
        done = list(model.optimize_summary[p.name].converted)
        if done:
            return name, done
    raise AssertionError(f"no test model has a module the {p.name} pass converts")


def _plant(module: torch.nn.Module, per_call: bool = False) -> None:
    """The module's outputs scaled by 1.001: a module shaped as the pass
    knows that computes something else. per_call: scaled by 1 + 0.001 x the
    call's tokens (a rotary module whose rows are its own outputs whatever
    they are, unless a position's row depends on the call)."""
    cls = type(module)

    class Planted(cls):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            s = 1 + 0.001 * ((args[1] if len(args) > 1 else kwargs["position_ids"]).shape[-1] if per_call else 1)
            return (out[0] * s, *out[1:]) if isinstance(out, tuple) else out * s
    module.__class__ = Planted


@pytest.mark.parametrize("p", passes.PASSES, ids=lambda p: p.name)
def test_every_pass_keeps_the_protocol(p):
    """The conformance suite, for each pass: it converts something in one of
    the test models; a second optimize finds it converted already; a
    stateful pass's revert gives the module its own class back; a module
    of its kind that computes something else (planted) is left, with the
    reason, and the model gives the planted model's outputs."""
    name, done = _model_where_it_converts(p)
    model = mps_ext.optimize(build(name))
    mps_ext.optimize(model)
    assert not model.optimize_summary[p.name].converted and model.optimize_summary[p.name].already
    if p.stateful:
        from mps_ext.passes._classes import original_class
        module = model.get_submodule(done[0])
        cls = original_class(type(module))
        p.revert(model, done[0])
        assert type(module) is cls
    planted = build(name)
    target = done[0]
    if p.name == "projections":  # the summary names the fused layer; plant its first member
        parent = planted.get_submodule(target.rpartition(".")[0])
        member = next(n for group in passes.projections.GROUPS for n in group if hasattr(parent, n))
        target = f"{target.rpartition('.')[0]}.{member}"
    _plant(planted.get_submodule(target), per_call=p.name == "rotary")
    want = generate(planted)
    mps_ext.optimize(planted)
    s = planted.optimize_summary[p.name]
    assert done[0] not in s.converted and any(k.startswith(target.rpartition(".")[0]) for k in s.left), s
    with run_model(RELEASE):
        got = generate(planted)
    assert torch.equal(got, want)


# ----------------------------------------------------------- probes --
def test_a_dynamic_layer_that_counts_its_tokens_is_left(monkeypatch):
    """A DynamicLayer of a plausible next release, counting its own tokens
    as its sliding-window sibling does (and answering get_seq_length from
    that count): the KV cache's in-place append would not keep the count,
    and batched padded generation would then go wrong. The episode compares
    the cache each layer leaves, so the attention layers are left."""
    from transformers.cache_utils import DynamicLayer
    own_update, own_crop = DynamicLayer.update, DynamicLayer.crop

    def update(self, key_states, value_states, *args, **kwargs):
        self.cumulative_length = getattr(self, "cumulative_length", 0) + key_states.shape[-2]
        return own_update(self, key_states, value_states, *args, **kwargs)

    def crop(self, max_length):
        own_crop(self, max_length)
        self.cumulative_length = self.keys.shape[-2] if self.is_initialized else 0

    monkeypatch.setattr(DynamicLayer, "update", update)
    monkeypatch.setattr(DynamicLayer, "crop", crop)
    monkeypatch.setattr(DynamicLayer, "get_seq_length",
                        lambda self, *a: getattr(self, "cumulative_length", 0) if self.is_initialized else 0)
    model = build("qwen3_moe")
    want = generate(model)
    mps_ext.optimize(model)
    left = model.optimize_summary["attention"].left
    # (the layer's wrong count either shows in the cache it leaves or makes the next step's mask fail)
    assert len(left) == 2 and all("the cache it leaves differs" in why or "the generate episode raised" in why
                                  for why in left.values()), left
    assert not model.optimize_summary["attention"].converted
    with run_model(RELEASE):
        assert torch.equal(generate(model), want)


def test_a_gated_deltanet_that_computes_something_else_is_left(monkeypatch):
    """A Gated DeltaNet whose decode step computes another recurrence (the
    state's decay doubled): looks like one by its parts, gives other
    numbers, so the pass's probe leaves it."""
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as qm
    own = qm.torch_recurrent_gated_delta_rule
    monkeypatch.setattr(qm, "torch_recurrent_gated_delta_rule",
                        lambda query, key, value, g, beta, *a, **k: own(query, key, value, 2 * g, beta, *a, **k))
    model = build("qwen3_5_moe")
    want = generate(model)
    mps_ext.optimize(model)
    left = model.optimize_summary["linear_attention"].left
    assert "differs from its own forward on a probe" in left["model.layers.0.linear_attn"]
    assert "model.layers.0.linear_attn" in model.optimize_summary["linear_attention"].mismatched
    with run_model(RELEASE):
        assert torch.equal(generate(model), want)


# ----------------------------------------------------------- workflows --
@pytest.mark.parametrize("name", ["qwen3_5_moe", "lfm2_moe", "qwen3"])
def test_torch_save_and_deepcopy(name, tmp_path):
    model = mps_ext.optimize(build(name))
    prompt, _ = batch()
    with torch.no_grad():
        want = model(prompt).logits
    torch.save(model, tmp_path / "model.pt")
    with torch.no_grad():
        assert torch.equal(torch.load(tmp_path / "model.pt", weights_only=False)(prompt).logits, want)
        assert torch.equal(copy.deepcopy(model)(prompt).logits, want)
    # A process that never made the classes: they are made again by name.
    script = ("import sys, torch; sys.path[:0] = sys.argv[2:]; import mps_ext; "
              "m = torch.load(sys.argv[1], weights_only=False); "
              "print(sorted({type(x).__name__ for x in m.modules() if type(x).__name__.startswith('Fused')}))")
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "model.pt"), *sys.path[:3]],
                         capture_output=True, text=True, check=True).stdout
    assert "Fused" in out


@pytest.mark.parametrize("name", ["qwen3_5_moe", "lfm2_moe", "qwen3"])
def test_save_pretrained_reloads_into_the_stock_model(name, tmp_path):
    """The optimized model's state keeps the stock model's names, shapes and
    values: a checkpoint it saves loads into transformers' own class to the
    same logits, and a stock state dict loads into it."""
    stock = build(name)
    keys = set(stock.state_dict())
    model = mps_ext.optimize(copy.deepcopy(stock))
    assert set(model.state_dict()) == keys
    prompt, _ = batch()
    with torch.no_grad():
        want, fused = stock(prompt).logits, model(prompt).logits
    model.save_pretrained(tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(reloaded) is type(stock)
    with torch.no_grad():  # the stock class on the stock weights: the same ops, the same bits
        assert torch.equal(reloaded(prompt).logits, want)
    other = mps_ext.optimize(build(name))
    with torch.no_grad():
        for p in other.parameters():
            p.zero_()
    other.load_state_dict(stock.state_dict())
    with torch.no_grad():  # (fused projections sum in another order than the stock model's: the fused model's bits)
        assert torch.equal(other(prompt).logits, fused)


def stock_parameters(model) -> dict:
    """{the stock model's parameter name: (requires_grad, grad)} of an
    optimized model: a fused projection's member is its rows of the fused
    layer's."""
    from mps_ext.passes.projections import ProjectionRows
    out = {n: (p.requires_grad, p.grad) for n, p in model.named_parameters()}
    for name, m in model.named_modules():
        if isinstance(m, ProjectionRows):
            f = m.fused
            out.pop(f"{name.rpartition('.')[0]}.{m.fused_name}.weight".lstrip("."), None)
            out[f"{name}.weight"] = (f.weight.requires_grad,
                                     None if f.weight.grad is None else f.weight.grad[m.start:m.stop])
    return out


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_5_moe", "lfm2_moe"])
def test_training_after_optimize_gets_the_stock_gradients(name):
    stock = build(name)
    stock.train()
    model = mps_ext.optimize(copy.deepcopy(stock))
    want = {n: (p.requires_grad, p.grad) for n, p in stock.named_parameters()}
    assert {n: r for n, (r, _) in stock_parameters(model).items()} == {n: r for n, (r, _) in want.items()}
    prompt, _ = batch()
    for m in (stock, model):
        m(prompt, labels=prompt).loss.backward()
    want = {n: p.grad for n, p in stock.named_parameters()}
    for runner in (None, run_model(RELEASE)):  # torch's ops, then the kernels' path
        if runner is not None:
            model.zero_grad()
            with runner:
                model(prompt, labels=prompt).loss.backward()
        for n, (_, g) in stock_parameters(model).items():
            assert g is not None and want[n] is not None, n
            torch.testing.assert_close(g, want[n], rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_5_moe", "lfm2_moe"])
def test_router_logits_are_recorded(name):
    stock = build(name)
    model = mps_ext.optimize(copy.deepcopy(stock))
    prompt, _ = batch()
    with torch.no_grad(), run_model(RELEASE):
        want = stock(prompt, output_router_logits=True)
        got = model(prompt, output_router_logits=True)
        plain = model(prompt)  # and after it, the fused path again
    assert len(got.router_logits) == len(want.router_logits) > 0
    for g, w in zip(got.router_logits, want.router_logits):  # (the fused layers before a router round otherwise)
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.aux_loss, want.aux_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(plain.logits, want.logits, rtol=1e-5, atol=1e-5)


def test_offloaded_model_is_left_where_its_weights_are_not():
    """accelerate's cpu_offload: every weight on the meta device, loaded by
    a hook at each call. Nothing that would read a weight where the hook
    does not put it is converted; the logits are the offloaded model's."""
    import accelerate  # pinned in the test extra: missing is an error, not a skip
    model = build("qwen3_5_moe")
    prompt, _ = batch()
    with torch.no_grad():
        want = model(prompt).logits
    accelerate.cpu_offload(model, execution_device="cpu")
    mps_ext.optimize(model)
    s = model.optimize_summary
    for p in passes.PASSES:
        assert not s[p.name].converted, (p.name, s[p.name].converted)
    with torch.no_grad():
        assert torch.equal(model(prompt).logits, want)


# ----------------------------------------------------------- memory --
def _peak_bytes(make_model, fn) -> tuple[int, int]:
    """(bytes the model holds, the most bytes torch's CPU allocator held
    beyond them while fn(model) ran, temporaries included), from the
    profiler's memory events. The model is made under the profiler too: it
    records no free of a block allocated before it started."""
    from torch.profiler import ProfilerActivity, profile
    marker = 4093  # bytes: an allocation no model makes, between making the model and fn
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model = make_model()
        mark = torch.empty(marker, dtype=torch.uint8)
        del mark
        fn(model)
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    start = next(i for i, (_, n) in enumerate(events) if n == marker)
    base = sum(n for _, n in events[:start])
    held = peak = base
    for _, n in events[start:]:
        held += n
        peak = max(peak, held)
    return base, peak - base


def test_optimize_holds_at_most_one_blocks_new_banks_beside_the_model():
    """A model whose expert banks are nearly all of it, a shared expert
    fused into each block's banks (new banks of E + 1 experts): converting
    one block at a time, freeing what it replaces, optimize's peak is one
    block's new banks beside the model, not a second model."""
    def model():
        return make("qwen3_5_moe", hidden_size=256, moe_intermediate_size=256, shared_expert_intermediate_size=256,
                    num_experts=31, vocab_size=256, num_hidden_layers=2)
    total, peak = _peak_bytes(model, mps_ext.optimize)
    one_block = (256 * 2 * 256 + 256 * 256) * 4 * 32
    assert one_block > 0.4 * total
    print(f"\noptimize: model {total / 2**20:.1f} MiB, peak {peak / 2**20:.1f} MiB beyond it "
          f"({(total + peak) / total:.2f}x the model), one block's new banks {one_block / 2**20:.1f} MiB")
    assert peak <= one_block + (2 << 20)


# ----------------------------------------------------------- a Mac's generate --
def test_a_cache_recording_its_past_keeps_the_fused_decode(monkeypatch):
    """On MPS, transformers defers generate's stop check by a step and, for
    a cache the caller gets back, records the recurrent layers' past so it
    can undo that step (DeferredStopCheck; only caches without recurrent
    states, so LFM2's short convolutions, not the Gated DeltaNet). Simulated
    on the CPU by deciding as transformers does for MPS: the short
    convolution's decode still runs its kernel, and the tokens are the stock
    model's."""
    from transformers.generation import utils as gen
    monkeypatch.setattr(gen.DeferredStopCheck, "is_supported", staticmethod(
        lambda device, cache, cache_is_returned, is_assistant: not is_assistant
        and (cache is None or cache.is_croppable or not cache_is_returned)))

    class HostEvent:  # the CPU has no torch.Event; its ops are done when they return
        def __init__(self, **kwargs):
            pass

        def record(self):
            pass

        def synchronize(self):
            pass

    monkeypatch.setattr(torch, "Event", HostEvent)
    recorded = []
    own_init = gen.DeferredStopCheck.__init__

    def init(self, input_ids, max_length, cache, cache_is_returned, *args, **kwargs):
        own_init(self, input_ids, max_length, cache, cache_is_returned, *args, **kwargs)
        recorded.append(self.cache is not None)

    monkeypatch.setattr(gen.DeferredStopCheck, "__init__", init)
    for name, op in (("lfm2_moe", "short_conv_decode"), ("lfm2", "short_conv_decode")):
        stock = build(name)
        model = mps_ext.optimize(copy.deepcopy(stock))
        want = generate(stock, return_dict_in_generate=True)
        with run_model(RELEASE) as report:
            got = generate(model, return_dict_in_generate=True)
        family = next(f for f in report.families.values() if f"mps_ext::{op}" in f.ops)
        assert family.ops[f"mps_ext::{op}"].ran > 0, name
        assert torch.equal(got.sequences, want.sequences), name
    assert len(recorded) >= 4 and all(recorded)  # each generate (optimize's episode too) recorded its past
