"""Compiling MSL: kernel names, errors mapped to the shader, defines, cache."""

import json
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

import mps_ext_executor as cpu_metal
from tests.cpu_metal.conftest import KERNELS


def test_function_names_include_host_name_instantiations(kernels):
    assert kernels("rounding").function_names == [
        "to_half_and_bfloat", "mul_add_half", "mul_add_bfloat", "vector_rounding"]
    assert set(kernels("matrix").function_names) == {"matmul_float", "matmul_half", "matmul_bfloat",
                                                     "transpose_load"}


def test_template_without_instantiation_is_not_a_kernel():
    lib = cpu_metal.compile_library("""
#include <metal_stdlib>
using namespace metal;
template <typename T> kernel void t(device T* x [[buffer(0)]]) { x[0] = 1; }
kernel void plain(device float* x [[buffer(0)]]) { x[0] = 1; }
""", filename="names.metal")
    assert lib.function_names == ["plain"]


def test_kernels_in_namespaces_and_macro_instantiations():
    lib = cpu_metal.compile_library("""
#include <metal_stdlib>
using namespace metal;
namespace ops {
template <typename T, int N>
kernel void fill(device T* x [[buffer(0)]], uint i [[thread_position_in_grid]]) { x[i] = T(N); }
#define INSTANTIATE(name, T, N) \\
  template [[host_name(#name)]] kernel decltype(fill<T, N>) fill<T, N>;
INSTANTIATE(fill_f32_3, float, 3)
INSTANTIATE(fill_i32_7, int, 7)
}
""", filename="macros.metal")
    assert lib.function_names == ["fill_f32_3", "fill_i32_7"]
    x = torch.zeros(4)
    lib.dispatch("fill_f32_3", [x], threads=4, threads_per_threadgroup=4)
    assert x.tolist() == [3.0] * 4
    y = torch.zeros(4, dtype=torch.int32)
    lib.dispatch("fill_i32_7", [y], threads=4, threads_per_threadgroup=4)
    assert y.tolist() == [7] * 4


def test_defines_become_macros():
    src = """
#include <metal_stdlib>
using namespace metal;
kernel void k(device float* x [[buffer(0)]], uint i [[thread_position_in_grid]]) { x[i] = N * SCALE; }
"""
    x = torch.zeros(2)
    cpu_metal.compile_library(src, defines={"N": 4, "SCALE": 0.5}).dispatch("k", [x], threads=2,
                                                                             threads_per_threadgroup=2)
    assert x.tolist() == [2.0, 2.0]
    cpu_metal.compile_library(src, defines={"N": 3, "SCALE": 2}).dispatch("k", [x], threads=2,
                                                                           threads_per_threadgroup=2)
    assert x.tolist() == [6.0, 6.0]


def test_compile_error_is_mapped_to_the_shader_source():
    src = "#include <metal_stdlib>\nusing namespace metal;\n\nkernel void k(device float* x [[buffer(0)]]) {\n" \
          "  x[0] = undefined_thing;\n}\n"
    with pytest.raises(cpu_metal.CompileError) as e:
        cpu_metal.compile_library(src, filename="broken.metal")
    assert "broken.metal:5:" in str(e.value)
    assert "undefined_thing" in str(e.value)
    d = e.value.diagnostics[0]
    assert (d.file, d.line, d.severity) == ("broken.metal", 5, "error")


def test_address_space_mismatch_fails_to_compile():
    with pytest.raises(cpu_metal.CompileError, match="address_space_mismatch.metal:13:.*no matching function"):
        cpu_metal.compile_library((KERNELS / "address_space_mismatch.metal").read_text(),
                                  filename="address_space_mismatch.metal")


def test_struct_copied_out_of_constant_and_device_memory_is_legal():
    # C++ has no copy constructor across address spaces; Metal copies.
    lib = cpu_metal.compile_library("""
#include <metal_stdlib>
using namespace metal;
struct P { float a; float b; };
float sum(P p) { return p.a + p.b; }
kernel void k(device float* out [[buffer(0)]], constant P& params [[buffer(1)]],
              device P* items [[buffer(2)]], uint i [[thread_position_in_grid]]) {
  P copy = params;
  P item = items[i];
  items[i] = copy;
  out[i] = sum(item) + sum(params);
}
""", filename="copies.metal")
    out = torch.zeros(2)
    items = torch.tensor([1.0, 2.0, 3.0, 4.0])
    lib.dispatch("k", [out, np.array([10.0, 20.0], dtype=np.float32).tobytes(), items], threads=2,
                 threads_per_threadgroup=2)
    assert out.tolist() == [33.0, 37.0]
    assert items.tolist() == [10.0, 20.0, 10.0, 20.0]


