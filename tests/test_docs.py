"""The documentation against the code: README's family table is the op
registry's, user docs carry no tracker numbers, and every relative link
(and path a doc quotes) stays inside the repository and exists."""

import functools
import re
import sys
from pathlib import Path

import pytest
import torch

import mps_ext
from mps_ext import _C, _selfcheck

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# What a user reads: README and docs/ without docs/dev/ (contributors' notes
# may say which change a measurement belongs to).
USER_DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
ALL_DOCS = [README, ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]


# ------------------------------------------------------------ family table --
def markdown_table(text: str, first_header: str) -> list[list[str]]:
    """The rows (cells stripped) of the first markdown table whose first
    header cell is `first_header`, header row included."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] == first_header:
            rows = [cells]
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                rows.append([c.strip() for c in row.strip().strip("|").split("|")])
            return rows
    raise AssertionError(f"no table with first header {first_header!r}")


def code_names(cell: str) -> set[str]:
    """The `code` spans of a cell: the names it lists."""
    return set(re.findall(r"`([^`]+)`", cell))


def readme_families() -> dict[str, dict[str, set[str]]]:
    """README's family table: {family: {column: names}}."""
    rows = markdown_table(README.read_text(), "family")
    header = rows[0]
    assert header == ["family", "what it covers", "aten ops it overrides on MPS", "its own ops (torch.ops.mps_ext)"]
    out = {}
    for cells in rows[1:]:
        (name,) = code_names(cells[0])
        assert name not in out, f"README lists the family {name} twice"
        out[name] = {"aten": code_names(cells[2]), "own": code_names(cells[3])}
    return out


def _placeholder(arg: torch._C.Argument):
    """A value of the argument's type: the calls below stop at the family's
    switch, before any kernel reads them."""
    kind = str(arg.type)
    if kind.startswith("Optional"):
        return None
    return {"Tensor": torch.zeros(1), "int": 1, "float": 1.0, "bool": False, "str": "",
            "List[int]": [1], "SymInt": 1, "List[SymInt]": [1]}[kind]


