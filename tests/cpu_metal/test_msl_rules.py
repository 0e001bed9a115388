"""Check mode rejects what Apple's Metal compiler rejects (executor/mps_ext_executor/
_lint.py and the C++14 address-space compile): for every rule, a shader with
that bug fails with a message naming the rule and the line (marked `// BUG`),
and a valid variant of it passes."""

from pathlib import Path

import numpy as np
import pytest
import torch

import mps_ext_executor as cpu_metal
from mps_ext_executor import _lint
from mps_ext_executor._compiler import check_file

ROOT = Path(__file__).resolve().parents[2]
HEAD = "#include <metal_stdlib>\nusing namespace metal;\n"
K = "kernel void k(device float* x [[buffer(0)]], uint i [[thread_position_in_grid]])"

# case -> (shader with the bug, a valid variant). The case name starts with the rule.
CASES = {
    "std-header": ("#include <cmath> // BUG\n" + K + " { x[i] = 1; }", K + " { x[i] = 1; }"),
    "double": (
        K + " {\n  double d = x[i]; // BUG\n  x[i] = d * 2;\n}",
        K + " {\n  float d = x[i];\n  x[i] = d * 2;\n}",
    ),
    "long-long": (
        K + " {\n  long long n = long(x[i]); // BUG\n  x[i] = float(n);\n}",
        K + " {\n  long n = long(x[i]);\n  x[i] = float(n);\n}",
    ),
    "long-long:unsigned": (
        K + " {\n  unsigned long long n = ulong(x[i]); // BUG\n  x[i] = float(n);\n}",
        K + " {\n  ulong n = ulong(x[i]);\n  x[i] = float(n);\n}",
    ),
    "recursion": (
        "float g(float v);\nfloat f(float v) { return v > 0 ? g(v - 1) : 0; } // BUG\n"
        "float g(float v) { return f(v); }\n" + K + " { x[i] = f(3); }",
        "float g(float v) { return v; }\nfloat f(float v) { return v > 0 ? g(v - 1) : 0; }\n" + K + " { x[i] = f(3); }",
    ),
    # Overloads calling each other are not recursion; one function calling
    # itself is, free or member.
    "recursion:self": (
        "inline float halve(float v) { return v > 1 ? halve(v / 2) : v; } // BUG\n" + K + " { x[i] = halve(x[i]); }",
        "inline float halve(float v) { return v / 2; }\ninline float halve(half v) { return halve(float(v)); }\n"
        + K
        + " { x[i] = halve(half(x[i])); }",
    ),
    "recursion:member": (
        "struct C {\n  float h(float v) { return v > 0 ? h(v - 1) : 0; } // BUG\n};\n"
        + K
        + " { C c; x[i] = c.h(x[i]); }",
        "struct A { static float h(float v) { return v; } };\n"
        "struct C {\n  float h(float v) { return A::h(v); }\n  float h(half v) { return h(float(v)); }\n};\n"
        + K
        + " { C c; x[i] = c.h(x[i]) + c.h(half(1)); }",
    ),
    # Only recursion a kernel reaches: a function no kernel calls is never
    # compiled to GPU code (PyTorch's special_math.h has such templates). A
    # call through an object (`s.run(`) still reaches.
    "recursion:unreached": (
        "template <typename T> T fact(T v) { return v > 1 ? v * fact(v - 1) : T(1); } // BUG\n"
        "struct S { float run(float v) { return fact(v); } };\n" + K + " { S s; x[i] = s.run(x[i]); }",
        "template <typename T> T fact(T v) { return v > 1 ? v * fact(v - 1) : T(1); }\n"
        "struct S { float run(float v) { return v; } };\n" + K + " { S s; x[i] = s.run(x[i]); }",
    ),
    "kernel-param-attribute": (
        "kernel void k(device float* x [[buffer(0)]],\n uint i) { x[i] = 1; } // BUG",
        K + " { x[i] = 1; }",
    ),
    "pointer-address-space": (
        "kernel void k(float* x [[buffer(0)]], // BUG\n uint i [[thread_position_in_grid]]) { x[i] = 1; }",
        K + " { x[i] = 1; }",
    ),
    # Buffers are pointers or references (or arrays) into device or constant
    # memory, threadgroup arguments pointers or references into threadgroup
    # memory: none is passed by value.
    "kernel-argument-type": (
        "kernel void k(device float* x [[buffer(0)]],\n  float scale [[buffer(1)]], // BUG\n"
        "  uint i [[thread_position_in_grid]]) { x[i] *= scale; }",
        "kernel void k(device float* x [[buffer(0)]],\n  constant float& scale [[buffer(1)]],\n"
        "  uint i [[thread_position_in_grid]]) { x[i] *= scale; }",
    ),
    "kernel-argument-type:struct": (
        "struct P { float a, b; };\nkernel void k(device float* x [[buffer(0)]],\n  P p [[buffer(1)]], // BUG\n"
        "  uint i [[thread_position_in_grid]]) { x[i] = p.a * x[i] + p.b; }",
        "struct P { float a, b; };\nkernel void k(device float* x [[buffer(0)]],\n  constant P* p [[buffer(1)]],\n"
        "  uint i [[thread_position_in_grid]]) { x[i] = p->a * x[i] + p->b; }",
    ),
    "kernel-argument-type:threadgroup": (
        "kernel void k(device float* x [[buffer(0)]],\n  device float* t [[threadgroup(0)]], // BUG\n"
        "  uint i [[thread_position_in_threadgroup]]) { t[i] = x[i]; x[i] = t[0]; }",
        "kernel void k(device float* x [[buffer(0)]],\n  threadgroup float* t [[threadgroup(0)]],\n"
        "  uint i [[thread_position_in_threadgroup]]) { t[i] = x[i];\n"
        "  threadgroup_barrier(mem_flags::mem_threadgroup);\n  x[i] = t[0]; }",
    ),
    "program-scope-variable": (
        "float scale = 2.0f; // BUG\n" + K + " { x[i] *= scale; }",
        "constant float scale = 2.0f;\n" + K + " { x[i] *= scale; }",
    ),
    # A lookup table with an initializer is still a program-scope variable.
    "program-scope-variable:array": (
        "float table[4] = {1, 2, 3, 4}; // BUG\n" + K + " { x[i] = table[i % 4]; }",
        "constant float table[4] = {1, 2, 3, 4};\n" + K + " { x[i] = table[i % 4]; }",
    ),
    "program-scope-variable:constexpr": (
        "constexpr int N = 4; // BUG\n" + K + " { x[i] = N; }",
        "constant constexpr int N = 4;\n" + K + " { x[i] = N; }",
    ),
    # linear.metal's bug: a static constexpr data member.
    "static-variable:member": (
        "template <typename T> struct Wide {\n  static constexpr int N = 16 / sizeof(T); // BUG\n"
        "  float v[N];\n};\n" + K + " { Wide<half> w; w.v[0] = 1; x[i] = w.v[0] + Wide<half>::N; }",
        "template <typename T> struct Wide {\n  enum : int { N = int(16 / sizeof(T)) };\n"
        "  float v[N];\n};\n" + K + " { Wide<half> w; w.v[0] = 1; x[i] = w.v[0] + Wide<half>::N; }",
    ),
    "static-variable:constant-member": (
        "struct S {\n  static const int n = 3; // BUG\n};\n" + K + " { x[i] = S::n; }",
        "struct S {\n  static constant constexpr int n = 3;\n};\n" + K + " { x[i] = S::n; }",
    ),
    "static-variable:local": (
        "float next() {\n  static int calls = 0; // BUG\n  return ++calls;\n}\n" + K + " { x[i] = next(); }",
        "float next(thread int& calls) {\n  return ++calls;\n}\n" + K + " { int calls = 0; x[i] = next(calls); }",
    ),
    "constant-initializer": (
        "constant float scale; // BUG\n" + K + " { x[i] = scale; }",
        "constant float scale = 1;\n" + K + " { x[i] = scale; }",
    ),
    # A function constant takes its value from the pipeline (MSL 5.8.1).
    "constant-initializer:function-constant": (
        "constant bool has_bias; // BUG\n" + K + " { if (has_bias) x[i] += 1; }",
        "constant bool has_bias [[function_constant(0)]];\n" + K + " { if (has_bias) x[i] += 1; }",
    ),
    "threadgroup-variable-scope": (
        "float stage(float v, uint i) {\n  threadgroup float t[32]; // BUG\n  t[i % 32] = v;\n"
        "  return t[0];\n}\n" + K + " { x[i] = stage(x[i], i); }",
        "float stage(threadgroup float* t, float v, uint i) {\n  t[i % 32] = v;\n"
        "  return t[0];\n}\n" + K + " {\n  threadgroup float t[32];\n"
        "  x[i] = stage(t, x[i], i);\n}",
    ),
    # Apple's compiler takes C++17 and C++20 as extensions (VALID below), not C++23.
    "cxx20": (
        K + " {\n  switch (i) {\n    case 0: x[i] = 1; break;\n    default:\n  } // BUG (a label ends the block)\n}",
        K + " {\n  switch (i) {\n    case 0: x[i] = 1; break;\n    default: break;\n  }\n}",
    ),
    # linear.metal's and grouped_mm.metal's bug (issue 29): job structs with
    # bases. Apple: "derived classes are not supported in Metal".
    "derived-class": (
        "struct Operands { float scale; };\nstruct Job : Operands { // BUG\n  float apply(float v) const { return v * scale; }\n};\n"  # noqa: E501
        + K
        + " { Job j; j.scale = 2; x[i] = j.apply(x[i]); }",
        "struct Operands { float scale; };\nstruct Job {\n  Operands op;\n  float apply(float v) const { return v * op.scale; }\n};\n"  # noqa: E501
        + K
        + " { Job j; j.op.scale = 2; x[i] = j.apply(x[i]); }",
    ),
    "derived-class:class-access-specifier": (
        "class Base {\n public:\n  float v;\n};\nclass Derived : public Base { // BUG\n public:\n  float twice() const { return 2 * v; }\n};\n"  # noqa: E501
        + K
        + " { Derived d; d.v = x[i]; x[i] = d.twice(); }",
        "class Base {\n public:\n  float v;\n};\nclass Derived {\n public:\n  Base b;\n  float twice() const { return 2 * b.v; }\n};\n"  # noqa: E501
        + K
        + " { Derived d; d.b.v = x[i]; x[i] = d.twice(); }",
    ),
    "derived-class:template": (
        "template <typename T> struct Base { T v; };\ntemplate <typename T>\nstruct alignas(16) Derived final : Base<T> { // BUG\n  T w;\n};\n"  # noqa: E501
        + K
        + " { Derived<float> d; d.v = d.w = x[i]; x[i] = d.v + d.w; }",
        "template <typename T> struct Base { T v; };\ntemplate <typename T>\nstruct alignas(16) Derived final {\n  Base<T> b;\n  T w;\n};\n"  # noqa: E501
        + K
        + " { Derived<float> d; d.b.v = d.w = x[i]; x[i] = d.b.v + d.w; }",
    ),
    # A specialisation, two bases, one private.
    "derived-class:multiple": (
        "struct A { float a; };\nstruct B { float b; };\ntemplate <typename T> struct S;\n"
        "template <> struct S<float> : A, private B { // BUG\n  float sum() const { return a + b; }\n  void set(float v) { a = b = v; }\n};\n"  # noqa: E501
        + K
        + " { S<float> s; s.set(x[i]); x[i] = s.sum(); }",
        "struct A { float a; };\nstruct B { float b; };\ntemplate <typename T> struct S;\n"
        "template <> struct S<float> {\n  A a;\n  B b;\n  float sum() const { return a.a + b.b; }\n  void set(float v) { a.a = b.b = v; }\n};\n"  # noqa: E501
        + K
        + " { S<float> s; s.set(x[i]); x[i] = s.sum(); }",
    ),
    # The curiously recurring template pattern; a local class.
    "derived-class:crtp": (
        "template <typename D> struct Twice {\n  float twice() const { return 2 * static_cast<thread const D*>(this)->v; }\n};\n"  # noqa: E501
        "struct V : Twice<V> { // BUG\n  float v;\n};\n" + K + " { V s; s.v = x[i]; x[i] = s.twice(); }",
        "template <typename D> float twice(thread const D& d) { return 2 * d.v; }\n"
        "struct V {\n  float v;\n};\n" + K + " { V s; s.v = x[i]; x[i] = twice(s); }",
    ),
    "derived-class:local": (
        "struct A { float a; };\n"
        + K
        + " {\n  struct B : A { float b; }; // BUG\n  B v;\n  v.a = v.b = x[i];\n  x[i] = v.a + v.b;\n}",
        "struct A { float a; };\n"
        + K
        + " {\n  struct B { A a; float b; };\n  B v;\n  v.a.a = v.b = x[i];\n  x[i] = v.a.a + v.b;\n}",
    ),
    # MLX turns the internals region off after its type traits: a base
    # after `disable` is the user's own.
    "derived-class:after-internals-region": (
        "#pragma METAL internals : enable\ntemplate <bool B> struct flag : metal::bool_constant<B> {};\n"
        "#pragma METAL internals : disable\ntemplate <bool B> struct other : metal::bool_constant<B> {}; // BUG\n"
        + K
        + " { x[i] = flag<true>::value + other<false>::value; }",
        "#pragma METAL internals : enable\ntemplate <bool B> struct flag : metal::bool_constant<B> {};\n"
        "#pragma METAL internals : disable\ntemplate <bool B> struct other { static constant constexpr bool value = B; };\n"  # noqa: E501
        + K
        + " { x[i] = flag<true>::value + other<false>::value; }",
    ),
    "virtual": (
        "struct Op {\n  virtual float apply(float v) { return v; } // BUG\n};\n"
        + K
        + " { Op op; x[i] = op.apply(x[i]); }",
        "struct Op {\n  float apply(float v) { return v; }\n};\n" + K + " { Op op; x[i] = op.apply(x[i]); }",
    ),
    "exceptions": (
        K + " {\n  if (x[i] < 0) throw 1; // BUG\n  x[i] = 1;\n}",
        K + " {\n  if (x[i] < 0) return;\n  x[i] = 1;\n}",
    ),
    "exceptions:try-catch": (
        K + " {\n  try { x[i] = 1; } // BUG\n  catch (...) { x[i] = 0; }\n}",
        K + " {\n  x[i] = 1;\n}",
    ),
    "new-delete": (
        K + " {\n  thread float* p = new float(1); // BUG\n  x[i] = *p;\n}",
        K + " {\n  float v = 1;\n  thread float* p = &v;\n  x[i] = *p;\n}",
    ),
    "new-delete:delete": (
        "inline void release(thread float* p) {\n  delete p; // BUG\n}\n" + K + " { x[i] = 1; }",
        "struct NoCopy {\n  NoCopy() = default;\n  NoCopy(thread const NoCopy&) = delete;\n};\n"
        + K
        + " { NoCopy n; x[i] = 1; }",
    ),
    "rtti": (
        "struct A { float v; };\n" + K + " {\n  A a;\n  x[i] = dynamic_cast<thread A*>(&a) != nullptr; // BUG\n}",
        "struct A { float v; };\n" + K + " {\n  A a;\n  x[i] = (&a) != nullptr;\n}",
    ),
    "rtti:typeid": (
        "struct A { float v; };\n" + K + " {\n  A a;\n  x[i] = typeid(a) == typeid(A); // BUG\n}",
        "struct A { float v; };\n" + K + " {\n  A a;\n  x[i] = metal::is_same<decltype(a), A>::value;\n}",
    ),
    "goto": (
        K + " {\n  if (x[i] < 0) goto done; // BUG\n  x[i] = 1;\ndone:\n  return;\n}",
        K + " {\n  if (x[i] < 0) return;\n  x[i] = 1;\n}",
    ),
    "storage-class": (
        K + " {\n  register float v = x[i]; // BUG\n  x[i] = v;\n}",
        K + " {\n  float v = x[i];\n  x[i] = v;\n}",
    ),
    "storage-class:thread-local": (
        "inline float counted(float v) {\n  thread_local int calls; // BUG\n  return v + calls++;\n}\n"
        + K
        + " { x[i] = counted(x[i]); }",
        "inline float counted(float v, thread int& calls) {\n  return v + calls++;\n}\n"
        + K
        + " { int calls = 0; x[i] = counted(x[i], calls); }",
    ),
    "lambda": (
        K + " {\n  auto twice = [](float v) { return v * 2; }; // BUG\n  x[i] = twice(x[i]);\n}",
        "inline float twice(float v) { return v * 2; }\n" + K + " {\n  x[i] = twice(x[i]);\n}",
    ),
    "noexcept-operator": (
        "float f(float v) { return v; }\n" + K + " {\n  x[i] = noexcept(f(1)); // BUG\n}",
        "float f(float v) { return v; }\n" + K + " {\n  x[i] = f(1);\n}",
    ),
    "function-pointer": (
        "float twice(float v) { return v * 2; }\n" + K + " {\n  float (*op)(float) = twice; // BUG\n"
        "  x[i] = op(x[i]);\n}",
        "float twice(float v) { return v * 2; }\n" + K + " {\n  x[i] = twice(x[i]);\n}",
    ),
    "main": (
        "float main(float v) { return v; } // BUG\n" + K + " { x[i] = main(1); }",
        "float helper(float v) { return v; }\n" + K + " { x[i] = helper(1); }",
    ),
    "builtin-type": (
        "kernel void k(device float* x [[buffer(0)]],\n  int i [[thread_position_in_grid]]) { x[i] = 1; } // BUG",
        "kernel void k(device float* x [[buffer(0)]],\n  uint i [[thread_position_in_grid]]) { x[i] = 1; }",
    ),
    "builtin-type:vector4": (
        "kernel void k(device float* x [[buffer(0)]],\n  uint4 i [[thread_position_in_grid]]) { x[i.x] = 1; } // BUG",
        "kernel void k(device float* x [[buffer(0)]],\n  uint3 i [[thread_position_in_grid]]) { x[i.x] = 1; }",
    ),
    # softmax.metal's bug: a scalar size beside a 2-component position.
    "builtin-width": (
        "kernel void k(device float* x [[buffer(0)]],\n  uint threads [[threads_per_threadgroup]],\n"
        "  uint2 group [[threadgroup_position_in_grid]]) { x[group.y * threads + group.x] = 1; } // BUG",
        "kernel void k(device float* x [[buffer(0)]],\n  uint2 threads [[threads_per_threadgroup]],\n"
        "  uint2 group [[threadgroup_position_in_grid]]) { x[group.y * threads.x + group.x] = 1; }",
    ),
    "builtin-same-type": (
        "kernel void k(device float* x [[buffer(0)]],\n  uint2 pos [[thread_position_in_grid]],\n"
        "  ushort2 size [[threads_per_grid]]) { x[pos.y * size.x + pos.x] = 1; } // BUG",
        "kernel void k(device float* x [[buffer(0)]],\n  uint2 pos [[thread_position_in_grid]],\n"
        "  uint2 size [[threads_per_grid]]) { x[pos.y * size.x + pos.x] = 1; }",
    ),
    "thread-index-type": (
        "kernel void k(device float* x [[buffer(0)]],\n  uint2 lid [[thread_position_in_threadgroup]],\n"
        "  ushort index [[thread_index_in_threadgroup]]) { x[index] = lid.x; } // BUG",
        "kernel void k(device float* x [[buffer(0)]],\n  uint2 lid [[thread_position_in_threadgroup]],\n"
        "  uint index [[thread_index_in_threadgroup]]) { x[index] = lid.x; }",
    ),
    "builtin-conflict": (
        "kernel void k(device float* x [[buffer(0)]],\n  uint w [[thread_execution_width]],\n"
        "  uint s [[threads_per_simdgroup]]) { x[0] = w + s; } // BUG",
        "kernel void k(device float* x [[buffer(0)]],\n  uint s [[threads_per_simdgroup]]) { x[0] = s; }",
    ),
    "buffer-index:duplicate": (
        "kernel void k(device float* x [[buffer(0)]],\n  device float* y [[buffer(0)]]) { x[0] = y[0]; } // BUG",
        "kernel void k(device float* x [[buffer(0)]],\n  device float* y [[buffer(1)]]) { x[0] = y[0]; }",
    ),
    "buffer-index:range": (
        "kernel void k(device float* x [[buffer(0)]],\n  device float* y [[buffer(31)]]) { x[0] = y[0]; } // BUG",
        "kernel void k(device float* x [[buffer(0)]],\n  device float* y [[buffer(30)]]) { x[0] = y[0]; }",
    ),
    "threadgroup-index": (
        "kernel void k(device float* x [[buffer(0)]], threadgroup float* a [[threadgroup(0)]],\n"
        "  threadgroup float* b [[threadgroup(0)]]) { a[0] = 1; b[0] = 2; x[0] = a[0]; } // BUG",
        "kernel void k(device float* x [[buffer(0)]], threadgroup float* a [[threadgroup(0)]],\n"
        "  threadgroup float* b [[threadgroup(1)]]) { a[0] = 1; b[0] = 2; x[0] = a[0]; }",
    ),
    "kernel-return": (
        "kernel float k(device float* x [[buffer(0)]], // BUG\n  uint i [[thread_position_in_grid]]) {\n"
        "  x[i] = 1;\n  return 0;\n}",
        K + " {\n  x[i] = 1;\n}",
    ),
    "max-threads": (
        "[[max_total_threads_per_threadgroup(2048)]] // BUG\n" + K + " { x[i] = 1; }",
        "[[max_total_threads_per_threadgroup(1024)]]\n" + K + " { x[i] = 1; }",
    ),
    "threadgroup-memory": (
        "kernel void k(device float* x [[buffer(0)]], // BUG\n  uint i [[thread_position_in_threadgroup]]) {\n"
        "  threadgroup float a[6000];\n  threadgroup float2 b[2000];\n  a[i] = 1;\n  b[i] = 2;\n"
        "  threadgroup_barrier(mem_flags::mem_threadgroup);\n  x[i] = a[i] + b[i].x;\n}",
        "kernel void k(device float* x [[buffer(0)]],\n  uint i [[thread_position_in_threadgroup]]) {\n"
        "  threadgroup float a[6000];\n  threadgroup float2 b[1000 / 4];\n  a[i] = 1;\n  b[i] = 2;\n"
        "  threadgroup_barrier(mem_flags::mem_threadgroup);\n  x[i] = a[i] + b[i].x;\n}",
    ),
    # scaled_mm.metal's bug: a whole float2 to and from thread_elements(), whose
    # type Apple does not publish (vec<T, 2>& or a type of its own).
    "thread-elements": (
        K + " {\n  simdgroup_float8x8 m;\n  m.thread_elements() = float2(x[i], 1); // BUG\n  simdgroup_store(m, x);\n}",
        K + " {\n  simdgroup_float8x8 m;\n"
        "  reinterpret_cast<thread float2&>(m.thread_elements()) = float2(x[i], 1);\n"
        "  simdgroup_store(m, x);\n}",
    ),
    "thread-elements:read": (
        K + " {\n  simdgroup_float8x8 m(1.0f);\n  float2 v = m.thread_elements(); // BUG\n  x[i] = v.x + v.y;\n}",
        K + " {\n  simdgroup_float8x8 m(1.0f);\n"
        "  float2 v = float2(m.thread_elements()[0], m.thread_elements()[1]);\n"
        "  x[i] = v.x + v.y;\n}",
    ),
    "thread-elements:store": (
        "kernel void k(threadgroup float2* t [[threadgroup(0)]], uint i [[thread_position_in_grid]]) {\n"
        "  simdgroup_float8x8 m(1.0f);\n  t[i] = m.thread_elements(); // BUG\n}",
        "kernel void k(threadgroup float2* t [[threadgroup(0)]], uint i [[thread_position_in_grid]]) {\n"
        "  simdgroup_float8x8 m(1.0f);\n  t[i] = reinterpret_cast<thread float2&>(m.thread_elements());\n}",
    ),
    "host-name": (
        "template <int N> kernel void k(device float* x [[buffer(0)]]) { x[0] = N; }\n"
        'template [[host_name("k1")]] kernel decltype(k<1>) k<1>;\n'
        'template [[host_name("k1")]] kernel decltype(k<2>) k<2>; // BUG',
        "template <int N> kernel void k(device float* x [[buffer(0)]]) { x[0] = N; }\n"
        'template [[host_name("k1")]] kernel decltype(k<1>) k<1>;\n'
        'template [[host_name("k2")]] kernel decltype(k<2>) k<2>;',
    ),
}