def test_unsupported_kernel_parameter_is_a_clear_error():
    with pytest.raises(cpu_metal.CompileError, match=r"parameter 'n' .* has no attribute"):
        cpu_metal.compile_library("""
#include <metal_stdlib>
using namespace metal;
kernel void k(device float* x [[buffer(0)]], uint n) { x[0] = n; }
""", filename="noattr.metal")


def test_build_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("MPS_EXT_CACHE_DIR", str(tmp_path))
    src = (KERNELS / "scan.metal").read_text() + "\n// cache test\n"
    t0 = time.perf_counter()
    a = cpu_metal.compile_library(src, filename="scan.metal")
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    b = cpu_metal.compile_library(src, filename="scan.metal")
    second = time.perf_counter() - t0
    assert a.path == b.path and a.path.startswith(str(tmp_path))
    assert second < first / 5
    assert len(list(tmp_path.glob("*/*/library.so"))) == 1
    # a different define is a different build
    cpu_metal.compile_library(src, defines={"X": 1}, filename="scan.metal")
    assert len(list(tmp_path.glob("*/*/library.so"))) == 2


def test_concurrent_builds_of_one_library_compile_it_once(tmp_path, monkeypatch):
    """Builders of the same library (threads here; the suite's worker
    processes share the cache the same way, flock locks being per open file)
    wait for the first one's build and load it, instead of compiling it
    beside it."""
    from mps_ext_executor import _compiler
    monkeypatch.setenv("MPS_EXT_CACHE_DIR", str(tmp_path))
    src = (KERNELS / "scan.metal").read_text() + "\n// concurrent build test\n"
    compiles = []
    preprocess = _compiler.preprocess  # the first step of every build that is not a cache hit

    def counting(*args, **kwargs):
        compiles.append(1)
        return preprocess(*args, **kwargs)

    monkeypatch.setattr(_compiler, "preprocess", counting)
    start = threading.Barrier(3)
    paths = []

    def build():
        start.wait()  # all three miss the cache together
        paths.append(cpu_metal.compile_library(src, filename="scan.metal").path)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(paths) == 3 and len(set(paths)) == 1
    assert len(compiles) == 1
    assert len(list(tmp_path.glob("*/*/library.so"))) == 1


def test_the_op_layer_builds_only_its_kernels_variant_in_another_math_mode(tmp_path, monkeypatch):
    """In the mode the process started in, the op layer's first launch of a
    kernel builds its whole library (one build every test shares); in a
    math_mode block, the kernel's variant, the text the Metal backend
    compiles for it alone (_compiler.op_layer_library)."""
    monkeypatch.setenv("MPS_EXT_CACHE_DIR", str(tmp_path))
    x, gate = torch.randn(4, 64), torch.randn(4, 64)
    want = x * torch.sigmoid(gate)

    def libraries_built():
        return sorted(sorted(k["name"] for k in json.loads(p.read_text())) for p in tmp_path.glob("*/*/kernels.json"))

    with cpu_metal.math_mode(contract=False):
        torch.testing.assert_close(torch.ops.mps_ext.sigmoid_gate(x, gate), want)
    assert libraries_built() == [["sigmoid_gate_f32"]]
    torch.testing.assert_close(torch.ops.mps_ext.sigmoid_gate(x, gate), want)
    assert libraries_built() == [["sigmoid_gate_bf16", "sigmoid_gate_f16", "sigmoid_gate_f32"], ["sigmoid_gate_f32"]]