def own_ops() -> list[str]:
    """torch.ops.mps_ext's ops that are not an aten op of any family (their
    schemas are mps_ext's own) and have kernels of the op layer (a CPU
    kernel: the executor's); not the Python composites of mps_ext/fp8.py,
    which call the families' ops."""
    aten = {op.removeprefix("aten::").split(".")[0] for fam in mps_ext.families() for op in _C.family_aten_ops(fam)}
    names = {n.split("::")[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names() if n.startswith("mps_ext::")}
    return sorted(n for n in names - aten if torch._C._dispatch_has_kernel_for_dispatch_key(f"mps_ext::{n}", "CPU"))


@functools.cache
def _self_check_calls() -> list[tuple[object, tuple]]:
    return [(case.op, case.args) for case in _selfcheck.cases()]


def family_of(op: str) -> str | None:
    """The family whose switch `torch.ops.mps_ext.<op>` obeys, as the
    registry routes it: with every family off, a call is counted as a
    fallback of its family (and refused, for an op torch has no kernel
    for). Called with placeholder arguments, or, for an op that checks its
    inputs before it routes, with the self-check's arguments for it.
    None: it obeys no switch (it ran, counted nowhere)."""
    packet = getattr(torch.ops.mps_ext, op)
    overload = getattr(packet, packet.overloads()[0])
    placeholders = tuple(_placeholder(a) for a in overload._schema.arguments if not a.has_default_value())
    for args in [placeholders] + [args for fn, args in _self_check_calls() if fn is packet]:
        before = {f: sum(s["fallbacks"].values()) for f, s in mps_ext.stats().items()}
        with mps_ext.disabled():
            try:
                packet(*args)
            except RuntimeError as e:
                if "turned off" not in str(e):
                    continue  # refused these arguments before its switch
        grew = [f for f, s in mps_ext.stats().items() if sum(s["fallbacks"].values()) > before[f]]
        assert len(grew) <= 1, f"{op}: counted in {grew}"
        return grew[0] if grew else None
    raise AssertionError(f"{op} checks its arguments before its family's switch, and mps_ext/_selfcheck.py has "
                         f"no case that calls it")


def test_the_readme_family_table_is_the_registrys():
    """Its rows are mps_ext.families(); each row's aten ops are the ones
    the family overrides (_C.family_aten_ops, without 'aten::'), and its own
    ops the torch.ops.mps_ext ops that obey the family's switch."""
    assert mps_ext.families(), mps_ext.unavailable_reason()
    table = readme_families()
    assert sorted(table) == mps_ext.families()
    owners = {op: family_of(op) for op in own_ops()}
    for fam, cols in table.items():
        assert cols["aten"] == {op.removeprefix("aten::") for op in _C.family_aten_ops(fam)}, fam
        assert cols["own"] == {op for op, f in owners.items() if f == fam}, fam


def test_every_own_op_but_commit_obeys_a_family_switch():
    """The check above sees the registry: an op counted in no family (it
    runs with every family off) is only the stream's commit, which launches
    no kernel."""
    assert {op for op in own_ops() if family_of(op) is None} == {"commit"}


def test_the_family_table_check_sees_a_wrong_row(tmp_path, monkeypatch):
    """A README whose table lists an op under the wrong family fails."""
    text = README.read_text()
    first = next(f for f in mps_ext.families() if _C.family_aten_ops(f))
    op = _C.family_aten_ops(first)[0].removeprefix("aten::")
    assert f"`{op}`" in text
    planted = tmp_path / "README.md"
    planted.write_text(text.replace(f"`{op}`", "`not_an_op`", 1))
    monkeypatch.setattr(sys.modules[__name__], "README", planted)
    with pytest.raises(AssertionError):
        test_the_readme_family_table_is_the_registrys()


# ----------------------------------------------------------- decode tables --
@pytest.fixture(scope="module")
def decode_rows():
    """Every model's census at one token after mps_ext.optimize."""
    from benchmarks import bench_decode
    models, _ = bench_decode.models_for("full")
    return bench_decode.census_rows(models, (1,), bench_decode.CONTEXT, mps_ext.optimize)


@pytest.fixture(scope="module")
def decode_blocks(decode_rows):
    """What `python -m benchmarks decode --optimize --write-docs` writes."""
    from benchmarks import bench_decode
    models, _ = bench_decode.models_for("full")
    return bench_decode.doc_blocks(decode_rows, bench_decode.stop_check_loops(models))


def test_the_decode_what_ifs_take_out_the_dispatches_they_name(decode_rows):
    """The decode benchmark's what-ifs (what issue 31 has left): point 5's
    fusions are all done (the routing in the experts' gate/up kernel,
    moe_gate_up_routed; the output gate in o_proj's GEMV,
    sigmoid_gate_linear; eager, the rotary tables as one gather), so no
    what-if takes out dispatches: all of them together leave today's
    dispatches, and eager, the calls before the layers are the embedding,
    the positions the model makes (arange, add) and the rotary gather."""
    from benchmarks import bench_decode, census
    _, table = bench_decode.what_if(decode_rows)
    assert {(r["model"], r["mode"]) for r in table} == {(m, mode) for m in census.MODELS for mode in census.MODES}
    for r in table:
        def cell(label):
            tok, dispatches = r[label].rstrip(")").split(" (")
            return float(tok), float(dispatches)

        assert not any(label.startswith("5: ") for label in r)
        assert cell("all")[1] == cell("as today")[1]
        if r["mode"] != "eager":
            assert r["4: one host call a decoder layer"] == "-"
    for row in decode_rows:
        if row.tokens == 1 and row.who in bench_decode.OPTIMIZED_ROWS and row.mode == "eager":
            pre = sum(op.counts.dispatches for op in row.make().ops if op.where == "pre")
            assert pre <= 4, (row.model, pre)


def test_the_decode_tables_are_the_benchmarks(decode_blocks):
    """README's and docs/decode.md's decode figures are the benchmark's
    output, to the character (regenerate them with --write-docs)."""
    from benchmarks import bench_decode
    for rel, names in bench_decode.DOCS.items():
        written = bench_decode.blocks_in((ROOT / rel).read_text(), names)
        for name in names:
            assert written[name] == decode_blocks[name], (
                f"{rel}: the {name} table is not the benchmark's: python -m benchmarks decode --optimize --write-docs")


def test_the_readme_prefill_table_is_the_benchmarks():
    """README's time-to-first-token table is the prefill census's output
    (every model, a 4096-token prompt, torch 2.15, stock and after
    mps_ext.optimize, bf16 and fp8), to the character (regenerate it with
    python -m benchmarks prefill --optimize --write-docs)."""
    from benchmarks import bench_decode, bench_prefill
    blocks = bench_prefill.doc_blocks(bench_prefill.doc_rows(mps_ext.optimize))
    for rel, names in bench_prefill.DOCS.items():
        written = bench_decode.blocks_in((ROOT / rel).read_text(), names, bench_prefill.DOC_COMMAND)
        for name in names:
            assert written[name] == blocks[name], (
                f"{rel}: the {name} table is not the benchmark's: {bench_prefill.DOC_COMMAND}")


def test_the_long_context_table_is_the_benchmarks():
    from benchmarks import bench_decode, release_sdpa
    for rel, names in release_sdpa.DOCS.items():
        written = bench_decode.blocks_in((ROOT / rel).read_text(), names, release_sdpa.DOC_COMMAND)
        assert written["long context"] == "\n" + release_sdpa.table() + "\n", (
            f"{rel}: the long-context table is not the benchmark's: {release_sdpa.DOC_COMMAND}")


def test_write_docs_rewrites_only_the_blocks_and_says_which_files(tmp_path):
    """--write-docs puts each block between its markers and leaves the rest
    of the file; a file whose blocks are current is not rewritten; a doc
    without a block's markers is an error naming it."""
    from benchmarks import bench_decode
    (tmp_path / "docs").mkdir()
    texts = {}
    for rel, names in bench_decode.DOCS.items():
        texts[rel] = (ROOT / rel).read_text()
        (tmp_path / rel).write_text(texts[rel])
    current = {n: b for rel, names in bench_decode.DOCS.items()
               for n, b in bench_decode.blocks_in(texts[rel], names).items()}
    assert bench_decode.write_docs(current, tmp_path) == []
    changed = dict(current, summary="| a |\n|---|\n| 1 |")
    assert bench_decode.write_docs(changed, tmp_path) == ["docs/decode.md"]
    after = (tmp_path / "docs/decode.md").read_text()
    assert bench_decode.blocks_in(after, ["summary"]) == {"summary": "| a |\n|---|\n| 1 |"}
    assert after.replace("| a |\n|---|\n| 1 |", current["summary"]) == texts["docs/decode.md"]
    with pytest.raises(ValueError, match="no generated block 'readme'"):
        bench_decode.blocks_in("no markers", ["readme"])


# ---------------------------------------------------------- tracker numbers --
# "issue 31", "issues 19 and 21", "(issue 32, point 5)", "(branch regs20)":
# this project's tracker and branches mean nothing to a user. Upstream
# reports name their project ("pytorch issue 82707", "jundot/omlx issue
# 2238", "pytorch#163597") and are citations, not history.
TRACKER = re.compile(r"\bissues?\s+#?\d+|\bpoints?\s+\d+\s+of\b|\((?:on )?branch [\w-]+\)",
                     re.IGNORECASE | re.MULTILINE)
UPSTREAM = re.compile(r"\b(pytorch|torch|[\w.-]+/[\w.-]+)\s+$", re.IGNORECASE)


def tracker_mentions(text: str) -> list[str]:
    out = []
    for m in TRACKER.finditer(text):
        if UPSTREAM.search(text[max(0, m.start() - 60):m.start()]):
            continue
        out.append(f"line {text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}")
    return out


@pytest.mark.parametrize("path", USER_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_user_docs_cite_no_tracker_numbers(path):
    assert tracker_mentions(path.read_text()) == []


def test_the_tracker_check_sees_ours_and_lets_upstream_through():
    assert tracker_mentions("## Before and after (issue 20)\n") and tracker_mentions("what issue 31's points buy")
    assert tracker_mentions("## Registers (branch regs20)\n") and tracker_mentions("point 4 of issue 31")
    assert tracker_mentions("(issues 19 and 21)") and tracker_mentions("on branch x (on branch regs20b)")
    assert not tracker_mentions("a command buffer ~10 us (pytorch issue 82707), jundot/omlx issue 2238")
    assert not tracker_mentions("the cross-device branch of copy_; issue pytorch#163597; 16 points 2 ways")


# -------------------------------------------------------------------- links --
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
# A relative path a doc quotes in code: `../shared/DESIGN.md`.
QUOTED_PATH = re.compile(r"`(\.{1,2}/[^`\s]+)`")


def link_problems(path: Path, root: Path = ROOT) -> list[str]:
    """Relative links of the markdown file `path` that leave the repository
    `root` or name no file, and relative paths it quotes in code that name
    no file of the repository (read from the doc's folder or from the root:
    `../shared/DESIGN.md` written at the root is a file beside the
    checkout); URLs and in-page anchors are not checked."""
    text = path.read_text()
    out = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:|#", target):
            continue
        resolved = (path.parent / target.split("#")[0]).resolve()
        if not resolved.is_relative_to(root):
            out.append(f"{target}: outside the repository")
        elif not resolved.exists():
            out.append(f"{target}: no such file")
    for quoted in QUOTED_PATH.findall(text):
        if not any(p.is_relative_to(root) and p.exists() for p in ((path.parent / quoted).resolve(),
                                                                   (root / quoted).resolve())):
            out.append(f"{quoted}: not a file of the repository")
    return out


@pytest.mark.parametrize("path", ALL_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve_inside_the_repository(path):
    assert link_problems(path) == []


def test_the_link_check_sees_a_missing_file_and_a_path_outside(tmp_path):
    (tmp_path / "docs" / "dev").mkdir(parents=True)
    for name in ("README.md", "docs/decode.png", "docs/dev/policy.md"):
        (tmp_path / name).write_text("")
    doc = tmp_path / "docs" / "x.md"
    doc.write_text("[a](dev/nothing.md) [b](https://example.com) [c](#top) [d](dev/policy.md#fp8) "
                   "![e](decode.png) `../../shared/DESIGN.md` [f](../README.md) `./dev/policy.md` `../README.md`")
    assert link_problems(doc, tmp_path) == ["dev/nothing.md: no such file",
                                            "../../shared/DESIGN.md: not a file of the repository"]