def _write(tmp_path, name: str, body: str) -> Path:
    path = tmp_path / f"{name.replace(':', '_')}.metal"
    path.write_text(HEAD + body + "\n")
    return path


@pytest.mark.parametrize("case", sorted(CASES))
def test_planted_bug_is_rejected_with_rule_and_line(tmp_path, case):
    rule = case.split(":")[0]
    path = _write(tmp_path, "bad_" + case, CASES[case][0])
    line = next(n for n, text in enumerate(path.read_text().splitlines(), 1) if "// BUG" in text)
    findings = check_file(path)
    assert any(f.startswith(f"{path}:{line}:") and f"[msl-{rule}]" in f for f in findings), findings


@pytest.mark.parametrize("case", sorted(CASES))
def test_valid_variant_passes(tmp_path, case):
    path = _write(tmp_path, "ok_" + case, CASES[case][1])
    assert check_file(path) == []


def test_every_rule_has_a_planted_bug_and_a_row_in_the_docs():
    assert {c.split(":")[0] for c in CASES} == set(_lint.RULES)
    docs = (ROOT / "docs" / "dev" / "contributing.md").read_text()
    for rule in _lint.RULES:
        assert f"`msl-{rule}`" in docs, rule


def test_the_executor_builds_nothing_check_mode_rejects():
    """compile_library (every test and op) applies the same rules."""
    with pytest.raises(cpu_metal.CompileError, match=r"k\.metal:4: static member 'N' .*\[msl-static-variable\]"):
        cpu_metal.compile_library(HEAD + CASES["static-variable:member"][0], filename="k.metal")
    with pytest.raises(cpu_metal.CompileError, match=r"C\+\+23 extension.*\[msl-cxx20\]"):
        cpu_metal.compile_library(HEAD + CASES["cxx20"][0], filename="k.metal")
    cpu_metal.compile_library(HEAD + CASES["static-variable:member"][1], filename="k.metal")