def test_check_mode_passes_the_test_kernels():
    # *_mismatch.metal are the kernels a Metal compiler must reject
    files = [str(p) for p in sorted(KERNELS.glob("*.metal")) if not p.name.endswith("_mismatch.metal")]
    r = subprocess.run([sys.executable, "-m", "mps_ext_executor", "check", *files], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_check_mode_reports_an_address_space_mismatch():
    path = KERNELS / "address_space_mismatch.metal"
    r = subprocess.run([sys.executable, "-m", "mps_ext_executor", "check", str(path)], capture_output=True, text=True)
    assert r.returncode == 1
    assert f"{path}:13:" in r.stdout and f"{path}:14:" in r.stdout


LINT_CASES = {
    "double": ("kernel void k(device float* x [[buffer(0)]]) { double d = 1; x[0] = d; }", "Metal has no double"),
    "include": ("#include <cmath>\nkernel void k(device float* x [[buffer(0)]]) { x[0] = 1; }",
                "<cmath> is not a Metal header"),
    "pointer": ("kernel void k(float* x [[buffer(0)]]) { x[0] = 1; }", "without an address space"),
    "attribute": ("kernel void k(device float* x [[buffer(0)]], uint n) { x[0] = n; }", "has no attribute"),
    "mutual_recursion": ("float g(float x);\nfloat f(float x) { return x > 0 ? g(x - 1) : 0; }\n"
                         "float g(float x) { return f(x); }\n"
                         "kernel void k(device float* x [[buffer(0)]]) { x[0] = f(3); }",
                         "recursion is not allowed in Metal: f -> g -> f"),
}


@pytest.mark.parametrize("case", sorted(LINT_CASES))
def test_check_mode_lint(tmp_path, case):
    body, expected = LINT_CASES[case]
    path = tmp_path / f"{case}.metal"
    path.write_text("#include <metal_stdlib>\nusing namespace metal;\n" + body + "\n")
    r = subprocess.run([sys.executable, "-m", "mps_ext_executor", "check", str(path)], capture_output=True, text=True)
    assert r.returncode == 1
    assert expected in r.stdout
    assert f"{path}:" in r.stdout  # file:line


def test_a_constructor_in_a_template_signature_compiles():
    # c10/metal/utils.h's `common_dtype = decltype(U(0) + V(0))` in a function's return type: the translator
    # turns `U(0)` into a constructor call with a source site, whose default arguments (source-location
    # builtins) clang could not mangle ("cannot yet mangle expression type SourceLocExpr").
    lib = cpu_metal.compile_library("""
#include <metal_stdlib>
using namespace metal;
template <typename U, typename V> using common_dtype = decltype(U(0) + V(0));
template <typename T, typename U> common_dtype<T, U> add(T a, U b) { return a + b; }
kernel void sum_of(device float* out [[buffer(0)]], device const float2* a [[buffer(1)]]) {
  out[0] = add(a[0].x, int(a[0].y));
  float2 v = add(a[0], a[0]);
  out[1] = v.y;
}
""", filename="decltype_site.metal")
    out = torch.zeros(2)
    lib.dispatch("sum_of", [out, torch.tensor([[1.5, 2.0]])], threads=1)
    assert out.tolist() == [3.5, 4.0]


def test_threadgroup_array_sized_by_a_comparison():
    # `>` and `?:` inside a threadgroup array's size are a comparison, not a template's closing bracket: the
    # translator's declaration scan read them as brackets, ran past the end of the source and raised IndexError.
    lib = cpu_metal.compile_library("""
#include <metal_stdlib>
using namespace metal;
constant constexpr int N = 8;
kernel void staged(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  threadgroup float buf[N > 4 ? 8 : 4], tail[(N < 16) ? 2 : 1];
  buf[i] = float(i) + 0.5f;
  if (i < 2) tail[i] = float(sizeof(buf) / sizeof(float));
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[i] = buf[7 - i] + tail[i % 2];
}
""", filename="comparison_size.metal")
    out = torch.zeros(8)
    lib.dispatch("staged", [out], threads=8, threads_per_threadgroup=8)
    assert out.tolist() == [7.5 - i + 8 for i in range(8)]


def test_unterminated_threadgroup_declaration_is_a_compile_error():
    with pytest.raises(cpu_metal.CompileError, match="threadgroup"):
        cpu_metal.compile_library("kernel void k(device float* o [[buffer(0)]]) { threadgroup float t[4] }",
                                  filename="unterminated.metal")
