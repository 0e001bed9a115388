"""What the Mac backend compiles on a kernel's first call: its library's code
with that kernel's explicit instantiation alone (csrc/backend/launch.cpp,
variant_source; the table from tools/shader_variants.py). Linux has no Metal
compiler, so the executor stands in for it here: the variant table agrees
with clang's preprocessor, every variant's source defines exactly its kernel,
passes check mode, and runs to the same bits as the whole library."""

import functools
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import mps_ext
from mps_ext_executor import _compiler, _lint, _translate
from tools import shader_variants
from tools.embed_shaders import sources

ROOT = Path(__file__).resolve().parent.parent
LIBRARIES = sorted(sources())


def whole(library: str) -> str:
    """The library's embedded text (tools/embed_shaders.py's source): the executor's own builds of it are
    cached under it."""
    return sources()[library]


def variant_source(library: str, kernel: str) -> str:
    return mps_ext._C._variant_source(library, kernel)


@functools.lru_cache(maxsize=None)
def table(library: str) -> dict[str, str]:
    """Host name -> statement, as embedded."""
    return {k: s for site in shader_variants.sites(whole(library)) for k, s in site.kernels.items()}


def preprocessed_kernels(text: str, library: str) -> list[str]:
    """The kernels clang's preprocessor and the executor's reader find in `text`."""
    pre = _compiler.preprocess(text, f"{library}.metal", None)
    # A host name built by macros is adjacent string literals: "a" "b".
    return [re.sub(r'"\s*"', "", k.host_name).strip('"') for k in _translate.translate(pre).kernels]


def instantiations(preprocessed: str) -> dict[str, list[str]]:
    """Host name -> tokens, of the explicit instantiations in clang -E output."""
    code = "\n".join(line for line in preprocessed.splitlines() if not line.startswith("#"))
    found = {}
    for m in re.finditer(r"template\s*\[\[\s*host_name\s*\((.*?)\)\s*\]\].*?;", code, re.S):
        found["".join(re.findall(r'"([^"]*)"', m.group(1)))] = tokens(m.group(0))
    return found


def tokens(text: str) -> list[str]:
    return [t.text for t in shader_variants._tokens(text) if t.kind not in ("ws", "nl", "comment")]


@pytest.mark.parametrize("library", LIBRARIES)
def test_the_table_is_what_the_preprocessor_expands(library):
    # Every explicit instantiation of the whole library after clang -E, token
    # for token, is the table's statement of its host name, and no other; and
    # the executor finds no kernel outside them (a kernel that is not a
    # template would be compiled into every variant).
    expanded = instantiations(_compiler.preprocess(whole(library), f"{library}.metal", None))
    ours = table(library)
    assert expanded and sorted(expanded) == sorted(ours)
    assert {k: tokens(s) for k, s in ours.items()} == expanded
    assert sorted(preprocessed_kernels(whole(library), library)) == sorted(ours)


@pytest.mark.parametrize("library", LIBRARIES)
def test_every_variant_instantiates_its_kernel_alone(library):
    # All the variants through one clang -E (a variant redefines the
    # library's macros identically, which the preprocessor allows), each
    # after a marker line: a preprocessor run per variant would cost minutes.
    names = list(table(library))
    marker = "mps_ext_variant_boundary"
    text = "".join(f"{marker}\n{variant_source(library, k)}" for k in names)
    chunks = _compiler.preprocess(text, f"{library}.metal", None).split(marker)[1:]
    assert len(chunks) == len(names)
    wrong = {k: sorted(found) for k, chunk in zip(names, chunks) if sorted(found := instantiations(chunk)) != [k]}
    assert not wrong


@pytest.mark.parametrize("library", LIBRARIES)
def test_a_variant_passes_check_mode_and_keeps_its_lines(library):
    # Check mode (the lint and the address-space compile) costs about a second
    # a source: the library's last variant here; the others differ from it in
    # one statement, which the two tests above check for every variant.
    kernel = list(table(library))[-1]
    text = variant_source(library, kernel)
    assert text.count("\n") == whole(library).count("\n")
    # The textual include lint also sees the host-only <cstdint> of
    # shared_types.h (behind #ifdef __METAL_VERSION__), as it does in the
    # whole flattened library: nothing beyond that.
    assert _compiler.check_source(text, f"{library}.metal") == _lint.lint_includes(text, f"{library}.metal")


def test_what_has_no_variant_compiles_whole():
    assert variant_source("linear", "no_such_kernel") == ""
    assert variant_source("no_such_library", "gemv_rows_f32_r1_q1_vec") == ""


def test_the_splitter_refuses_what_it_cannot_expand_exactly():
    pasted = '#define I(n) template [[host_name("k_" #n)]] kernel decltype(k##n) k##n;\nI(1)\n'
    with pytest.raises(shader_variants.VariantError, match="##"):
        shader_variants.sites(pasted)
    other = '#define I(n) template [[host_name("k_" #n)]] kernel decltype(k<n>) k<n>; int x;\nI(1)\n'
    with pytest.raises(shader_variants.VariantError, match="other than explicit instantiations"):
        shader_variants.sites(other)
    twice = 'template [[host_name("k")]] kernel decltype(a<1>) a<1>;\ntemplate [[host_name("k")]] kernel ' \
            'decltype(a<2>) a<2>;\n'
    with pytest.raises(shader_variants.VariantError, match="twice"):
        shader_variants.sites(twice)