# Valid Metal that Apple's compiler builds (each as MLX or PyTorch writes
# it), which check mode once rejected.
VALID = {
    # C++17 and C++20 features, which Apple's compiler takes as extensions
    # (MLX's kernels use if constexpr, inline variables, static_assert
    # without a message; it builds them with -Wno-c++17-extensions
    # -Wno-c++20-extensions).
    "cxx17:if-constexpr": "template <int N> float f(float v) {\n  if constexpr (N > 1) return v * N;\n  else return v;\n}\n"  # noqa: E501
    + K
    + " { x[i] = f<2>(x[i]); }",
    "cxx17:structured-binding": "struct P { float a, b; };\n"
    + K
    + " {\n  P p = {1, 2};\n  auto [a, b] = p;\n  x[i] = a + b;\n}",
    "cxx17:fold-expression": "template <typename... A> float sum(A... a) {\n  return (a + ...);\n}\n"
    + K
    + " { x[i] = sum(1.0f, 2.0f); }",
    "cxx17:inline-variable": "struct S {\n  static inline constant float k = 2;\n};\n" + K + " { x[i] = S::k; }",
    "cxx17:static-assert-without-message": "static_assert(sizeof(float) == 4);\n" + K + " { x[i] = 1; }",
    "cxx20:designated-initializer": "struct P { float a, b; };\n"
    + K
    + " {\n  P p = {.a = 1, .b = 2};\n  x[i] = p.a + p.b;\n}",
    # MLX's steel kernels: a kernel template with a default template argument.
    "default-template-argument": "template <typename T, int N = 4>\n[[kernel]] void k(device T* x [[buffer(0)]],\n"
    "  uint i [[thread_position_in_grid]]) { x[i] = N; }\n"
    'template [[host_name("k_f")]] [[kernel]] void k<float>(device float*, uint);',
    # MLX's complex.h: members overloaded on the address space of `this`,
    # an operator with a braced return.
    "address-space-members": "template <typename T> struct C {\n  T re, im;\n"
    "  constexpr C(T a, T b) thread : re(a), im(b) {}\n"
    "  constexpr C(T a, T b) device : re(a), im(b) {}\n"
    "  constexpr operator vec<T, 2>() const thread { return vec<T, 2>(re, im); }\n"
    "  constexpr operator vec<T, 2>() const device { return vec<T, 2>(re, im); }\n"
    "  T norm() const device { return re * re + im * im; }\n};\n"
    "template <typename T> constexpr C<T> operator-(C<T> x) {\n  return {-x.re, -x.im};\n}\n"
    "kernel void k(device C<float>* c [[buffer(0)]], device float* x [[buffer(1)]],\n"
    "  uint i [[thread_position_in_grid]]) {\n  float2 v = c[i];\n  C<float> n(v.x, v.y);\n"
    "  x[i] = (-n).re + c[i].norm();\n}",
    # MLX's steel type traits derive from integral_constant, inside the
    # region its headers (and Apple's) open for what user code may not write
    # (steel/utils/type_traits.h, integral_constant.h).
    "derived-class-in-internals-region": "#pragma METAL internals : enable\n"
    "template <bool B> struct flag : metal::bool_constant<B> {};\n"
    "#pragma METAL internals : disable\n" + K + " { x[i] = flag<true>::value; }",
    # Colons that are no base-specifier list: an enum's underlying type,
    # bitfields, a constructor's member initialisers, access labels, case
    # labels, the conditional operator, a qualified name; an elaborated type.
    "colons-without-bases": "enum E : uint { E1 = 1, E2 = 2 };\nenum class F : ushort { f1 };\nstruct Bits;\n"
    "struct Bits {\n  uint lo : 4;\n  uint hi : 4;\n  Bits() : lo(1), hi(2) {}\n"
    " public:\n  uint sum() const { return lo + hi; }\n private:\n  uint unused = uint(F::f1);\n};\n"
    "inline uint total(thread const struct Bits& b) { return b.sum(); }\n"
    + K
    + " {\n  Bits b;\n  switch (i % 2) {\n    case E1: x[i] = total(b); break;\n"
    "    default: x[i] = i > 2 ? metal::fabs(x[i]) : 0; break;\n  }\n}",
    # PyTorch's c10/metal/atomic.h: the operation as a function-pointer parameter.
    "function-pointer-parameter": "inline float add(float a, float b) { return a + b; }\n"
    "template <typename T> T apply(T a, T b, T (*op)(T, T)) { return op(a, b); }\n"
    + K
    + " { x[i] = apply(x[i], 1.0f, add); }",
    # MLX's fft/readwrite.h: a pointer into threadgroup memory in a helper.
    "threadgroup-pointer-in-helper": "inline float first(threadgroup float* buf, uint j) {\n"
    "  threadgroup float* p = buf + j;\n  return p[0];\n}\n" + K + " {\n  threadgroup float t[32];\n  t[i % 32] = 1;\n"
    "  threadgroup_barrier(mem_flags::mem_threadgroup);\n  x[i] = first(t, 0);\n}",
    # MLX's steel_gemm_masked.h: two kernel templates of one name, told
    # apart by their template parameters.
    "overloaded-kernel-templates": "template <typename T, typename M>\n[[kernel]] void k(device T* x [[buffer(0)]],\n"
    "  uint i [[thread_position_in_grid]]) { x[i] = sizeof(M); }\n"
    "template <typename T, int N, bool B = false>\n[[kernel]] void k(device T* x [[buffer(0)]],\n"
    "  uint i [[thread_position_in_grid]]) { x[i] = N; }\n"
    'template [[host_name("k_short")]] [[kernel]] void k<float, short>(device float*, uint);\n'
    'template [[host_name("k_5")]] [[kernel]] void k<float, 5>(device float*, uint);',
    # MLX's gated_delta_update.h: Rows defaults to Cols.
    "filled-simdgroup-matrix-two-arguments": K
    + " {\n  simdgroup_float8x8 m = make_filled_simdgroup_matrix<float, 8>(2.0f);\n"
    "  x[i] = m.thread_elements()[0];\n}",
    # MLX's fft/readwrite.h, PyTorch's c10/metal/utils.h: a vector built
    # through an alias or a template parameter; a static_cast of a vector
    # element (PyTorch's indexing.h).
    "vector-through-alias": "template <typename T> struct P {\n  using complex_T = vec<T, 2>;\n"
    "  complex_T conj(complex_T v) const { return complex_T(v.x, -v.y); }\n};\n"
    "template <typename V> V mul(V a, V b) { return V(a.x * b.x - a.y * b.y, a.x * b.y + a.y * b.x); }\n"
    "typedef float2 cfloat;\n"
    + K
    + " {\n  float2 c = P<float>().conj(cfloat(x[i], 2));\n  half2 h = mul(half2(1, 1), half2(c.x, 1));\n"
    "  x[i] = static_cast<float>(h.y) + static_cast<int>(c.y);\n}",
    # PyTorch's Sort.metal: a host name of adjacent string literals, the
    # last one empty.
    "host-name-concatenated": '#define NAME(T, N) "k_" #T "_n" #N ""\n'
    "template <typename T, int N>\n[[kernel]] void k(device T* x [[buffer(0)]],\n"
    "  uint i [[thread_position_in_grid]]) { x[i] = N; }\n"
    "template [[host_name(NAME(float, 3))]] [[kernel]] void k<float, 3>(device float*, uint);",
    # MLX's arange and hadamard: buffers without [[buffer(i)]].
    "buffer-without-attribute": "kernel void k(constant const float& start, device float* out,\n"
    "  uint i [[thread_position_in_grid]]) { out[i] = start + i; }",
    # PyTorch's Gemv.h (torch 2.14): a struct copied out of device memory in
    # a helper template two kernel instantiations call (check mode once
    # failed the second call, the helper's specialisation marked invalid).
    "struct-copy-out-of-device-memory": "template <class T, int N> struct alignas(sizeof(T) * N) Vec { T v[N]; };\n"
    "template <typename T, int N, typename I>\n"
    "inline Vec<T, N> load(device const T* p, I k) { return *((const device Vec<T, N>*)(p + k)); }\n"
    "template <typename T, int M, typename I = int>\n"
    "kernel void k(device const T* x [[buffer(0)]], device T* y [[buffer(1)]],\n"
    "  uint i [[thread_position_in_grid]]) {\n  const I n = I(i);\n"
    "  Vec<T, 2> a = load<T, 2>(x, 2 * n);\n  y[i] = a.v[0] * M + a.v[1];\n}\n"
    'template [[host_name("k1")]] kernel void k<float, 1>(device const float*, device float*, uint);\n'
    'template [[host_name("k2")]] kernel void k<float, 2>(device const float*, device float*, uint);',
    # Gemv.h again: a metal::array in constant memory, indexed (Apple's
    # array has operator[] for `this` in every address space).
    "metal-array-in-address-space": "kernel void k(device float* x [[buffer(0)]], constant metal::array<float, 2>& ab [[buffer(1)]],\n"  # noqa: E501
    "  device metal::array<float, 2>& last [[buffer(2)]], uint i [[thread_position_in_grid]]) {\n"
    "  x[i] = ab[0] * x[i] + ab[1];\n  if (i == 0) last[1] = ab[0];\n}",
    # Copies into and out of threadgroup, constant and device memory, of a
    # class with private members and a constructor, and of a local struct.
    "struct-copies-between-address-spaces": "class Acc {\n  float s;\n public:\n  Acc(float v) : s(v) {}\n"
    "  float get() const { return s; }\n};\nstruct P { float a, b; };\n"
    "kernel void k(device float* x [[buffer(0)]], constant P& p [[buffer(1)]],\n"
    "  device Acc* acc [[buffer(2)]], uint i [[thread_position_in_grid]]) {\n"
    "  struct L { float v; };\n  threadgroup P t[4];\n  threadgroup L u[4];\n"
    "  t[i % 4] = p;\n  u[i % 4] = L{x[i]};\n"
    "  threadgroup_barrier(mem_flags::mem_threadgroup);\n"
    "  P q = t[(i + 1) % 4];\n  L l = u[(i + 1) % 4];\n  Acc c = acc[i];\n"
    "  P r = {1, 2};\n  r = p;\n  acc[i] = Acc(r.a);\n  x[i] = q.a + q.b + c.get() + l.v;\n}",
}


