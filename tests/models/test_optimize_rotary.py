"""mps_ext.optimize's rotary pass on transformers 5's Qwen3.5-MoE (mrope
sections) and LFM2-MoE (tiny random configs, CPU): each table row is the
rotary module's own output at that position, bit for bit; the gather runs
where the text model makes its positions below the table's end (mrope's
sections one row expanded), and the module's own forward everywhere else
(given position_ids, a position past the table, other sections, a padded
generate, torch.compile); generate's tokens and logits are the model's
without the pass; copies keep the table, casts and moves drop it, and the
state dict never holds it."""

import copy
import io

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mps_ext
from mps_ext.passes import rotary as rot
from mps_ext.passes.rotary import RotaryPositionsMixin, RotaryTableMixin
from model_compare import without_passes
from test_optimize import COMMON, make

NAMES = ["qwen3_5_moe", "lfm2_moe"]
P = COMMON["max_position_embeddings"]


def rotary_of(model):
    text = model.model
    return text.rotary_emb if hasattr(text, "rotary_emb") else text.pos_emb


def without_rotary(monkeypatch, model):
    """mps_ext.optimize(model) with every pass but this one: the test's
    "before"."""
    with monkeypatch.context() as m:
        without_passes(m, "rotary")
        return mps_ext.optimize(model)


class _Ops(TorchDispatchMode):
    """The aten calls made inside the rotary module's forward."""

    def __init__(self, module):
        super().__init__()
        self.inside, self.names = False, []
        self.handles = [module.register_forward_pre_hook(lambda m, a: setattr(self, "inside", True)),
                        module.register_forward_hook(lambda m, a, o: setattr(self, "inside", False))]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.inside:
            self.names.append(func._schema.name)  # the op without its overload
        return func(*args, **(kwargs or {}))

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        return super().__exit__(*exc)


def gathered(names) -> bool:
    """The module's calls were the table's gather: aten.index (beside views:
    Qwen3.5's sections' first row), no cos or sin."""
    return "aten::index" in names and not {"aten::cos", "aten::sin"} & set(names)


def own_forward(module, x, pos):
    return rot.original_class(type(module)).forward(module, x, pos)


# ----------------------------------------------------------- the table --
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", NAMES)
def test_every_table_row_is_the_modules_output(name, dtype):
    """Row p of the table is the module's own forward at a decode step of
    position p (one token), for every p, bit for bit; and the summary says
    what it made."""
    model = mps_ext.optimize(make(name, dtype))
    module = rotary_of(model)
    assert isinstance(module, RotaryTableMixin) and isinstance(model.model, RotaryPositionsMixin)
    table = module._mps_ext_table()
    width = 2 * module.inv_freq.numel()
    assert table.shape == (2, P, width) and table.dtype == dtype
    x = torch.empty(1, 1, 0, dtype=dtype)
    with torch.no_grad():
        for p in range(P):
            cos, sin = own_forward(module, x, torch.tensor([[p]]))
            assert torch.equal(table[0, p], cos[0, 0]) and torch.equal(table[1, p], sin[0, 0]), p
    (what,) = model.optimize_summary["rotary"].converted.values()
    assert f"at {P} positions" in what and "generate lets the model make them" in what
    assert "_mps_ext_rope_table" not in str(list(model.state_dict()))