def test_the_splitter_expands_nested_and_variadic_calls():
    text = ('#define ONE(p, ...) template [[host_name(p "_x")]] kernel decltype(f<__VA_ARGS__>) f<__VA_ARGS__>;\n'
            '#define TWO(n, T) ONE(#n, T, 1) ONE(#n "_b", T, 2)\n'
            'int keep;\nTWO(half, half)\n')
    (site,) = shader_variants.sites(text)
    assert text[site.start:site.end] == "TWO(half, half)"
    assert {k: tokens(s) for k, s in site.kernels.items()} == {
        "half_x": tokens('template [[host_name("half" "_x")]] kernel decltype(f<half, 1>) f<half, 1>;'),
        "half_b_x": tokens('template [[host_name("half" "_b" "_x")]] kernel decltype(f<half, 2>) f<half, 2>;'),
    }


# --------------------------------------------------- same bits as the whole --
def run_both(library: str, kernel: str, make_args, **grid):
    """Outputs (the args make_args returns first) of `kernel` run from the
    whole library and from its variant's, on the same inputs."""
    import mps_ext_executor as cpu_metal

    results = []
    for text in (whole(library), variant_source(library, kernel)):
        lib = cpu_metal.compile_library(text, filename=f"{library}.metal")
        assert kernel in lib.function_names
        args = make_args()
        lib.dispatch(kernel, args, **grid)
        results.append(args[0])
    return results


def test_gemv_rows_from_its_variant_gives_the_whole_librarys_bits():
    n, k = 64, 256
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, k, generator=g).to(torch.bfloat16)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    fields = ["rows", "n_out", "k", "x_row_stride", "x_k_stride", "w_n_stride", "w_k_stride", "y_row_stride",
              "y_n_stride", "bias_row_stride", "bias_n_stride"]
    dtype = [(f, "<i8") for f in fields] + [("alpha", "<f4"), ("beta", "<f4"), ("has_bias", "<u4"), ("splits", "<u4")]
    p = np.array([(1, n, k, k, 1, k, 1, n, 1, 0, 0, 1.0, 0.0, 0, 1)], dtype=dtype)[0]

    def args():
        y = torch.full((1, n), float("nan"), dtype=torch.bfloat16)
        return [y, x, w, p, y]

    # One output per simdgroup, two simdgroups a threadgroup (the kernel's
    # first output is (group * simdgroups + sg) * Q).
    whole, variant = run_both("linear", "gemv_rows_bf16_r1_q1_vec", args, threadgroups=(n // 2,),
                              threads_per_threadgroup=(64,))
    assert torch.equal(whole.view(torch.int16), variant.view(torch.int16))
    ref = x.double() @ w.double().T  # the geometry is a real one: every output written, near the product
    assert torch.allclose(variant.double(), ref, rtol=2e-2, atol=2e-2)


def test_sigmoid_gate_from_its_variant_gives_the_whole_librarys_bits():
    rows, n = 3, 300
    g = torch.Generator().manual_seed(4)
    x = torch.randn(rows, n, generator=g).half()
    gate = torch.randn(rows, 2 * n, generator=g).half()
    p = np.array([(rows, n, 2 * n)], dtype=[("rows", "<u4"), ("n", "<u4"), ("gate_row_stride", "<u4")])[0]

    def args():
        return [torch.full((rows, n), float("nan"), dtype=torch.half), x, gate, p]

    whole, variant = run_both("attention_gate", "sigmoid_gate_f16", args, threadgroups=((n + 255) // 256, rows),
                              threads_per_threadgroup=(256, 1))
    assert torch.equal(whole.view(torch.int16), variant.view(torch.int16))
    ref = x.double() * torch.sigmoid(gate[:, :n].double())
    assert torch.allclose(variant.double(), ref, rtol=2e-3, atol=2e-3)


# ------------------------------------------------ the census's compile term --
def test_the_census_counts_variants_run_and_whole_libraries():
    from benchmarks import census, prefill

    calls = [census.Call("linear", 0, "compute", False, 0, 0, 0, ours=1, kernels={"gemv_rows_f32_r1_q1_vec": 1}),
             census.Call("linear", 1, "compute", False, 0, 0, 0, ours=2,
                         kernels={"gemv_rows_f32_r1_q1_vec": 1, "sigmoid_gate_f16": 1}),
             census.Call("mm", 1, "compute", False, 0, 0, 0)]  # torch's kernel: not ours
    run = prefill.functions_run(census.Trace(calls=calls))
    assert run == {"gemv_rows_f32_r1_q1_vec", "sigmoid_gate_f16"}
    # Before, a first call compiled every variant of its library: counted by the executor's reader.
    whole_count = sum(len(preprocessed_kernels(whole(lib), lib)) for lib in ("linear", "attention_gate"))
    assert prefill.whole_library_functions(run) == whole_count
    k = prefill.COMPILE_PER_FUNCTION
    assert [prefill.compile_s(2, w) for w in ("high", "central", "low")] == [2 * k.low, 2 * k.central, 2 * k.high]