@pytest.mark.parametrize("case", sorted(VALID))
def test_valid_metal_apple_compiles_passes(tmp_path, case):
    path = _write(tmp_path, case, VALID[case])
    assert check_file(path) == []


# Check mode takes copies of a struct out of any address space (mx_metal.h's
# __MX_COPIES, VALID above); what Metal still rejects, it rejects: writing
# constant or const data, binding a reference or pointer of one address
# space to an object of another, a constructor the class does not have.
ADDRESS_SPACE_BUGS = {
    "assign-to-constant": "struct P { float a, b; };\n"
    "kernel void k(constant P& c [[buffer(0)]], device float* x [[buffer(1)]]) {\n"
    "  P q = {1, 2};\n  c = q; // BUG\n  x[0] = c.a;\n}",
    "assign-through-const-pointer": "struct P { float a, b; };\n"
    "kernel void k(device const P* d [[buffer(0)]], device float* x [[buffer(1)]]) {\n"
    "  P q = {1, 2};\n  d[0] = q; // BUG\n  x[0] = d[0].a;\n}",
    "reference-across-address-spaces": "struct P { float a, b; };\n"
    "kernel void k(constant P& c [[buffer(0)]], device float* x [[buffer(1)]]) {\n"
    "  thread const P& r = c; // BUG\n  x[0] = r.a;\n}",
    "argument-across-address-spaces": "struct P { float a, b; };\nfloat sum(thread const P& q) { return q.a + q.b; }\n"
    "kernel void k(device P* items [[buffer(0)]], device float* x [[buffer(1)]]) {\n"
    "  x[0] = sum(items[0]); // BUG\n}",
    "no-default-constructor": "struct C {\n  float r;\n  C(float v) : r(v) {}\n};\n"
    "kernel void k(device C* items [[buffer(0)]], device float* x [[buffer(1)]]) {\n"
    "  C c; // BUG\n  c = items[0];\n  x[0] = c.r;\n}",
    "write-constant-array": "kernel void k(constant metal::array<float, 2>& ab [[buffer(0)]], device float* x [[buffer(1)]]) {\n"  # noqa: E501
    "  ab[0] = 1; // BUG\n  x[0] = ab[1];\n}",
    "pointer-into-constant-array": "kernel void k(constant metal::array<float, 2>& ab [[buffer(0)]], device float* x [[buffer(1)]]) {\n"  # noqa: E501
    "  thread const float* e = &ab[0]; // BUG\n  x[0] = *e;\n}",
}