@pytest.mark.parametrize("name", NAMES)
def test_a_forward_without_positions_takes_the_gather_and_gives_the_models_logits(monkeypatch, name):
    """Prefill and decode steps without position_ids: the module's call is
    one aten.index; the logits are the model's without the pass, bit for
    bit."""
    model = make(name)
    apart = without_rotary(monkeypatch, copy.deepcopy(model))
    mps_ext.optimize(model)
    prompt = torch.randint(1, COMMON["vocab_size"], (2, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for m in (apart, model):
            with _Ops(rotary_of(m)) as ops:
                out = m(prompt, use_cache=True)
                logits = [out.logits]
                for _ in range(3):
                    out = m(logits[-1][:, -1:].argmax(-1), past_key_values=out.past_key_values, use_cache=True)
                    logits.append(out.logits)
            m.got, m.ops = logits, ops.names
    assert gathered(model.ops) and model.ops.count("aten::index") == 4
    assert {n for n in model.ops if n != "aten::index"} <= {"aten::select"}  # the rest are views
    assert "aten::cos" in apart.ops
    for g, w in zip(model.got, apart.got):
        assert torch.equal(g, w)


def test_mrope_sections_take_the_gather_only_as_one_row_expanded():
    """Qwen3.5's module takes position_ids [3, B, T] (temporal, height,
    width): the table's rows where the three are one row expanded (stride
    0, as the text model makes them), its own forward for three rows that
    differ; each equal to its own forward."""
    model = mps_ext.optimize(make("qwen3_5_moe"))
    module = rotary_of(model)
    x = torch.empty(2, 3, 0)
    row = torch.tensor([[4, 5, 6], [7, 8, 9]])
    differ = torch.stack([row, row + 1, row + 2])
    for pos, gather in ((row[None].expand(3, -1, -1), True), (differ, False)):
        want = own_forward(module, x, pos)
        module.__dict__["_mps_ext_bound"] = (10, 3)  # the text model's word: positions below 10
        with torch.no_grad(), _Ops(module) as ops:
            got = module(x, pos)
        assert gathered(ops.names) == gather
        assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_a_call_the_text_model_did_not_bound_runs_the_modules_forward():
    """The module called by itself (no bound), or with a bound above the
    table's end: its own forward."""
    module = rotary_of(mps_ext.optimize(make("lfm2_moe")))
    x, pos = torch.empty(1, 1, 0), torch.tensor([[3]])
    for bound in (None, (P + 1, 1)):
        if bound is not None:
            module.__dict__["_mps_ext_bound"] = bound
        with torch.no_grad(), _Ops(module) as ops:
            got = module(x, pos)
        assert not gathered(ops.names) and "aten::cos" in ops.names
        assert all(torch.equal(g, w) for g, w in zip(got, own_forward(module, x, pos)))
        assert "_mps_ext_bound" not in module.__dict__


@pytest.mark.parametrize("name", NAMES)
def test_positions_past_the_table_run_the_modules_forward(monkeypatch, name):
    """A prompt of P - 2 tokens and decode steps past P: the gather while
    past + T <= P, then the module's own forward (never a read past the
    table); the logits are the model's without the pass."""
    model = make(name)
    apart = without_rotary(monkeypatch, copy.deepcopy(model))
    mps_ext.optimize(model)
    prompt = torch.randint(1, COMMON["vocab_size"], (1, P - 2), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        for m in (apart, model):
            steps = []
            out = m(prompt, use_cache=True)
            logits = [out.logits]
            for _ in range(4):  # positions P - 2, P - 1, P, P + 1
                with _Ops(rotary_of(m)) as ops:
                    out = m(logits[-1][:, -1:].argmax(-1), past_key_values=out.past_key_values, use_cache=True)
                logits.append(out.logits)
                steps.append(gathered(ops.names))
            m.got, m.steps = logits, steps
    assert model.steps == [True, True, False, False] and apart.steps == [False] * 4
    for g, w in zip(model.got, apart.got):
        assert torch.equal(g, w)


@pytest.mark.parametrize("name", NAMES)
def test_given_position_ids_run_the_modules_forward(monkeypatch, name):
    model = make(name)
    apart = without_rotary(monkeypatch, copy.deepcopy(model))
    mps_ext.optimize(model)
    prompt = torch.randint(1, COMMON["vocab_size"], (1, 4), generator=torch.Generator().manual_seed(3))
    positions = torch.tensor([[0, 1, 2, 70]])  # one past the table: a caller's positions are its own
    with torch.no_grad():
        want = apart(prompt, position_ids=positions).logits
        with _Ops(rotary_of(model)) as ops:
            got = model(prompt, position_ids=positions).logits
    assert not gathered(ops.names) and "aten::cos" in ops.names
    assert torch.equal(got, want)


# ----------------------------------------------------------- generate --
class _Gathers:
    """How many calls of the module took the gather."""

    def __init__(self, monkeypatch):
        self.n = 0
        own = RotaryTableMixin._mps_ext_rows

        def counted(module, *args):
            rows = own(module, *args)
            self.n += rows is not None
            return rows
        monkeypatch.setattr(RotaryTableMixin, "_mps_ext_rows", counted)


@pytest.mark.parametrize("name", NAMES)
def test_generate_gives_the_models_tokens_and_logits(monkeypatch, name):
    """Greedy generate, a prompt without padding: generate lets the model
    make its positions and every forward takes the gather; a left-padded
    batch: generate's positions, the module's own forward. Tokens and
    logits are the model's without the pass, bit for bit."""
    model = make(name)
    apart = without_rotary(monkeypatch, copy.deepcopy(model))
    mps_ext.optimize(model)
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(2, COMMON["vocab_size"], (2, 6), generator=g)
    padded = torch.ones_like(prompt)
    padded[1, :2] = 0
    tokens = 5
    for mask, forwards in ((torch.ones_like(prompt), tokens), (padded, 0)):
        gathers = _Gathers(monkeypatch)
        outs = []
        for m in (apart, model):
            with torch.no_grad():
                outs.append(m.generate(prompt, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens,
                                       do_sample=False, pad_token_id=0, output_logits=True,
                                       return_dict_in_generate=True))
        want, got = outs
        assert gathers.n == forwards
        assert torch.equal(got.sequences, want.sequences)
        for a, b in zip(got.logits, want.logits):
            assert torch.equal(a, b)


# ----------------------------------------------------------- copies, casts --
def test_copies_keep_the_table_casts_drop_it(monkeypatch):
    """deepcopy and torch.save + load keep the table and its tag (no table
    made again); .to(dtype) drops it (the module's own forward, not the
    old dtype's rows), and optimize makes it again; the state dict holds
    no table."""
    model = mps_ext.optimize(make("qwen3_5_moe"))
    keys = set(model.state_dict())
    monkeypatch.setattr(rot, "_make_table", lambda *a: pytest.fail("a copy made its table again"))
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    for other in (copy.deepcopy(model), torch.load(buf, weights_only=False)):
        module = rotary_of(other)
        table = module._mps_ext_table()
        assert table is not None and torch.equal(table, rotary_of(model)._mps_ext_table())
        assert table.untyped_storage().data_ptr() != rotary_of(model)._mps_ext_table().untyped_storage().data_ptr()
        assert set(other.state_dict()) == keys
    monkeypatch.undo()
    cast = copy.deepcopy(model).to(torch.bfloat16)
    module = rotary_of(cast)
    assert module._mps_ext_table() is None and "_mps_ext_rope_table" not in module._buffers
    x, pos = torch.empty(1, 1, 0, dtype=torch.bfloat16), torch.tensor([[5]])
    module.__dict__["_mps_ext_bound"] = (6, 1)
    with torch.no_grad(), _Ops(module) as ops:
        got = module(x, pos)
    assert "aten::cos" in ops.names and all(torch.equal(g, w) for g, w in zip(got, own_forward(module, x, pos)))
    mps_ext.optimize(cast)
    assert list(cast.optimize_summary["rotary"].converted) == ["model.rotary_emb"]
    assert module._mps_ext_table().dtype == torch.bfloat16
    assert not any("_mps_ext" in k for k in cast.state_dict())


def test_a_changed_inv_freq_runs_the_modules_forward():
    """Another inv_freq (assigned, as transformers' dynamic rope does, or
    changed in place) or attention scaling: the table is not used."""
    for change in ("assign", "in place", "scaling"):
        model = mps_ext.optimize(make("lfm2_moe"))
        module = rotary_of(model)
        if change == "assign":
            module.inv_freq = module.inv_freq * 0.5
        elif change == "in place":
            module.inv_freq.mul_(0.5)
        else:
            module.attention_scaling = 0.5
        assert module._mps_ext_table() is None, change
        x, pos = torch.empty(1, 1, 0), torch.tensor([[5]])
        module.__dict__["_mps_ext_bound"] = (6, 1)
        with torch.no_grad():
            got = module(x, pos)
        assert all(torch.equal(g, w) for g, w in zip(got, own_forward(module, x, pos))), change


def test_left_with_the_reason():
    """A rope type that recomputes its frequencies, a table above the cap."""
    model = make("lfm2_moe")
    rotary_of(model).rope_type = "dynamic"
    mps_ext.optimize(model)
    assert "recomputes its frequencies" in model.optimize_summary["rotary"].left["model.pos_emb"]
    model = make("lfm2_moe", max_position_embeddings=rot.MAX_TABLE_BYTES)
    mps_ext.optimize(model)
    assert "above the 128 MiB" in model.optimize_summary["rotary"].left["model.pos_emb"]
    assert not isinstance(rotary_of(model), RotaryTableMixin)


# ----------------------------------------------------------- torch.compile --
def test_compiled_model_has_no_graph_break_from_the_pass(monkeypatch):
    """Compiled, the module's own forward (Inductor fuses it): dynamo's
    explain finds the graph breaks the model without the pass has, no
    more, none in this pass's code."""
    model = make("qwen3_5_moe")
    apart = without_rotary(monkeypatch, copy.deepcopy(model))
    mps_ext.optimize(model)
    prompt = torch.randint(1, COMMON["vocab_size"], (1, 4), generator=torch.Generator().manual_seed(5))
    counts = []
    for m in (apart, model):
        torch._dynamo.reset()
        with torch.no_grad():
            explained = torch._dynamo.explain(m)(prompt, use_cache=True)
        counts.append(explained.graph_break_count)
        assert not any("rotary.py" in str(r) for r in explained.break_reasons)
    assert counts[1] == counts[0]
    torch._dynamo.reset()