@pytest.mark.parametrize("case", sorted(ADDRESS_SPACE_BUGS))
def test_address_space_bug_is_rejected_at_its_line(tmp_path, case):
    path = _write(tmp_path, "bad_" + case, ADDRESS_SPACE_BUGS[case])
    line = next(n for n, text in enumerate(path.read_text().splitlines(), 1) if "// BUG" in text)
    findings = check_file(path)
    assert findings and all(f.startswith(f"{path}:{line}:") and ": error: " in f for f in findings), findings


def test_struct_copies_and_metal_arrays_in_address_spaces_run():
    """The executable build of the VALID cases above computes what the
    Metal does (numpy's arithmetic as the oracle)."""
    x = np.arange(8, dtype=np.float32) + 1
    lib = cpu_metal.compile_library(HEAD + VALID["struct-copy-out-of-device-memory"])
    for name, m in (("k1", 1), ("k2", 2)):
        y = np.zeros(4, np.float32)
        lib.dispatch(name, [x, y], threads=4, threads_per_threadgroup=4)
        np.testing.assert_array_equal(y, x[0::2] * m + x[1::2])
    lib = cpu_metal.compile_library(HEAD + VALID["metal-array-in-address-space"])
    v, last = x[:4].copy(), np.zeros(2, np.float32)
    lib.dispatch("k", [v, np.array([3, 0.5], np.float32).tobytes(), last], threads=4, threads_per_threadgroup=4)
    np.testing.assert_array_equal(v, x[:4] * 3 + 0.5)
    np.testing.assert_array_equal(last, [0, 3])
    lib = cpu_metal.compile_library(HEAD + VALID["struct-copies-between-address-spaces"])
    v, acc = x[:4].copy(), np.array([10, 20, 30, 40], np.float32)
    lib.dispatch("k", [v, np.array([1, 2], np.float32).tobytes(), acc], threads=4, threads_per_threadgroup=4)
    np.testing.assert_array_equal(v, 1 + 2 + np.array([10, 20, 30, 40]) + np.roll(x[:4], -1))
    np.testing.assert_array_equal(acc, [1, 1, 1, 1])


def test_cxx_standard_library_without_its_header_fails_the_check_compile(tmp_path):
    """MSL 1.5.4: no C++ standard library. Its headers are msl-std-header;
    its names without them find no `std` namespace in check mode, as on a
    Mac (Metal's own are in `metal::`)."""
    path = _write(tmp_path, "std_namespace", K + " {\n  x[i] = std::min(x[i], 1.0f); // BUG\n}")
    findings = check_file(path)
    assert findings and all(f.startswith(f"{path}:4:") and "undeclared identifier 'std'" in f for f in findings), (
        findings
    )
    assert check_file(_write(tmp_path, "metal_namespace", K + " {\n  x[i] = metal::min(x[i], 1.0f);\n}")) == []


def test_header_on_the_include_path_is_no_standard_header(tmp_path):
    """PyTorch's shaders include <c10/metal/utils.h>: only the C and C++
    standard libraries' headers are refused."""
    (tmp_path / "mylib").mkdir()
    (tmp_path / "mylib" / "ops.h").write_text("inline float twice(float v) { return 2 * v; }\n")
    path = _write(tmp_path, "include", "#include <mylib/ops.h>\n" + K + " { x[i] = twice(x[i]); }")
    assert check_file(path) == []


def test_buffers_without_attribute_take_the_free_indices_in_order():
    """MLX binds hadamard's `constant const float& scale` (after buffers 0
    and 1) at index 2, arange's unattributed start, step, out at 0, 1, 2."""
    lib = cpu_metal.compile_library(
        HEAD + "kernel void k(constant const float& scale, device const float* a [[buffer(0)]],\n"
        "  device float* out, uint i [[thread_position_in_grid]]) { out[i] = a[i] * scale; }")
    assert {p["name"]: p["index"] for p in lib.parameters("k") if p["kind"] == "buffer"} == \
        {"scale": 1, "a": 0, "out": 2}
    a = np.arange(4, dtype=np.float32)
    out = np.zeros(4, np.float32)
    lib.dispatch("k", [a, np.float32(3), out], threads=4, threads_per_threadgroup=4)
    np.testing.assert_array_equal(out, a * 3)


def test_kernel_template_with_default_argument_runs():
    lib = cpu_metal.compile_library(HEAD + VALID["default-template-argument"])
    x = np.zeros(2, np.float32)
    lib.dispatch("k_f", [x], threads=2, threads_per_threadgroup=2)
    np.testing.assert_array_equal(x, [4, 4])


def test_overloaded_kernel_templates_run_the_instantiated_one():
    lib = cpu_metal.compile_library(HEAD + VALID["overloaded-kernel-templates"])
    for name, want in (("k_short", 2), ("k_5", 5)):
        x = np.zeros(2, np.float32)
        lib.dispatch(name, [x], threads=2, threads_per_threadgroup=2)
        np.testing.assert_array_equal(x, [want, want])


def test_overloaded_kernel_templates_with_different_parameters_are_refused():
    src = HEAD + ("template <typename T>\n[[kernel]] void k(device T* x [[buffer(0)]]) { x[0] = 1; }\n"
                  "template <typename T, int N>\n[[kernel]] void k(device T* y [[buffer(1)]]) { y[0] = N; }\n")
    with pytest.raises(cpu_metal.CompileError, match="kernel templates named 'k' with different parameters"):
        cpu_metal.compile_library(src, filename="k.metal")


def test_function_constants_are_checked_but_not_run():
    """Check mode compiles them; the executor has no pipeline to give them
    a value, and says so instead of running with a made-up one."""
    with pytest.raises(cpu_metal.CompileError, match=r"k\.metal:3: function constant 'has_bias'"):
        cpu_metal.compile_library(HEAD + CASES["constant-initializer:function-constant"][1], filename="k.metal")


def test_only_the_constants_the_specification_lists():
    """INT_MAX and the rest of C's <limits.h> are not in the MSL
    specification's tables (its constants are the float ones: MAXFLOAT,
    INFINITY, NAN, M_PI_F, ...); Metal code spells the integer limits
    numeric_limits<T>::max(), as torch's own Metal kernels do."""
    for name in ("INT_MAX", "INT_MIN", "UINT_MAX"):
        with pytest.raises(cpu_metal.CompileError, match=name):
            cpu_metal.compile_library(HEAD + K + f" {{ x[i] = float({name}); }}", filename="k.metal")
    lib = cpu_metal.compile_library(
        HEAD + "kernel void k(device int* x [[buffer(0)]], device uint* y [[buffer(1)]]) {\n"
        "  x[0] = numeric_limits<int>::max();\n  x[1] = numeric_limits<int>::min();\n"
        "  y[0] = numeric_limits<uint>::max();\n}", filename="k.metal")
    x, y = torch.zeros(2, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    lib.dispatch("k", [x, y], threads=1, threads_per_threadgroup=1)
    assert x.tolist() == [2**31 - 1, -2**31] and y.item() == -1  # 0xffffffff


def test_half_and_bfloat_convert_both_ways(tmp_path):
    """Metal converts between half and bfloat (MLX's fp8.h:
    static_cast<bfloat16_t>(half)); clang's types do not. Each rounds once,
    as torch's float16 <-> bfloat16 conversions do."""
    import torch
    body = (
        "template <typename T, typename U> T to(U u) { return static_cast<T>(u); }\n"
        "kernel void k(device const ushort* h [[buffer(0)]], device const ushort* b [[buffer(1)]],\n"
        "  device ushort* h2b [[buffer(2)]], device ushort* b2h [[buffer(3)]], device ushort* v [[buffer(4)]],\n"
        "  uint i [[thread_position_in_grid]]) {\n"
        "  h2b[i] = as_type<ushort>(static_cast<bfloat>(as_type<half>(h[i])));\n"
        "  b2h[i] = as_type<ushort>(to<half>(as_type<bfloat>(b[i])));\n"
        "  bfloat2 w = bfloat2(half2(as_type<half>(h[i])));\n"
        "  v[i] = as_type<ushort>(w.y);\n}\n")
    assert check_file(_write(tmp_path, "half_bfloat", body)) == []
    lib = cpu_metal.compile_library(HEAD + body)
    h = torch.tensor([0.0, -1.5, 3.140625, 65504.0, 6e-5, 1e-7, float("inf"), 0.0999755859375], dtype=torch.float16)
    b = torch.tensor([0.0, -1.5, 3.140625, 1e5, 6e-5, 1e-9, float("-inf"), 0.1], dtype=torch.bfloat16)
    n = h.numel()
    h2b, b2h, v = (torch.zeros(n, dtype=torch.int16) for _ in range(3))
    lib.dispatch("k", [h.view(torch.int16), b.view(torch.int16), h2b, b2h, v], threads=n, threads_per_threadgroup=n)
    assert torch.equal(h2b.view(torch.bfloat16), h.to(torch.bfloat16))
    assert torch.equal(b2h.view(torch.float16), b.to(torch.float16))
    assert torch.equal(v.view(torch.bfloat16), h.to(torch.bfloat16))



def test_vector_through_alias_runs():
    lib = cpu_metal.compile_library(HEAD + VALID["vector-through-alias"])
    x = np.array([3, 5], np.float32)
    lib.dispatch("k", [x], threads=2, threads_per_threadgroup=2)
    # c = (x, -2); h = (1,1)*(x,1) = (x - 1, 1 + x); x = h.y + int(-2)
    np.testing.assert_array_equal(x, [3 + 1 - 2, 5 + 1 - 2])


def test_host_name_of_adjacent_literals_is_their_concatenation():
    lib = cpu_metal.compile_library(HEAD + VALID["host-name-concatenated"])
    x = np.zeros(2, np.float32)
    lib.dispatch("k_float_n3", [x], threads=2, threads_per_threadgroup=2)
    np.testing.assert_array_equal(x, [3, 3])


def test_max_threads_of_a_kernel_template_is_the_instantiation_s():
    """PyTorch's attention kernels: max_total_threads_per_threadgroup(WM * WN * 32)
    with WM and WN template parameters (one defaulted)."""
    lib = cpu_metal.compile_library(HEAD + (
        "template <typename T, int WM, int WN = 1>\n"
        "[[kernel, max_total_threads_per_threadgroup(WM * WN * 32)]] void k(device T* x [[buffer(0)]],\n"
        "  uint i [[thread_position_in_grid]]) { x[i] = WM; }\n"
        "template [[host_name(\"k2\")]] [[kernel]] void k<float, 2>(device float*, uint);\n"))
    x = np.zeros(64, np.float32)
    lib.dispatch("k2", [x], threads=64, threads_per_threadgroup=64)
    np.testing.assert_array_equal(x, 2)
    with pytest.raises(cpu_metal.DispatchError, match=r"max_total_threads_per_threadgroup\(64\)"):
        lib.dispatch("k2", [np.zeros(128, np.float32)], threads=128, threads_per_threadgroup=128)
