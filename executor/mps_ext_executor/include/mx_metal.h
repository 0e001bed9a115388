// The Metal Shading Language standard library, as the CPU Metal executor
// compiles it: a freestanding C++17 header for clang that plays
// <metal_stdlib> for a kernel translated by _translate.py.
//
// Two modes, chosen by MX_ADDRESS_SPACES:
//  1  address spaces are distinct clang address spaces (device=1, constant=2,
//     threadgroup=3, thread=generic), so that mixing them fails to compile as
//     it does on a Mac. Used by `python -m mps_ext_executor check` and by the
//     check every compile_library runs. Syntax only, never executed.
//  0  address spaces are erased; this is what runs. The engine tells device,
//     threadgroup and thread memory apart by address at run time.
//
// Vectors are clang ext_vector_type, as in Metal itself, so swizzles (.xy,
// .zyx, .rgba, .lo/.hi/.even/.odd) and vector arithmetic are native. What C++
// lacks (vector constructors such as float4(a.xy, 0, 1)) the translator
// rewrites into __mx_make<float4>(...).
//
// Simd and barrier operations hand over to the engine (mx_abi.h), which runs
// the threads of a threadgroup as fibers, through the entry functions
// __mx_simd and __mx_barrier. The instrumenter (_instrument.py) finds every
// call of shader code that can reach one and tells the engine where each
// thread is (its SIMT position), so that a simd operation runs over the
// threads on the same control-flow path, as on a GPU.
#ifndef MX_METAL_H
#define MX_METAL_H

#include "mx_abi.h"

#if MX_ADDRESS_SPACES
#define device __attribute__((address_space(1)))
#define constant __attribute__((address_space(2))) const
#define threadgroup __attribute__((address_space(3)))
#define threadgroup_imageblock __attribute__((address_space(3)))
#else
#define device
#define constant const
#define threadgroup
#define threadgroup_imageblock
#endif
#define thread
#define ray_data
#define object_data

// Metal copies an object of class type out of any address space into the
// thread: `P p = params;` of a `constant P&`, `return *(const device Vec*)q;`
// (Apple-built PyTorch's Gemv.h). The MSL specification has no rule of its
// own for it: it keeps C++14's special members and extends overloading by the
// address space of an argument (1.4.1). Apple's compiler declares the
// implicit members per address space: its candidate lists name "the implicit
// copy assignment operator" for `this` in threadgroup and in device memory
// (quoted in KhronosGroup/SPIRV-Cross#1647), and on Apple's developer forums
// (thread 742665) `MyData d = buffer[0];` out of device memory compiles while
// a member function needs `device const` on `this`. C++ declares them for
// the generic address space only, so in check mode the translator gives each
// class of the shader that leaves its copies to the compiler these explicitly
// defaulted ones, with the moves declaring them would take away (as have the
// stand-in library's value classes). Defaulted on their first declaration
// they keep an aggregate an aggregate (C++14 [dcl.init.aggr]) and a trivially
// copyable class so. What is illegal stays so: a reference or pointer of one
// address space does not bind to an object of another. Assigning to an
// object in device or threadgroup memory needs `this` there, which C++
// cannot declare (_compiler.py accepts that one after the fact). Empty in the
// executable build, which has no address spaces.
#if MX_ADDRESS_SPACES
#define __MX_COPY_CONSTRUCTORS(C)                                                                 \
  C(const C&) = default; C(C&&) = default; C(const device C&) = default; C(constant C&) = default; \
  C(const threadgroup C&) = default;
#define __MX_COPY_ASSIGNMENTS(C)                                                                              \
  C& operator=(const C&) = default; C& operator=(C&&) = default; C& operator=(const device C&) = default;     \
  C& operator=(constant C&) = default; C& operator=(const threadgroup C&) = default;
#define __MX_DEFAULT_CONSTRUCTOR(C) C() = default;
#else
#define __MX_COPY_CONSTRUCTORS(C)
#define __MX_COPY_ASSIGNMENTS(C)
#define __MX_DEFAULT_CONSTRUCTOR(C)
#endif
#define __MX_COPIES(C) __MX_COPY_CONSTRUCTORS(C) __MX_COPY_ASSIGNMENTS(C)

#define METAL_FUNC inline __attribute__((always_inline))
#define __METAL_CPU_EXECUTOR__ 1

extern "C" const mx_engine_api* __mx_api;

namespace __mx {
// Where in the shader a vector constructor is written: the translator passes
// `__mx::site()` as the first argument of __mx_make, and the default
// arguments take the position of that call.
struct site {
  const char* file;
  mx_u32 line, col;
  constexpr site(const char* f = __builtin_FILE(), mx_u32 l = __builtin_LINE(), mx_u32 c = __builtin_COLUMN())
      : file(f), line(l), col(c) {}
};
}  // namespace __mx

// ---------------------------------------------------------------- scalars --
typedef _Float16 half;
typedef __bf16 bfloat;
typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long ulong;
typedef unsigned long size_t;
typedef long ptrdiff_t;
typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef short int16_t;
typedef unsigned short uint16_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long int64_t;
typedef unsigned long uint64_t;
typedef long intptr_t;
typedef unsigned long uintptr_t;

// ---------------------------------------------------------------- vectors --
// packed_T2 / packed_T4 are the same vectors with the scalar's alignment, as
// in Metal. packed_T3 (12 bytes for float) has no ext_vector equivalent and
// is a plain struct with x, y, z.
#define MX_VECTORS(T, name)                                                  \
  typedef T name##2 __attribute__((ext_vector_type(2)));                     \
  typedef T name##3 __attribute__((ext_vector_type(3)));                     \
  typedef T name##4 __attribute__((ext_vector_type(4)));                     \
  typedef T packed_##name##2 __attribute__((ext_vector_type(2), aligned(sizeof(T)))); \
  typedef T packed_##name##4 __attribute__((ext_vector_type(4), aligned(sizeof(T)))); \
  struct packed_##name##3 {                                                  \
    T x, y, z;                                                               \
    T& operator[](int i) { return (&x)[i]; }                                 \
    const T& operator[](int i) const { return (&x)[i]; }                     \
    operator name##3() const { return name##3{x, y, z}; }                    \
    __MX_DEFAULT_CONSTRUCTOR(packed_##name##3) __MX_COPIES(packed_##name##3) \
  };

MX_VECTORS(float, float)
MX_VECTORS(half, half)
MX_VECTORS(bfloat, bfloat)
MX_VECTORS(int, int)
MX_VECTORS(uint, uint)
MX_VECTORS(short, short)
MX_VECTORS(ushort, ushort)
MX_VECTORS(signed char, char)
MX_VECTORS(uchar, uchar)
MX_VECTORS(long, long)
MX_VECTORS(ulong, ulong)
#undef MX_VECTORS

namespace __mx { template <int N> struct boolv; }

namespace metal {
template <class T, int N>
using vec = T __attribute__((ext_vector_type(N)));
}
using metal::vec;

// ------------------------------------------------------------ type traits --
namespace __mx {
template <bool B, class T = void> struct enable_if {};
template <class T> struct enable_if<true, T> { typedef T type; };
template <class A, class B> struct is_same { static constexpr bool value = false; };
template <class A> struct is_same<A, A> { static constexpr bool value = true; };
template <class T> struct remove_cv { typedef T type; };
template <class T> struct remove_cv<const T> { typedef T type; };
template <class T> struct remove_cv<volatile T> { typedef T type; };
template <class T> struct remove_cv<const volatile T> { typedef T type; };
template <class T> struct remove_ref { typedef T type; };
template <class T> struct remove_ref<T&> { typedef T type; };
template <class T> struct remove_ref<T&&> { typedef T type; };
// T without const, volatile and (in check mode) its address space.
template <class T> struct unqual { typedef typename remove_cv<T>::type type; };
#if MX_ADDRESS_SPACES
template <class T> struct unqual<__attribute__((address_space(1))) T> { typedef typename unqual<T>::type type; };
template <class T> struct unqual<__attribute__((address_space(2))) T> { typedef typename unqual<T>::type type; };
template <class T> struct unqual<__attribute__((address_space(3))) T> { typedef typename unqual<T>::type type; };
#endif
// True for T in the threadgroup address space (known only in check mode).
template <class T> struct in_threadgroup { static constexpr bool value = false; };
#if MX_ADDRESS_SPACES
template <class T> struct in_threadgroup<__attribute__((address_space(3))) T> { static constexpr bool value = true; };
#endif
template <class T, class P>
using if_same_unqual = typename enable_if<is_same<T, typename unqual<P>::type>::value, int>::type;
template <class T, class P>
using if_not_same_unqual = typename enable_if<!is_same<T, typename unqual<P>::type>::value, int>::type;
template <class T> struct remove_ptr { typedef T type; };
template <class T> struct remove_ptr<T*> { typedef T type; };
template <class T> struct remove_ptr<T* const> { typedef T type; };

// vt<V>: element type and width of a scalar or vector.
template <class T> struct vt {
  typedef T elem;
  static constexpr int n = 1;
  static constexpr bool is_vec = false;
};
template <class T, int N> struct vt<T __attribute__((ext_vector_type(N)))> {
  typedef T elem;
  static constexpr int n = N;
  static constexpr bool is_vec = true;
};
template <int N> struct vt<boolv<N>> {
  typedef bool elem;
  static constexpr int n = N;
  static constexpr bool is_vec = true;
};
#define MX_PACKED3_TRAIT(T, name) \
  template <> struct vt<::packed_##name##3> { typedef T elem; static constexpr int n = 3; static constexpr bool is_vec = false; };
MX_PACKED3_TRAIT(float, float) MX_PACKED3_TRAIT(half, half) MX_PACKED3_TRAIT(bfloat, bfloat)
MX_PACKED3_TRAIT(int, int) MX_PACKED3_TRAIT(uint, uint) MX_PACKED3_TRAIT(short, short)
MX_PACKED3_TRAIT(ushort, ushort) MX_PACKED3_TRAIT(signed char, char)
MX_PACKED3_TRAIT(uchar, uchar) MX_PACKED3_TRAIT(long, long) MX_PACKED3_TRAIT(ulong, ulong)
#undef MX_PACKED3_TRAIT

template <class T> struct is_fp { static constexpr bool value = false; };
template <> struct is_fp<float> { static constexpr bool value = true; };
template <> struct is_fp<half> { static constexpr bool value = true; };
template <> struct is_fp<bfloat> { static constexpr bool value = true; };
template <class T> struct is_int { static constexpr bool value = false; };
#define MX_INT_TRAIT(T) template <> struct is_int<T> { static constexpr bool value = true; };
MX_INT_TRAIT(signed char) MX_INT_TRAIT(char) MX_INT_TRAIT(uchar) MX_INT_TRAIT(short)
MX_INT_TRAIT(ushort) MX_INT_TRAIT(int) MX_INT_TRAIT(uint) MX_INT_TRAIT(long)
MX_INT_TRAIT(ulong) MX_INT_TRAIT(bool)
#undef MX_INT_TRAIT

// bfloat's math functions are templates enabled for bfloat only: Apple's
// stdlib has no plain bfloat overloads (MLX's bf16_math.h defines
// metal::exp(bfloat) and the rest itself), and a shader's own overload must
// win over the executor's, not collide with it.
template <class B>
using if_bfloat = typename enable_if<is_same<B, bfloat>::value, int>::type;

// Enabled for vectors whose elements satisfy Pred.
template <class V, template <class> class Pred>
using if_vec = typename enable_if<vt<V>::is_vec && Pred<typename vt<V>::elem>::value, int>::type;

template <class T> constexpr int width_of() { return vt<T>::n; }
template <class... A> constexpr int total_width() { return (0 + ... + width_of<A>()); }

// Metal converts between half and bfloat; clang's _Float16 and __bf16 have
// no conversion either way (neither's range holds the other's). Through
// float, which holds both exactly, it rounds once, as the direct one does.
template <class E, class S>
struct half_bfloat_pair {
  typedef typename unqual<E>::type e;
  typedef typename unqual<typename remove_ref<S>::type>::type s;
  static constexpr bool value = (is_same<e, bfloat>::value && is_same<s, half>::value) ||
                                (is_same<e, half>::value && is_same<s, bfloat>::value);
};
// The operand of static_cast<E>(x) (the translator wraps every static_cast
// to a type named without * or &): x itself, or float for the pair above,
// so that the conversion itself stays in shader code. By value: a
// reference cannot bind to a vector element (static_cast<T>(v.y)).
template <class E, class S>
constexpr auto cast_operand(S x) {
  if constexpr (half_bfloat_pair<E, S>::value)
    return (float)x;
  else
    return x;
}

// (E)x, where a floating x that is NaN or outside E's range is an error, as
// the instrumenter makes it in shader code: Metal leaves the result undefined.
template <class E, class S>
inline E convert(S x, site s) {
  if constexpr (half_bfloat_pair<E, S>::value)
    return (E)(float)x;
  if constexpr (is_int<E>::value && !is_same<E, bool>::value && is_fp<S>::value) {
    constexpr bool sgn = E(-1) < E(0);
    constexpr double lo = sgn ? -(double)(1ull << (8 * sizeof(E) - 1)) : 0.0;
    constexpr double hi = sgn ? (double)(1ull << (8 * sizeof(E) - 1)) : 2.0 * (double)(1ull << (8 * sizeof(E) - 1));
    double t = __builtin_trunc((double)x);
    if (!(t >= lo && t < hi))
      __mx_api->conversion_error((sgn ? MX_CONV_SIGNED : 0u) | (8u * sizeof(E)), s.file, s.line, s.col);
  }
  if constexpr (!half_bfloat_pair<E, S>::value)
    return (E)x;
}
template <class E, class V, class A> inline void put_any(V& r, int& i, A a, site s) {
  if constexpr (vt<A>::n == 1) {
    r[i++] = convert<E>(a, s);
  } else {
    for (int k = 0; k < vt<A>::n; ++k) r[i++] = convert<E>(a[k], s);
  }
}
}  // namespace __mx

// Metal's bool vectors: one byte per element, 0 or 1 (bool3 is padded to 4
// bytes, like char3). They are a class here, not a clang vector: clang's
// ext_vector bool is a bit vector (sizeof(bool4) == 1). A vector comparison
// in clang yields an integer vector, which the instrumenter makes 1 where
// true (Metal's bool converts to 1), and a boolN converts from it, so that
// `bool4 m = a > b;`, all(), any(), select(), m.x and int4(m) work as in
// Metal. No swizzles (.xy) on bool vectors, and no `m ? a : b` (not Metal:
// use select).
namespace __mx {
template <int N> struct bool_storage;
template <> struct bool_storage<2> {
  union { bool __v[2]; struct { bool x, y; }; };
  __MX_DEFAULT_CONSTRUCTOR(bool_storage) __MX_COPIES(bool_storage)
};
template <> struct bool_storage<3> {
  union { bool __v[4]; struct { bool x, y, z; }; };
  __MX_DEFAULT_CONSTRUCTOR(bool_storage) __MX_COPIES(bool_storage)
};
template <> struct bool_storage<4> {
  union { bool __v[4]; struct { bool x, y, z, w; }; };
  __MX_DEFAULT_CONSTRUCTOR(bool_storage) __MX_COPIES(bool_storage)
};

template <int N>
struct alignas(N == 2 ? 2 : 4) boolv : bool_storage<N> {
  boolv() = default;
  __MX_COPIES(boolv)
  boolv(bool b) {  // a scalar splats, as for the other vectors
    for (int i = 0; i < N; ++i) this->__v[i] = b;
  }
  // From a comparison's result (or any integer or floating vector of N
  // elements): element != 0.
  template <class V, typename enable_if<vt<V>::is_vec && vt<V>::n == N, int>::type = 0>
  boolv(V m) {
    for (int i = 0; i < N; ++i) this->__v[i] = m[i] != 0;
  }
  // N elements, so that `b = {true, false, true, true}` assigns as for the
  // other vectors (MLX's reduction/ops.h).
  template <class... B, typename enable_if<sizeof...(B) == N && (N > 1), int>::type = 0>
  boolv(B... b) : bool_storage<N>{{bool(b)...}} {}
  bool& operator[](int i) { return this->__v[i]; }
  const bool& operator[](int i) const { return this->__v[i]; }
  friend boolv operator!(boolv a) { boolv r; for (int i = 0; i < N; ++i) r.__v[i] = !a.__v[i]; return r; }
#define MX_BOOLV_OP(op)                                                                   \
  friend boolv operator op(boolv a, boolv b) {                                            \
    boolv r;                                                                              \
    for (int i = 0; i < N; ++i) r.__v[i] = a.__v[i] op b.__v[i];                          \
    return r;                                                                             \
  }
  MX_BOOLV_OP(&&) MX_BOOLV_OP(||) MX_BOOLV_OP(&) MX_BOOLV_OP(|) MX_BOOLV_OP(^) MX_BOOLV_OP(==) MX_BOOLV_OP(!=)
#undef MX_BOOLV_OP
};
}  // namespace __mx
typedef __mx::boolv<2> bool2;
typedef __mx::boolv<3> bool3;
typedef __mx::boolv<4> bool4;
static_assert(sizeof(bool2) == 2 && sizeof(bool3) == 4 && sizeof(bool4) == 4, "Metal's bool vector sizes");

// The vector constructors of Metal: float4(x) splats, float4(h4) converts
// element-wise, float4(a.xy, z, w) concatenates. The translator turns every
// `<vector type>(` into `__mx_make<vector type>(__mx::site(), `.
template <class V, class... A>
inline V __mx_make(__mx::site s, A... a) {
  typedef typename __mx::vt<V>::elem E;
  constexpr int N = __mx::vt<V>::n;
  if constexpr (sizeof...(A) == 0) {
    return V{};
  } else if constexpr (sizeof...(A) == 1 && __mx::total_width<A...>() == 1) {
    V r;
    E e = __mx::convert<E>((a, ...), s);
    for (int k = 0; k < N; ++k) r[k] = e;
    return r;
  } else {
    static_assert(__mx::total_width<A...>() == N,
                  "vector constructor: the arguments' widths do not add up to the vector's");
    V r;
    int i = 0;
    (__mx::put_any<E>(r, i, a, s), ...);
    return r;
  }
}
// T(a, b) with T an alias or template parameter (the translator does not
// know whether it is a vector): Metal's vector constructor for a vector,
// else T's own, with the same arguments: forwarded to a class's
// constructor (which may keep a reference), by value otherwise (a reference
// cannot bind to a vector element such as v.x).
template <class V, class... A, typename __mx::enable_if<__mx::vt<V>::is_vec, int>::type = 0>
inline V __mx_construct(__mx::site s, A... a) {
  return __mx_make<V>(s, a...);
}
template <class V, class... A, typename __mx::enable_if<!__mx::vt<V>::is_vec && !__is_class(V), int>::type = 0>
constexpr V __mx_construct(__mx::site, A... a) {
  return V(a...);
}
template <class V, class... A, typename __mx::enable_if<!__mx::vt<V>::is_vec && __is_class(V), int>::type = 0>
constexpr V __mx_construct(__mx::site, A&&... a) {
  return V(static_cast<A&&>(a)...);
}
namespace metal { using ::__mx_make; using ::__mx_construct; }

namespace metal {
// ---------------------------------------------------------------- as_type --
template <class T, class U>
inline T as_type(U u) {
  static_assert(sizeof(T) == sizeof(U), "as_type: the two types differ in size");
  return __builtin_bit_cast(T, u);
}

// ------------------------------------------------------------ type traits --
template <bool B, class T = void> using enable_if = __mx::enable_if<B, T>;
template <bool B, class T = void> using enable_if_t = typename __mx::enable_if<B, T>::type;
template <class A, class B> using is_same = __mx::is_same<A, B>;
template <class A, class B> constexpr bool is_same_v = __mx::is_same<A, B>::value;
template <class T> struct is_floating_point { static constexpr bool value = __mx::is_fp<typename __mx::remove_cv<T>::type>::value; };
template <class T> constexpr bool is_floating_point_v = is_floating_point<T>::value;
template <class T> struct is_integral { static constexpr bool value = __mx::is_int<typename __mx::remove_cv<T>::type>::value; };
template <class T> constexpr bool is_integral_v = is_integral<T>::value;
template <bool B, class A, class C> struct conditional { typedef A type; };
template <class A, class C> struct conditional<false, A, C> { typedef C type; };
template <bool B, class A, class C> using conditional_t = typename conditional<B, A, C>::type;
template <class T> struct remove_cv { typedef typename __mx::remove_cv<T>::type type; };
template <class T> using remove_cv_t = typename __mx::remove_cv<T>::type;

// ---------------------------------------------------------- numeric limits --
template <class T> struct numeric_limits;
template <> struct numeric_limits<float> {
  static constexpr float infinity() { return __builtin_inff(); }
  static constexpr float quiet_NaN() { return __builtin_nanf(""); }
  static constexpr float max() { return 3.40282347e+38f; }
  static constexpr float min() { return 1.17549435e-38f; }
  static constexpr float lowest() { return -3.40282347e+38f; }
  static constexpr float epsilon() { return 1.1920929e-07f; }
  static constexpr bool has_infinity = true;
};
template <> struct numeric_limits<half> {
  static constexpr half infinity() { return (half)__builtin_inff(); }
  static constexpr half quiet_NaN() { return (half)__builtin_nanf(""); }
  static constexpr half max() { return (half)65504.0f; }
  static constexpr half min() { return (half)6.103515625e-05f; }
  static constexpr half lowest() { return (half)-65504.0f; }
  static constexpr half epsilon() { return (half)0.0009765625f; }
  static constexpr bool has_infinity = true;
};
template <> struct numeric_limits<bfloat> {
  static constexpr bfloat infinity() { return (bfloat)__builtin_inff(); }
  static constexpr bfloat quiet_NaN() { return (bfloat)__builtin_nanf(""); }
  static constexpr bfloat max() { return __builtin_bit_cast(bfloat, (ushort)0x7f7f); }
  static constexpr bfloat min() { return __builtin_bit_cast(bfloat, (ushort)0x0080); }
  static constexpr bfloat lowest() { return __builtin_bit_cast(bfloat, (ushort)0xff7f); }
  static constexpr bfloat epsilon() { return __builtin_bit_cast(bfloat, (ushort)0x3c00); }
  static constexpr bool has_infinity = true;
};
#define MX_INT_LIMITS(T, lo, hi)                              \
  template <> struct numeric_limits<T> {                      \
    static constexpr T max() { return hi; }                   \
    static constexpr T min() { return lo; }                   \
    static constexpr T lowest() { return lo; }                \
    static constexpr bool has_infinity = false;               \
  };
MX_INT_LIMITS(char, (char)-128, (char)127)
MX_INT_LIMITS(signed char, (signed char)-128, (signed char)127)
MX_INT_LIMITS(uchar, (uchar)0, (uchar)255)
MX_INT_LIMITS(short, (short)-32768, (short)32767)
MX_INT_LIMITS(ushort, (ushort)0, (ushort)65535)
MX_INT_LIMITS(int, (-2147483647 - 1), 2147483647)
MX_INT_LIMITS(uint, 0u, 4294967295u)
MX_INT_LIMITS(long, (-9223372036854775807L - 1), 9223372036854775807L)
MX_INT_LIMITS(ulong, 0ul, 18446744073709551615ul)
#undef MX_INT_LIMITS
}  // namespace metal

#define INFINITY __builtin_inff()
#define NAN __builtin_nanf("")
#define HUGE_VALF __builtin_inff()
#define MAXFLOAT 3.40282347e+38f
#define FLT_MAX 3.40282347e+38f
#define FLT_MIN 1.17549435e-38f
#define FLT_EPSILON 1.1920929e-07f
#define HALF_MAX ((half)65504.0f)
#define HALF_MIN ((half)6.103515625e-05f)
#define HALF_EPSILON ((half)0.0009765625f)
#define M_E_F 2.71828183f
#define M_LOG2E_F 1.44269504f
#define M_LOG10E_F 0.434294482f
#define M_LN2_F 0.693147181f
#define M_LN10_F 2.30258509f
#define M_PI_F 3.14159265f
#define M_PI_2_F 1.57079633f
#define M_PI_4_F 0.785398163f
#define M_1_PI_F 0.318309886f
#define M_2_PI_F 0.636619772f
#define M_2_SQRTPI_F 1.12837917f
#define M_SQRT2_F 1.41421356f
#define M_SQRT1_2_F 0.707106781f

// ------------------------------------------------------------------- math --
// Float functions come from the C library through clang builtins; half and
// bfloat compute in float and round once, which is at least as accurate as
// Metal's own half functions.
namespace __mx {
// sin(pi x), cos(pi x), tan(pi x) with the argument reduced exactly: fmod by
// 1 or 2 is exact, and so are the symmetries below in double, so integers and
// half-integers give exactly 0, +-1 and +-inf, and a large x loses nothing
// (sin(x * M_PI_F) is -8.7e-8 at x = 1 and 0.99967 at x = 1000000.5).
// sinpi(-x) = -sinpi(x); a zero result has the sign of x.
inline double sinpi(float x) {
  if (!__builtin_isfinite(x)) return __builtin_nan("");
  double r = __builtin_fmod((double)__builtin_fabsf(x), 2.0), s = 1.0;
  if (r >= 1.0) r -= 1.0, s = -1.0;  // sin(pi (r + 1)) = -sin(pi r)
  if (r > 0.5) r = 1.0 - r;          // sin(pi (1 - r)) = sin(pi r)
  double v = s * __builtin_sin(3.141592653589793 * r);
  return (float)v == 0.0f ? __builtin_copysign(0.0, x) : (x < 0.0f ? -v : v);
}
// cos(pi x) = sin(pi (1/2 - r)) for r = |x| mod 2 folded into [0, 1]; +0 at
// half-integers.
inline double cospi(float x) {
  if (!__builtin_isfinite(x)) return __builtin_nan("");
  double r = __builtin_fmod((double)__builtin_fabsf(x), 2.0);
  if (r > 1.0) r = 2.0 - r;
  return __builtin_sin(3.141592653589793 * (0.5 - r));
}
// tan(pi x), period 1: +inf at n + 1/2 for even n, -inf for odd n.
inline double tanpi(float x) {
  if (!__builtin_isfinite(x)) return __builtin_nan("");
  double r2 = __builtin_fmod((double)__builtin_fabsf(x), 2.0);
  double r = r2 >= 1.0 ? r2 - 1.0 : r2, s = 1.0;
  if (r == 0.5) {
    double inf = r2 < 1.0 ? __builtin_inf() : -__builtin_inf();
    return x < 0.0f ? -inf : inf;
  }
  if (r > 0.5) r = 1.0 - r, s = -1.0;  // tan(pi (1 - r)) = -tan(pi r)
  double v = s * __builtin_sin(3.141592653589793 * r) / __builtin_sin(3.141592653589793 * (0.5 - r));
  return x < 0.0f ? -v : v;
}

// MathMode.perturb (_compiler.py), for tests of what a kernel claims: Metal's
// precise functions are accurate to a bound in ulps of the exact result, not
// to the C library's one ulp (MSL 4, section 8.4. Table 8.1, float: exp,
// exp2, exp10, log, log2, log10, sin, cos, sinh, cosh, sinpi, cospi, asin,
// acos, asinh, acosh 4 ulp; atan, atanh, tanh 5; atan2, tan, tanpi 6; pow,
// powr 16; sqrt, rsqrt and division correctly rounded. Table 8.3, half: 1
// ulp each). With MX_PERTURB = n a bounded function returns what a GPU n
// times worse than that bound may: from `r`, a rounding of the exact value
// (the C library's double result), as many one-ulp steps in one direction as
// keep the result within n x bound ulps of it (ulps of the exact value's
// binade, as the specification counts them); the direction is a hash of the
// function and its arguments' bits, so the same call gives the same bits on
// every run. Kept as they are: zero, subnormal, infinite and NaN results,
// and exact ones (exp(0), log(1), exp2 of an integer), which the
// specification would let move too: assumed, not known, that a GPU returns
// those exactly.
#ifndef MX_PERTURB
#define MX_PERTURB 0
#endif
template <class T> struct fp_format;
template <> struct fp_format<float> {
  typedef unsigned int bits;
  static constexpr int mantissa = 23;
  static constexpr double min_normal = 0x1p-126;
};
template <> struct fp_format<half> {
  typedef unsigned short bits;
  static constexpr int mantissa = 10;
  static constexpr double min_normal = 0x1p-14;
};
constexpr unsigned long long name_hash(const char* s, unsigned long long h = 1469598103934665603ull) {
  return *s ? name_hash(s + 1, (h ^ (unsigned char)*s) * 1099511628211ull) : h;
}
// splitmix64's finaliser: every input bit moves the top bit.
inline unsigned long long mix(unsigned long long z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
template <class T>
inline unsigned long long bits_of(T x) { return __builtin_bit_cast(typename fp_format<T>::bits, x); }
template <class T>
inline T off_by(double exact, unsigned long long key, int ulps) {
  typedef fp_format<T> F;
  const T r = (T)(float)exact;
  const double rd = (double)r;
  if (ulps <= 0 || !(__builtin_fabs(rd) >= F::min_normal) || __builtin_isinf(rd) || rd == exact) return r;
  int e;
  (void)__builtin_frexp(exact, &e);  // |exact| in [2^(e-1), 2^e): an ulp there is 2^(e-1-mantissa)
  const double bound = ulps * __builtin_ldexp(1.0, e - 1 - F::mantissa);
  const bool up = mix(key) >> 63;      // toward +inf, else toward -inf
  const bool grow = up == (rd > 0.0);  // sign and magnitude: the magnitude's bits grow by one a step
  const typename F::bits b = __builtin_bit_cast(typename F::bits, r);
  // The steps within the bound are 0..J (the distance to `exact` falls, then
  // rises): the largest J by bisection, so that a planted bound of thousands
  // of ulps costs a few steps, not thousands.
  auto within = [&](long j) {
    const long nb = grow ? (long)b + j : (long)b - j;
    if (nb < 0 || nb > (long)(typename F::bits)~(typename F::bits)0) return false;
    const double c = (double)__builtin_bit_cast(T, (typename F::bits)nb);
    return __builtin_isfinite(c) && (c > 0.0) == (rd > 0.0) && __builtin_fabs(c) >= F::min_normal &&
           __builtin_fabs(c - exact) <= bound;
  };
  long lo = 0, hi = ulps;  // within(lo); find the last j <= hi within the bound
  while (lo < hi) {
    const long mid = lo + (hi - lo + 1) / 2;
    if (within(mid)) lo = mid;
    else hi = mid - 1;
  }
  return __builtin_bit_cast(T, (typename F::bits)(grow ? (long)b + lo : (long)b - lo));
}
}  // namespace __mx

namespace metal {
namespace precise {

#define MX_FP_OVERLOADS1(name)                                                 \
  inline half name(half x) { return (half)name((float)x); }                    \
  MX_FP_OVERLOADS1_BF_VEC(name)
#define MX_FP_OVERLOADS1_BF_VEC(name)                                          \
  template <class B, __mx::if_bfloat<B> = 0>                                   \
  inline B name(B x) { return (B)name((float)x); }                             \
  template <class V, __mx::if_vec<V, __mx::is_fp> = 0>                         \
  inline V name(V x) {                                                         \
    V r;                                                                       \
    for (int i = 0; i < __mx::vt<V>::n; ++i) r[i] = name(x[i]);                \
    return r;                                                                  \
  }
#define MX_FP_OVERLOADS2(name)                                                 \
  inline half name(half x, half y) { return (half)name((float)x, (float)y); }  \
  MX_FP_OVERLOADS2_BF_VEC(name)
#define MX_FP_OVERLOADS2_BF_VEC(name)                                          \
  template <class B, __mx::if_bfloat<B> = 0>                                   \
  inline B name(B x, B y) { return (B)name((float)x, (float)y); }              \
  template <class V, __mx::if_vec<V, __mx::is_fp> = 0>                         \
  inline V name(V x, V y) {                                                    \
    V r;                                                                       \
    for (int i = 0; i < __mx::vt<V>::n; ++i) r[i] = name(x[i], y[i]);          \
    return r;                                                                  \
  }
#define MX_FP_FUNC1(name, expr)            \
  inline float name(float x) { return expr; } \
  MX_FP_OVERLOADS1(name)
#define MX_FP_FUNC2(name, expr)                     \
  inline float name(float x, float y) { return expr; } \
  MX_FP_OVERLOADS2(name)
// A function whose accuracy the specification bounds in ulps (float `ulps`,
// half 1): `expr` its float result, `exact` the same in double, which
// MX_PERTURB moves from (__mx::off_by). bfloat computes in float and rounds
// (Table 8.4 gives no bfloat function a bound).
#define MX_FP_BOUNDED1(name, ulps, expr, exact)                                                   \
  inline float name(float x) {                                                                    \
    if (MX_PERTURB) return __mx::off_by<float>(exact, __mx::mix(__mx::name_hash(#name) ^ __mx::bits_of(x)), \
                                               (ulps) * MX_PERTURB);                              \
    return expr;                                                                                  \
  }                                                                                               \
  inline half name(half x) {                                                                      \
    if (MX_PERTURB) return __mx::off_by<half>(exact, __mx::mix(__mx::name_hash(#name) ^ __mx::bits_of(x)), \
                                              MX_PERTURB);                                        \
    return (half)name((float)x);                                                                  \
  }                                                                                               \
  MX_FP_OVERLOADS1_BF_VEC(name)
#define MX_FP_BOUNDED2(name, ulps, expr, exact)                                                        \
  inline float name(float x, float y) {                                                                \
    if (MX_PERTURB)                                                                                    \
      return __mx::off_by<float>(exact, __mx::mix(__mx::name_hash(#name) ^ __mx::bits_of(x) ^ (__mx::bits_of(y) << 32)), \
                                 (ulps) * MX_PERTURB);                                                 \
    return expr;                                                                                       \
  }                                                                                                    \
  inline half name(half x, half y) {                                                                   \
    if (MX_PERTURB)                                                                                    \
      return __mx::off_by<half>(exact, __mx::mix(__mx::name_hash(#name) ^ __mx::bits_of(x) ^ (__mx::bits_of(y) << 32)), \
                                MX_PERTURB);                                                           \
    return (half)name((float)x, (float)y);                                                             \
  }                                                                                                    \
  MX_FP_OVERLOADS2_BF_VEC(name)

#define MX_D ((double)x)
MX_FP_BOUNDED1(acos, 4, __builtin_acosf(x), __builtin_acos(MX_D))
MX_FP_BOUNDED1(acosh, 4, __builtin_acoshf(x), __builtin_acosh(MX_D))
MX_FP_BOUNDED1(asin, 4, __builtin_asinf(x), __builtin_asin(MX_D))
MX_FP_BOUNDED1(asinh, 4, __builtin_asinhf(x), __builtin_asinh(MX_D))
MX_FP_BOUNDED1(atan, 5, __builtin_atanf(x), __builtin_atan(MX_D))
MX_FP_BOUNDED1(atanh, 5, __builtin_atanhf(x), __builtin_atanh(MX_D))
MX_FP_FUNC1(ceil, __builtin_ceilf(x))
MX_FP_BOUNDED1(cos, 4, __builtin_cosf(x), __builtin_cos(MX_D))
MX_FP_BOUNDED1(cosh, 4, __builtin_coshf(x), __builtin_cosh(MX_D))
MX_FP_BOUNDED1(cospi, 4, (float)__mx::cospi(x), __mx::cospi(x))
MX_FP_BOUNDED1(exp, 4, __builtin_expf(x), __builtin_exp(MX_D))
MX_FP_BOUNDED1(exp2, 4, __builtin_exp2f(x), __builtin_exp2(MX_D))
MX_FP_BOUNDED1(exp10, 4, __builtin_powf(10.0f, x), __builtin_pow(10.0, MX_D))
MX_FP_FUNC1(fabs, __builtin_fabsf(x))
MX_FP_FUNC1(floor, __builtin_floorf(x))
MX_FP_FUNC1(fract, __builtin_fminf(x - __builtin_floorf(x), 0x1.fffffep-1f))
MX_FP_BOUNDED1(log, 4, __builtin_logf(x), __builtin_log(MX_D))
MX_FP_BOUNDED1(log2, 4, __builtin_log2f(x), __builtin_log2(MX_D))
MX_FP_BOUNDED1(log10, 4, __builtin_log10f(x), __builtin_log10(MX_D))
MX_FP_FUNC1(rint, __builtin_rintf(x))
MX_FP_FUNC1(round, __builtin_roundf(x))
// Correctly rounded (Table 8.1): 1 / sqrt in float would round twice. In
// double the quotient is within 2^-52 of the exact value, and no float's
// exact reciprocal square root lies that close to a midpoint between two
// floats (tests/cpu_metal/test_math.py checks the float inputs nearest one).
MX_FP_FUNC1(rsqrt, (float)(1.0 / __builtin_sqrt(MX_D)))
MX_FP_BOUNDED1(sin, 4, __builtin_sinf(x), __builtin_sin(MX_D))
MX_FP_BOUNDED1(sinh, 4, __builtin_sinhf(x), __builtin_sinh(MX_D))
MX_FP_BOUNDED1(sinpi, 4, (float)__mx::sinpi(x), __mx::sinpi(x))
MX_FP_FUNC1(sqrt, __builtin_sqrtf(x))
MX_FP_BOUNDED1(tan, 6, __builtin_tanf(x), __builtin_tan(MX_D))
MX_FP_BOUNDED1(tanh, 5, __builtin_tanhf(x), __builtin_tanh(MX_D))
MX_FP_BOUNDED1(tanpi, 6, (float)__mx::tanpi(x), __mx::tanpi(x))
MX_FP_FUNC1(trunc, __builtin_truncf(x))
MX_FP_FUNC1(saturate, __builtin_fminf(__builtin_fmaxf(x, 0.0f), 1.0f))
MX_FP_BOUNDED2(atan2, 6, __builtin_atan2f(x, y), __builtin_atan2(MX_D, (double)y))
MX_FP_FUNC2(copysign, __builtin_copysignf(x, y))
MX_FP_FUNC2(fdim, __builtin_fdimf(x, y))
MX_FP_FUNC2(fmax, __builtin_fmaxf(x, y))
MX_FP_FUNC2(fmin, __builtin_fminf(x, y))
MX_FP_FUNC2(fmod, __builtin_fmodf(x, y))
MX_FP_BOUNDED2(pow, 16, __builtin_powf(x, y), __builtin_pow(MX_D, (double)y))
MX_FP_BOUNDED2(powr, 16, __builtin_powf(x, y), __builtin_pow(MX_D, (double)y))
MX_FP_FUNC2(nextafter, __builtin_nextafterf(x, y))
MX_FP_FUNC2(divide, x / y)
#undef MX_D
#undef MX_FP_FUNC1
#undef MX_FP_FUNC2
#undef MX_FP_BOUNDED1
#undef MX_FP_BOUNDED2

inline float fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
inline half fma(half a, half b, half c) { return (half)__builtin_fmaf((float)a, (float)b, (float)c); }
template <class B, __mx::if_bfloat<B> = 0>
inline B fma(B a, B b, B c) { return (B)__builtin_fmaf((float)a, (float)b, (float)c); }
template <class V, __mx::if_vec<V, __mx::is_fp> = 0>
inline V fma(V a, V b, V c) {
  V r;
  for (int i = 0; i < __mx::vt<V>::n; ++i) r[i] = fma(a[i], b[i], c[i]);
  return r;
}
inline float ldexp(float x, int k) { return __builtin_ldexpf(x, k); }
inline half ldexp(half x, int k) { return (half)__builtin_ldexpf((float)x, k); }
inline float frexp(float x, thread int& e) { return __builtin_frexpf(x, &e); }
inline float modf(float x, thread float& ip) { return __builtin_modff(x, &ip); }
inline float sincos(float x, thread float& c) { c = cos(x); return sin(x); }
}  // namespace precise
using namespace precise;
namespace fast { using namespace precise; }

// min / max / clamp / abs for every scalar and vector type.
#define MX_MINMAX(T)                                                   \
  inline T min(T a, T b) { return b < a ? b : a; }                     \
  inline T max(T a, T b) { return a < b ? b : a; }                     \
  inline T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }      \
  inline T min3(T a, T b, T c) { return min(min(a, b), c); }           \
  inline T max3(T a, T b, T c) { return max(max(a, b), c); }           \
  inline T median3(T a, T b, T c) { return max(min(a, b), min(max(a, b), c)); }
MX_MINMAX(char) MX_MINMAX(signed char) MX_MINMAX(uchar) MX_MINMAX(short) MX_MINMAX(ushort)
MX_MINMAX(int) MX_MINMAX(uint) MX_MINMAX(long) MX_MINMAX(ulong)
#undef MX_MINMAX
// Floating min/max follow fmin/fmax: a NaN operand yields the other operand.
#define MX_FMINMAX(T)                                                                        \
  inline T min(T a, T b) { return (T)__builtin_fminf((float)a, (float)b); }                  \
  inline T max(T a, T b) { return (T)__builtin_fmaxf((float)a, (float)b); }                  \
  inline T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }                            \
  inline T min3(T a, T b, T c) { return min(min(a, b), c); }                                 \
  inline T max3(T a, T b, T c) { return max(max(a, b), c); }                                 \
  inline T median3(T a, T b, T c) { return max(min(a, b), min(max(a, b), c)); }
MX_FMINMAX(float) MX_FMINMAX(half)
#undef MX_FMINMAX
#define MX_FMINMAX_TEMPLATE(decl) template <class B, __mx::if_bfloat<B> = 0> inline decl
MX_FMINMAX_TEMPLATE(B min(B a, B b)) { return (B)__builtin_fminf((float)a, (float)b); }
MX_FMINMAX_TEMPLATE(B max(B a, B b)) { return (B)__builtin_fmaxf((float)a, (float)b); }
MX_FMINMAX_TEMPLATE(B clamp(B x, B lo, B hi)) { return min(max(x, lo), hi); }
MX_FMINMAX_TEMPLATE(B min3(B a, B b, B c)) { return min(min(a, b), c); }
MX_FMINMAX_TEMPLATE(B max3(B a, B b, B c)) { return max(max(a, b), c); }
MX_FMINMAX_TEMPLATE(B median3(B a, B b, B c)) { return max(min(a, b), min(max(a, b), c)); }
#undef MX_FMINMAX_TEMPLATE
template <class V, class = typename __mx::enable_if<__mx::vt<V>::is_vec>::type>
inline V min(V a, V b) { V r; for (int i = 0; i < __mx::vt<V>::n; ++i) r[i] = min(a[i], b[i]); return r; }
template <class V, class = typename __mx::enable_if<__mx::vt<V>::is_vec>::type>
inline V max(V a, V b) { V r; for (int i = 0; i < __mx::vt<V>::n; ++i) r[i] = max(a[i], b[i]); return r; }
template <class V, class = typename __mx::enable_if<__mx::vt<V>::is_vec>::type>
inline V clamp(V x, V lo, V hi) { return min(max(x, lo), hi); }
template <class V, class = typename __mx::enable_if<__mx::vt<V>::is_vec>::type>
inline V clamp(V x, typename __mx::vt<V>::elem lo, typename __mx::vt<V>::elem hi) { return min(max(x, V(lo)), V(hi)); }

inline float abs(float x) { return __builtin_fabsf(x); }
inline half abs(half x) { return (half)__builtin_fabsf((float)x); }
template <class B, __mx::if_bfloat<B> = 0>
inline B abs(B x) { return (B)__builtin_fabsf((float)x); }
inline int abs(int x) { return x < 0 ? -x : x; }
inline short abs(short x) { return x < 0 ? (short)-x : x; }
inline long abs(long x) { return x < 0 ? -x : x; }
inline uint abs(uint x) { return x; }
template <class V, class = typename __mx::enable_if<__mx::vt<V>::is_vec>::type>
inline V abs(V x) { V r; for (int i = 0; i < __mx::vt<V>::n; ++i) r[i] = abs(x[i]); return r; }

// mix / step / smoothstep / sign
template <class T, class = typename __mx::enable_if<__mx::is_fp<typename __mx::vt<T>::elem>::value>::type>
inline T mix(T x, T y, T a) { return x + (y - x) * a; }
template <class T, class = typename __mx::enable_if<__mx::is_fp<typename __mx::vt<T>::elem>::value>::type>
inline T step(T edge, T x) {
  if constexpr (__mx::vt<T>::is_vec) { T r; for (int i = 0; i < __mx::vt<T>::n; ++i) r[i] = x[i] < edge[i] ? 0 : 1; return r; }
  else return x < edge ? (T)0 : (T)1;
}
template <class T, class = typename __mx::enable_if<__mx::is_fp<typename __mx::vt<T>::elem>::value>::type>
inline T smoothstep(T e0, T e1, T x) {
  T t = clamp((x - e0) / (e1 - e0), T(0), T(1));
  return t * t * (T(3) - T(2) * t);
}
// MSL: 1 for x > 0, -1 for x < 0, x itself for +-0, +0 for NaN.
inline float sign(float x) { return x > 0 ? 1.0f : x < 0 ? -1.0f : x == 0 ? __builtin_copysignf(0.0f, x) : 0.0f; }
inline half sign(half x) { return (half)sign((float)x); }
inline bfloat sign(bfloat x) { return (bfloat)sign((float)x); }
template <class V, __mx::if_vec<V, __mx::is_fp> = 0>
inline V sign(V x) { V r; for (int i = 0; i < __mx::vt<V>::n; ++i) r[i] = sign(x[i]); return r; }

// -------------------------------------------------------------- relational --
inline bool isnan(float x) { return __builtin_isnan(x); }
inline bool isnan(half x) { return __builtin_isnan((float)x); }
inline bool isnan(bfloat x) { return __builtin_isnan((float)x); }
inline bool isinf(float x) { return __builtin_isinf(x); }
inline bool isinf(half x) { return __builtin_isinf((float)x); }
inline bool isinf(bfloat x) { return __builtin_isinf((float)x); }
inline bool isfinite(float x) { return __builtin_isfinite(x); }
inline bool isfinite(half x) { return __builtin_isfinite((float)x); }
inline bool isfinite(bfloat x) { return __builtin_isfinite((float)x); }
inline bool isnormal(float x) { return __builtin_isnormal(x); }
inline bool signbit(float x) { return __builtin_signbit(x); }
inline bool signbit(half x) { return __builtin_signbit((float)x); }
inline bool all(bool b) { return b; }
inline bool any(bool b) { return b; }
template <class V, class = typename __mx::enable_if<__mx::vt<V>::is_vec>::type>
inline bool all(V v) { for (int i = 0; i < __mx::vt<V>::n; ++i) if (!v[i]) return false; return true; }
template <class V, class = typename __mx::enable_if<__mx::vt<V>::is_vec>::type>
inline bool any(V v) { for (int i = 0; i < __mx::vt<V>::n; ++i) if (v[i]) return true; return false; }
template <class T>
inline T select(T a, T b, bool c) { return c ? b : a; }
template <class T, class M, class = typename __mx::enable_if<__mx::vt<T>::is_vec && __mx::vt<M>::is_vec>::type>
inline T select(T a, T b, M c) {
  static_assert(__mx::vt<T>::n == __mx::vt<M>::n, "select: mask width differs");
  T r; for (int i = 0; i < __mx::vt<T>::n; ++i) r[i] = c[i] ? b[i] : a[i]; return r;
}
#define MX_VEC_PRED(name)                                                     \
  template <class V, __mx::if_vec<V, __mx::is_fp> = 0>                        \
  inline __mx::boolv<__mx::vt<V>::n> name(V v) {                              \
    __mx::boolv<__mx::vt<V>::n> r;                                            \
    for (int i = 0; i < __mx::vt<V>::n; ++i) r[i] = name(v[i]);               \
    return r;                                                                 \
  }
MX_VEC_PRED(isnan) MX_VEC_PRED(isinf) MX_VEC_PRED(isfinite)
#undef MX_VEC_PRED

// --------------------------------------------------------------- geometric --
// On half and bfloat vectors these accumulate in float and round once. Apple
// does not document how the GPU evaluates them; if it rounds to half after
// every multiply-add, an n-element dot product (n <= 4) differs from this one
// by at most (n + 1) * 2^-11 * sum |a_i b_i| (length and distance: the same
// bound on the squared length, then one more half-ulp for the square root).
template <class V, __mx::if_vec<V, __mx::is_fp> = 0>
inline typename __mx::vt<V>::elem dot(V a, V b) {
  float s = 0;
  for (int i = 0; i < __mx::vt<V>::n; ++i) s += (float)a[i] * (float)b[i];
  return (typename __mx::vt<V>::elem)s;
}
template <class V, __mx::if_vec<V, __mx::is_fp> = 0>
inline typename __mx::vt<V>::elem length_squared(V a) { return dot(a, a); }
template <class V, __mx::if_vec<V, __mx::is_fp> = 0>
inline typename __mx::vt<V>::elem length(V a) { return sqrt(dot(a, a)); }
template <class V, __mx::if_vec<V, __mx::is_fp> = 0>
inline typename __mx::vt<V>::elem distance(V a, V b) { return length(a - b); }
template <class V, __mx::if_vec<V, __mx::is_fp> = 0>
inline V normalize(V a) { return a * rsqrt(dot(a, a)); }
inline float3 cross(float3 a, float3 b) { return a.yzx * b.zxy - a.zxy * b.yzx; }

// ----------------------------------------------------------------- integer --
template <class T, class = typename __mx::enable_if<__mx::is_int<T>::value>::type>
inline T popcount(T x) { return (T)__builtin_popcountll((unsigned long long)x & (~0ull >> (64 - 8 * sizeof(T)))); }
template <class T, class = typename __mx::enable_if<__mx::is_int<T>::value>::type>
inline T clz(T x) {
  unsigned long long u = (unsigned long long)x & (~0ull >> (64 - 8 * sizeof(T)));
  return u == 0 ? (T)(8 * sizeof(T)) : (T)(__builtin_clzll(u) - (64 - 8 * sizeof(T)));
}
template <class T, class = typename __mx::enable_if<__mx::is_int<T>::value>::type>
inline T ctz(T x) {
  unsigned long long u = (unsigned long long)x & (~0ull >> (64 - 8 * sizeof(T)));
  return u == 0 ? (T)(8 * sizeof(T)) : (T)__builtin_ctzll(u);
}
inline uint mulhi(uint a, uint b) { return (uint)(((ulong)a * b) >> 32); }
inline int mulhi(int a, int b) { return (int)(((long)a * b) >> 32); }
inline uint extract_bits(uint x, uint offset, uint bits) { return bits == 32 ? x : (x >> offset) & ((1u << bits) - 1u); }
inline uint insert_bits(uint base, uint ins, uint offset, uint bits) {
  uint mask = (bits == 32 ? ~0u : ((1u << bits) - 1u)) << offset;
  return (base & ~mask) | ((ins << offset) & mask);
}
inline uint reverse_bits(uint x) { return __builtin_bitreverse32(x); }
inline uint rotate(uint v, uint i) { return __builtin_rotateleft32(v, i); }
inline uint absdiff(int a, int b) { return a > b ? (uint)(a - b) : (uint)(b - a); }
inline uint absdiff(uint a, uint b) { return a > b ? a - b : b - a; }
inline uint hadd(uint a, uint b) { return (uint)(((ulong)a + b) >> 1); }
inline int hadd(int a, int b) { return (int)(((long)a + b) >> 1); }
inline uint addsat(uint a, uint b) { uint s = a + b; return s < a ? 0xffffffffu : s; }
inline uint subsat(uint a, uint b) { return a > b ? a - b : 0u; }
}  // namespace metal

// ------------------------------------------------------ engine connection --

// The instrumenter (_instrument.py) calls these; it never instruments them.
// Every memory access it finds becomes a call to __mx_access.
extern "C" __attribute__((used)) inline void __mx_access(const void* p, mx_u64 n, mx_u32 f) {
  __mx_api->access(p, n, f);
}
extern "C" __attribute__((used)) inline void __mx_enter(mx_u32 key, mx_u32 site, mx_u32 depth) {
  __mx_api->enter(key, site, depth);
}
extern "C" __attribute__((used)) inline void __mx_leave() { __mx_api->leave(); }
extern "C" __attribute__((used)) inline void __mx_loop(mx_u32 key, mx_u32 site, mx_u32 depth) {
  __mx_api->loop(key, site, depth);
}
// A float-to-integer conversion in shader code: `ok` is false for NaN or a
// value outside the integer's range.
extern "C" __attribute__((used)) inline void __mx_convert_check(bool ok, mx_u32 flags) {
  if (__builtin_expect(!ok, 0)) __mx_api->conversion_error(flags, nullptr, 0, 0);
}
// An integer division or remainder in shader code: `ok` is false for a
// zero divisor, INT_MIN / -1 or `%` of a negative operand.
extern "C" __attribute__((used)) inline void __mx_arith_check(bool ok, mx_u32 kind, mx_u32 flags) {
  if (__builtin_expect(!ok, 0)) __mx_api->arithmetic_error(kind, flags);
}
// Every simd operation and barrier goes through these two, so that the
// instrumenter sees which functions reach one.
extern "C" __attribute__((used)) inline void __mx_simd(mx_simd_fn fn, const void* in, void* out, mx_i64 arg,
                                                       mx_u32 flags) {
  __mx_api->simd(fn, in, out, arg, flags);
}
extern "C" __attribute__((used)) inline void __mx_barrier(mx_u32 scope, mx_u32 mem) { __mx_api->barrier(scope, mem); }
// The running thread's counters of 64-bit integer work: the instrumenter
// calls this once per invocation of a function it counts in (count_int64).
extern "C" __attribute__((used)) inline mx_u64* __mx_op_counts() { return __mx_api->op_counts(); }

// float -> bfloat conversion with round-to-nearest-even, for C runtimes that
// lack it (libgcc before 13).
extern "C" __attribute__((weak)) __bf16 __truncsfbf2(float f) {
  unsigned u = __builtin_bit_cast(unsigned, f);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    u |= 0x00400000u;  // quiet the NaN, keep its sign
  } else {
    u += 0x7fffu + ((u >> 16) & 1u);
  }
  return __builtin_bit_cast(__bf16, (unsigned short)(u >> 16));
}

namespace __mx {
template <class T>
inline T poison() {
  struct bytes { unsigned char b[sizeof(T)]; } p;
  for (unsigned i = 0; i < sizeof(T); ++i) p.b[i] = 0xff;  // NaN in every float format
  return __builtin_bit_cast(T, p);
}

template <class T>
inline const T& in(const mx_simd_lane* l, int i) { return *static_cast<const T*>(l[i].in); }
template <class T>
inline void out(const mx_simd_lane* l, int i, T v) { *static_cast<T*>(l[i].out) = v; }
inline bool active(mx_u32 mask, int i) { return (mask >> i) & 1u; }

template <class T, class R = T>
inline R simd_call(mx_simd_fn fn, const T& x, mx_i64 arg = 0, mx_u32 flags = 0) {
  // The engine gets the address of a copy, not of the caller's variable: a
  // simd operation takes a value, and an element of a thread-private array
  // whose address escaped would keep the whole array in memory (in the
  // optimised IR the register estimate reads, and in the executable).
  T in = x;
  R r;
  __mx_simd(fn, &in, &r, arg, flags);
  return r;
}

struct op_add { template <class T> static T apply(T a, T b) { return a + b; } static constexpr int identity = 0; };
struct op_mul { template <class T> static T apply(T a, T b) { return a * b; } static constexpr int identity = 1; };
struct op_min { template <class T> static T apply(T a, T b) { return metal::min(a, b); } };
struct op_max { template <class T> static T apply(T a, T b) { return metal::max(a, b); } };
struct op_and { template <class T> static T apply(T a, T b) { return a & b; } };
struct op_or { template <class T> static T apply(T a, T b) { return a | b; } };
struct op_xor { template <class T> static T apply(T a, T b) { return a ^ b; } };

// Reduction over the active lanes, as a butterfly tree (pairs at distance
// 16, 8, 4, 2, 1), the shape of a hardware simd reduction.
template <class Op, class T>
void reduce_fn(const mx_simd_lane* l, mx_u32 mask, mx_u32) {
  T v[32];
  bool has[32];
  for (int i = 0; i < 32; ++i) {
    has[i] = active(mask, i);
    if (has[i]) v[i] = in<T>(l, i);
  }
  for (int d = 16; d >= 1; d >>= 1) {
    for (int i = 0; i < d; ++i) {
      if (has[i] && has[i + d]) v[i] = Op::apply(v[i], v[i + d]);
      else if (has[i + d]) { v[i] = v[i + d]; has[i] = true; }
    }
  }
  for (int i = 0; i < 32; ++i)
    if (active(mask, i)) out<T>(l, i, v[0]);
}

// Prefix over the active lanes in lane order.
template <class Op, class T, bool Inclusive>
void scan_fn(const mx_simd_lane* l, mx_u32 mask, mx_u32) {
  T acc = T(Op::identity);
  for (int i = 0; i < 32; ++i) {
    if (!active(mask, i)) continue;
    T x = in<T>(l, i);
    if (Inclusive) { acc = Op::apply(acc, x); out<T>(l, i, acc); }
    else { out<T>(l, i, acc); acc = Op::apply(acc, x); }
  }
}

enum shuffle_kind { SH_INDEX, SH_UP, SH_DOWN, SH_XOR, SH_BROADCAST_FIRST, SH_ROTATE_UP, SH_ROTATE_DOWN };

// Lane `src` must exist and be active; otherwise the value is undefined in
// Metal, and here it is poison.
template <class T>
inline T from_lane(const mx_simd_lane* l, mx_u32 mask, int src) {
  if (src < 0 || src >= 32 || !active(mask, src)) return poison<T>();
  return in<T>(l, src);
}

template <class T, int Kind>
void shuffle_fn(const mx_simd_lane* l, mx_u32 mask, mx_u32 n) {
  int first = __builtin_ctz(mask);
  for (int i = 0; i < 32; ++i) {
    if (!active(mask, i)) continue;
    long a = l[i].arg;
    T r;
    switch (Kind) {
      case SH_INDEX: r = from_lane<T>(l, mask, (int)a); break;
      case SH_UP: r = (long)i >= a ? from_lane<T>(l, mask, i - (int)a) : in<T>(l, i); break;
      case SH_DOWN: r = i + a < 32 ? from_lane<T>(l, mask, i + (int)a) : in<T>(l, i); break;
      case SH_XOR: r = from_lane<T>(l, mask, i ^ (int)a); break;
      case SH_BROADCAST_FIRST: r = in<T>(l, first); break;
      case SH_ROTATE_UP: r = from_lane<T>(l, mask, (int)((i - a % n + n) % n)); break;
      case SH_ROTATE_DOWN: r = from_lane<T>(l, mask, (int)((i + a) % n)); break;
    }
    out<T>(l, i, r);
  }
}

template <class T> struct fill_pair { T data; T fill; };

// simd_shuffle_and_fill_{up,down}: within segments of `modulo` lanes (the
// whole simdgroup by default), shift by delta and take the lanes shifted in
// from `filling_data` of the same segment.
template <class T, bool Up>
void fill_fn(const mx_simd_lane* l, mx_u32 mask, mx_u32) {
  for (int i = 0; i < 32; ++i) {
    if (!active(mask, i)) continue;
    int delta = (int)(l[i].arg & 0xffff), modulo = (int)(l[i].arg >> 16);
    int base = i - i % modulo, k = i % modulo;
    T r;
    if (Up) {
      int s = k - delta;
      r = s >= 0 ? from_lane<fill_pair<T>>(l, mask, base + s).data
                 : from_lane<fill_pair<T>>(l, mask, base + s + modulo).fill;
    } else {
      int s = k + delta;
      r = s < modulo ? from_lane<fill_pair<T>>(l, mask, base + s).data
                     : from_lane<fill_pair<T>>(l, mask, base + s - modulo).fill;
    }
    out<T>(l, i, r);
  }
}

inline void mask_fn(const mx_simd_lane* l, mx_u32 mask, mx_u32) {
  for (int i = 0; i < 32; ++i)
    if (active(mask, i)) out<mx_u64>(l, i, (mx_u64)mask);
}
inline void ballot_fn(const mx_simd_lane* l, mx_u32 mask, mx_u32) {
  mx_u64 v = 0;
  for (int i = 0; i < 32; ++i)
    if (active(mask, i) && in<bool>(l, i)) v |= 1ull << i;
  for (int i = 0; i < 32; ++i)
    if (active(mask, i)) out<mx_u64>(l, i, v);
}
}  // namespace __mx

namespace metal {
// ------------------------------------------------------------- barriers --
enum class mem_flags : uint {
  mem_none = 0,
  mem_device = MX_MEM_DEVICE,
  mem_threadgroup = MX_MEM_THREADGROUP,
  mem_texture = 4,
  mem_threadgroup_imageblock = 8,
  mem_object_data = 16,
};
constexpr mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags((uint)a | (uint)b); }

inline void threadgroup_barrier(mem_flags f) { __mx_barrier(MX_SCOPE_THREADGROUP, (mx_u32)f); }
inline void simdgroup_barrier(mem_flags f) { __mx_barrier(MX_SCOPE_SIMDGROUP, (mx_u32)f); }

// ------------------------------------------------------- simd functions --
#define MX_SIMD_REDUCE(name, Op)                                                       \
  template <class T>                                                                   \
  inline T name(T x) {                                    \
    return __mx::simd_call<T>(&__mx::reduce_fn<__mx::Op, T>, x);              \
  }
MX_SIMD_REDUCE(simd_sum, op_add)
MX_SIMD_REDUCE(simd_product, op_mul)
MX_SIMD_REDUCE(simd_min, op_min)
MX_SIMD_REDUCE(simd_max, op_max)
MX_SIMD_REDUCE(simd_and, op_and)
MX_SIMD_REDUCE(simd_or, op_or)
MX_SIMD_REDUCE(simd_xor, op_xor)
#undef MX_SIMD_REDUCE

#define MX_SIMD_SCAN(name, Op, incl)                                                   \
  template <class T>                                                                   \
  inline T name(T x) {                                    \
    return __mx::simd_call<T>(&__mx::scan_fn<__mx::Op, T, incl>, x);          \
  }
MX_SIMD_SCAN(simd_prefix_inclusive_sum, op_add, true)
MX_SIMD_SCAN(simd_prefix_exclusive_sum, op_add, false)
MX_SIMD_SCAN(simd_prefix_inclusive_product, op_mul, true)
MX_SIMD_SCAN(simd_prefix_exclusive_product, op_mul, false)
#undef MX_SIMD_SCAN

#define MX_SIMD_SHUFFLE(name, kind)                                                    \
  template <class T>                                                                   \
  inline T name(T x, ushort a) {                          \
    return __mx::simd_call<T>(&__mx::shuffle_fn<T, __mx::kind>, x, a);           \
  }
MX_SIMD_SHUFFLE(simd_shuffle, SH_INDEX)
MX_SIMD_SHUFFLE(simd_broadcast, SH_INDEX)
MX_SIMD_SHUFFLE(simd_shuffle_up, SH_UP)
MX_SIMD_SHUFFLE(simd_shuffle_down, SH_DOWN)
MX_SIMD_SHUFFLE(simd_shuffle_xor, SH_XOR)
MX_SIMD_SHUFFLE(simd_shuffle_rotate_up, SH_ROTATE_UP)
MX_SIMD_SHUFFLE(simd_shuffle_rotate_down, SH_ROTATE_DOWN)
#undef MX_SIMD_SHUFFLE

template <class T>
inline T simd_broadcast_first(T x) {
  return __mx::simd_call<T>(&__mx::shuffle_fn<T, __mx::SH_BROADCAST_FIRST>, x);
}
template <class T>
inline T simd_shuffle_and_fill_up(T data, T fill, ushort delta, ushort modulo) {
  __mx::fill_pair<T> p{data, fill};
  return __mx::simd_call<__mx::fill_pair<T>, T>(&__mx::fill_fn<T, true>, p, (mx_i64)delta | ((mx_i64)modulo << 16));
}
template <class T>
inline T simd_shuffle_and_fill_up(T data, T fill, ushort delta) {
  return simd_shuffle_and_fill_up(data, fill, delta, (ushort)MX_SIMD_WIDTH);
}
template <class T>
inline T simd_shuffle_and_fill_down(T data, T fill, ushort delta, ushort modulo) {
  __mx::fill_pair<T> p{data, fill};
  return __mx::simd_call<__mx::fill_pair<T>, T>(&__mx::fill_fn<T, false>, p, (mx_i64)delta | ((mx_i64)modulo << 16));
}
template <class T>
inline T simd_shuffle_and_fill_down(T data, T fill, ushort delta) {
  return simd_shuffle_and_fill_down(data, fill, delta, (ushort)MX_SIMD_WIDTH);
}

struct simd_vote {
  typedef ulong vote_t;
  vote_t v;
  explicit constexpr simd_vote(vote_t x = 0) : v(x) {}
  explicit constexpr operator vote_t() const { return v; }
  constexpr bool all() const { return v == 0xffffffffull; }
  constexpr bool any() const { return v != 0; }
};
inline simd_vote simd_ballot(bool pred) {
  return simd_vote(__mx::simd_call<bool, mx_u64>(&__mx::ballot_fn, pred));
}
inline simd_vote simd_active_threads_mask() {
  return simd_vote(__mx::simd_call<bool, mx_u64>(&__mx::mask_fn, true));
}
inline bool simd_all(bool pred) {
  mx_u64 active = __mx::simd_call<bool, mx_u64>(&__mx::mask_fn, true);
  mx_u64 yes = __mx::simd_call<bool, mx_u64>(&__mx::ballot_fn, pred);
  return active == yes;
}
inline bool simd_any(bool pred) {
  return __mx::simd_call<bool, mx_u64>(&__mx::ballot_fn, pred) != 0;
}
}  // namespace metal

// ------------------------------------------------------------ threads info --
namespace __mx {
// The calling thread's lane, for simdgroup_matrix fragments.
inline mx_u32 lane_id() { return __mx_api->current_thread()->thread_index_in_simdgroup; }
}  // namespace __mx

// ---------------------------------------------------------------- atomics --
namespace metal {
enum memory_order {
  memory_order_relaxed = __ATOMIC_RELAXED,
  memory_order_seq_cst = __ATOMIC_SEQ_CST,
};
enum thread_scope { thread_scope_thread, thread_scope_threadgroup, thread_scope_device, thread_scope_simdgroup };

template <class T>
struct atomic {
  typedef T value_type;
  alignas(sizeof(T)) T __v;
};
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;
typedef atomic<float> atomic_float;
typedef atomic<bool> atomic_bool;
typedef atomic<ulong> atomic_ulong;
typedef atomic<long> atomic_long;
}  // namespace metal

namespace __mx {
// Which atomic functions MSL 3.1 has, by type and address space:
// atomic_int, atomic_uint and atomic_bool: all of them, in device and
// threadgroup memory; atomic_float (Metal 3.0+): load, store, exchange,
// compare-exchange, fetch_add and fetch_sub, in device memory only;
// atomic_ulong: only atomic_min_explicit / atomic_max_explicit (no fetch,
// Apple8+), in device memory only. The address space is known in check mode
// (which every compile_library runs); the other checks hold in both modes.
enum atomic_kind { ATOMIC_ANY, ATOMIC_ADD_SUB, ATOMIC_BITS_MIN_MAX, ATOMIC_MIN_MAX_64 };
template <class A, int Kind>
struct atomic_ok {
  typedef typename remove_cv<typename A::value_type>::type T;
  static constexpr bool i32 = is_same<T, int>::value || is_same<T, uint>::value || is_same<T, bool>::value;
  static constexpr bool f32 = is_same<T, float>::value && !in_threadgroup<A>::value;
  static constexpr bool value = Kind == ATOMIC_ANY       ? i32 || f32
                                : Kind == ATOMIC_ADD_SUB ? i32 || f32
                                : Kind == ATOMIC_BITS_MIN_MAX
                                    ? i32
                                    : is_same<T, ulong>::value && !in_threadgroup<A>::value;
};
template <class A, int Kind> using if_atomic_ok = typename enable_if<atomic_ok<A, Kind>::value, int>::type;
template <class A, int Kind> using if_atomic_bad = typename enable_if<!atomic_ok<A, Kind>::value, int>::type;
}  // namespace __mx

namespace metal {
// Metal's atomics are relaxed; the executor makes every one sequentially
// consistent, which is one of the orders relaxed allows, and a point where
// another thread may run (so that a thread spinning on an atomic lets the
// thread it waits for proceed).
#define MX_ATOMIC_UNSUPPORTED                                                                          \
  __attribute__((unavailable(                                                                          \
      "Metal has no such atomic function for this type and address space: atomic_int, atomic_uint "   \
      "and atomic_bool have all of them, atomic_float (device memory only) load, store, exchange, "   \
      "compare-exchange, fetch_add and fetch_sub, atomic_ulong (device memory only) atomic_min/max_explicit")))
// Each function twice: for the combinations Metal has, and, unavailable,
// for the others, so that the error names the shader's line.
// In check mode the bodies are not compiled (C++ has no pointer to a local
// in another address space for the __atomic builtins); the signatures are
// what is checked.
#if MX_ADDRESS_SPACES
#define MX_ATOMIC_BODY(R, body) { return R(); }
#else
#define MX_ATOMIC_BODY(R, body) body
#endif
#define MX_ATOMIC_FN(kind, R, name, params, body)                                                         \
  template <class A, __mx::if_atomic_ok<A, __mx::kind> = 0> inline R name params MX_ATOMIC_BODY(R, body) \
  template <class A, __mx::if_atomic_bad<A, __mx::kind> = 0> MX_ATOMIC_UNSUPPORTED R name params;
#define MX_V typename A::value_type

MX_ATOMIC_FN(ATOMIC_ANY, void, atomic_store_explicit, (A* obj, MX_V v, memory_order), {
  MX_V x = v;
  __atomic_store(&obj->__v, &x, __ATOMIC_SEQ_CST);
})
MX_ATOMIC_FN(ATOMIC_ANY, MX_V, atomic_load_explicit, (A* obj, memory_order), {
  typename __mx::remove_cv<MX_V>::type r;
  __atomic_load(&obj->__v, &r, __ATOMIC_SEQ_CST);
  return r;
})
MX_ATOMIC_FN(ATOMIC_ANY, MX_V, atomic_exchange_explicit, (A* obj, MX_V v, memory_order), {
  typename __mx::remove_cv<MX_V>::type x = v;
  typename __mx::remove_cv<MX_V>::type r;
  __atomic_exchange(&obj->__v, &x, &r, __ATOMIC_SEQ_CST);
  return r;
})
// Compares the bytes, as C++ does (so +0.0 and -0.0 differ for atomic_float).
MX_ATOMIC_FN(ATOMIC_ANY, bool, atomic_compare_exchange_weak_explicit,
             (A* obj, thread MX_V* expected, MX_V desired, memory_order, memory_order), {
  typename __mx::remove_cv<MX_V>::type d = desired;
  return __atomic_compare_exchange(&obj->__v, expected, &d, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
})
MX_ATOMIC_FN(ATOMIC_ADD_SUB, MX_V, atomic_fetch_add_explicit, (A* obj, MX_V v, memory_order), {
  return __atomic_fetch_add(&obj->__v, v, __ATOMIC_SEQ_CST);
})
MX_ATOMIC_FN(ATOMIC_ADD_SUB, MX_V, atomic_fetch_sub_explicit, (A* obj, MX_V v, memory_order), {
  return __atomic_fetch_sub(&obj->__v, v, __ATOMIC_SEQ_CST);
})
MX_ATOMIC_FN(ATOMIC_BITS_MIN_MAX, MX_V, atomic_fetch_and_explicit, (A* obj, MX_V v, memory_order), {
  return __atomic_fetch_and(&obj->__v, v, __ATOMIC_SEQ_CST);
})
MX_ATOMIC_FN(ATOMIC_BITS_MIN_MAX, MX_V, atomic_fetch_or_explicit, (A* obj, MX_V v, memory_order), {
  return __atomic_fetch_or(&obj->__v, v, __ATOMIC_SEQ_CST);
})
MX_ATOMIC_FN(ATOMIC_BITS_MIN_MAX, MX_V, atomic_fetch_xor_explicit, (A* obj, MX_V v, memory_order), {
  return __atomic_fetch_xor(&obj->__v, v, __ATOMIC_SEQ_CST);
})
MX_ATOMIC_FN(ATOMIC_BITS_MIN_MAX, MX_V, atomic_fetch_min_explicit, (A* obj, MX_V v, memory_order), {
  return __atomic_fetch_min(&obj->__v, v, __ATOMIC_SEQ_CST);
})
MX_ATOMIC_FN(ATOMIC_BITS_MIN_MAX, MX_V, atomic_fetch_max_explicit, (A* obj, MX_V v, memory_order), {
  return __atomic_fetch_max(&obj->__v, v, __ATOMIC_SEQ_CST);
})
MX_ATOMIC_FN(ATOMIC_MIN_MAX_64, void, atomic_min_explicit, (A* obj, MX_V v, memory_order), {
  __atomic_fetch_min(&obj->__v, v, __ATOMIC_SEQ_CST);
})
MX_ATOMIC_FN(ATOMIC_MIN_MAX_64, void, atomic_max_explicit, (A* obj, MX_V v, memory_order), {
  __atomic_fetch_max(&obj->__v, v, __ATOMIC_SEQ_CST);
})
#undef MX_V
#undef MX_ATOMIC_FN
#undef MX_ATOMIC_BODY
#undef MX_ATOMIC_UNSUPPORTED

#if __METAL_VERSION__ >= 320
// MSL 3.2: orders this thread's accesses to the given memory before and
// after it. The executor's check for reads of other threadgroups' writes
// (engine.cpp) counts a device fence like threadgroup_barrier(mem_device).
inline void atomic_thread_fence(mem_flags f, memory_order, thread_scope = thread_scope_device) {
  __mx_api->fence((mx_u32)f);
}
#endif
}  // namespace metal

// ------------------------------------------------------- simdgroup_matrix --
namespace __mx {
// What simdgroup_matrix::thread_elements() returns. Apple does not publish
// its type: vec<T, 2>& or a type of its own. Public kernels index it ([0],
// [1]) or reinterpret_cast it to vec<T, 2>&, which compile under either
// reading, so this type allows just those: a whole vector assigned to or
// taken from it fails to compile, as it may on a Mac.
#define MX_WHOLE_FRAGMENT                                                                              \
  __attribute__((unavailable("thread_elements() is not assigned or read as a whole vector: Apple does " \
                             "not publish its type, and Metal converts no vector to another size; index " \
                             "it ([0], [1]) or cast it first: reinterpret_cast<thread vec<T, 2>&>("    \
                             "m.thread_elements()) [msl-thread-elements]")))
template <class T>
struct fragment {
  vec<T, 2> __v;
  thread T& operator[](int i) { return ((thread T*)&__v)[i]; }
  T operator[](int i) const { return __v[i]; }
  template <class V> MX_WHOLE_FRAGMENT thread fragment& operator=(const V&);
  template <class V> MX_WHOLE_FRAGMENT operator V() const;
};
#undef MX_WHOLE_FRAGMENT
}  // namespace __mx

namespace metal {
// An 8x8 matrix spread over the 32 lanes of a simdgroup, two elements per
// lane, in the layout Apple GPUs use: lane l holds row
// (l/4 & 4) + (l/2) % 4, columns c and c+1 with c = (l/4 & 2) * 2 + (l % 2) * 2.
// Loads and stores touch only the lane's own two elements, so the executor's
// byte counters see what the hardware reads.
template <class T, int R, int C>
struct simdgroup_matrix {
  static_assert(R == 8 && C == 8, "the CPU Metal executor supports 8x8 simdgroup matrices");
  vec<T, 2> __e;
  simdgroup_matrix() = default;
  // A diagonal matrix, as Metal's scalar constructor makes.
  explicit simdgroup_matrix(T diagonal) {
    mx_u32 l = __mx::lane_id(), q = l / 4;
    mx_u32 row = (q & 4) + (l / 2) % 4, col = (q & 2) * 2 + (l % 2) * 2;
    __e[0] = row == col ? diagonal : T(0);
    __e[1] = row == col + 1 ? diagonal : T(0);
  }
  thread __mx::fragment<T>& thread_elements() { return reinterpret_cast<thread __mx::fragment<T>&>(__e); }
  const thread __mx::fragment<T>& thread_elements() const {
    return reinterpret_cast<const thread __mx::fragment<T>&>(__e);
  }
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;

// MSL declares it <T, Cols, Rows = Cols>: make_filled_simdgroup_matrix<float, 8>
// is a square matrix (MLX's gated_delta_update.h spells it so).
template <class T, int R, int C = R>
inline simdgroup_matrix<T, R, C> make_filled_simdgroup_matrix(T value) {
  simdgroup_matrix<T, R, C> m;
  m.__e = vec<T, 2>(value);
  return m;
}
}  // namespace metal

namespace __mx {
inline void frag_coord(mx_u32& row, mx_u32& col) {
  mx_u32 l = lane_id(), q = l / 4;
  row = (q & 4) + (l / 2) % 4;
  col = (q & 2) * 2 + (l % 2) * 2;
}
// The arguments of a collective load or store must be the same in every lane.
struct matrix_args {
  const void* p;
  ulong elements_per_row;
  ulong origin_x, origin_y;
  bool transpose;
};
// Each lane learns whether all lanes passed the same arguments; the lanes
// report a mismatch themselves (an engine callback must not fail).
inline void uniform_args_fn(const mx_simd_lane* l, mx_u32 mask, mx_u32) {
  const matrix_args* first = nullptr;
  bool same = true;
  for (int i = 0; i < 32; ++i) {
    if (!active(mask, i)) continue;
    const matrix_args& a = in<matrix_args>(l, i);
    if (!first) { first = &a; continue; }
    same = same && a.p == first->p && a.elements_per_row == first->elements_per_row &&
           a.origin_x == first->origin_x && a.origin_y == first->origin_y && a.transpose == first->transpose;
  }
  for (int i = 0; i < 32; ++i)
    if (active(mask, i)) out<bool>(l, i, same);
}
// `kind` (MX_SIMD_MATRIX_LOAD or _STORE) and the address go to the engine's
// counters of matrix loads and stores by address space.
inline void require_uniform(const matrix_args& a, const char* what, mx_u32 kind) {
  bool same;
  __mx_simd(&uniform_args_fn, &a, &same, (mx_i64)a.p, MX_SIMD_UNIFORM | MX_SIMD_MATRIX | kind);
  if (!same) __mx_api->fail(what);
}
// Element (row, col) of the matrix lives at this offset from the pointer.
// With transpose the origin is 0 (require_plain_origin), so the question of
// whether it counts in memory or in matrix coordinates does not arise.
inline ulong matrix_offset(const matrix_args& a, mx_u32 row, mx_u32 col) {
  return a.transpose ? col * a.elements_per_row + row
                     : (a.origin_y + row) * a.elements_per_row + a.origin_x + col;
}
// The specification does not say whether matrix_origin counts in memory or
// in matrix coordinates when transpose_matrix is true, and public code
// (metal-flash-attention's reimplementation) reads it the other way from
// this executor: only origin 0 means the same under both.
// Out of line, so that its message buffer is not a private array of every
// kernel that loads a matrix (the budgets count those).
__attribute__((noinline, cold)) inline void fail_transposed_origin(const char* fn, const char* file, mx_u32 line) {
  char msg[768];
  mx_u32 n = 0;
  auto put = [&](const char* t) {
    while (*t && n + 1 < sizeof msg) msg[n++] = *t++;
  };
  char digits[12], *d = digits + sizeof digits;
  *--d = 0;
  do *--d = char('0' + line % 10); while (line /= 10);
  put(file), put(":"), put(d), put(": "), put(fn);
  put(": a non-zero matrix_origin with transpose_matrix = true: the Metal specification does not say whether it "
      "then counts in memory or in matrix coordinates, and the two readings address different elements; pass "
      "origin 0 and offset the pointer");
  msg[n] = 0;
  __mx_api->fail(msg);
}
inline void require_plain_origin(const matrix_args& a, const char* fn, const char* file, mx_u32 line) {
  if (a.transpose && (a.origin_x || a.origin_y)) fail_transposed_origin(fn, file, line);
}
// Two adjacent elements in one access, as a GPU moves them: an 8-byte
// access per lane for float, aligned to the element only (elements_per_row
// and the origin may be odd).
template <class T>
struct __attribute__((packed, aligned(sizeof(T)))) pair {
  vec<T, 2> v;
};

struct mma_lane { float a[2], b[2], c[2]; };
// D = A * B + C over the whole simdgroup, accumulated in float and rounded
// once to D's type. With float D this is what the hardware does up to the
// order of the 8 additions. With half D, Apple does not document whether
// the GPU rounds to half after each multiply-add; if it does, its result
// differs from this one by at most 9 * 2^-11 * (sum_k |a_ik b_kj| + |c_ij|)
// (8 roundings of partial sums, one of the result, each within half an ulp
// of 2^-10 relative).
inline void mma_fn(const mx_simd_lane* l, mx_u32, mx_u32) {
  float A[8][8], B[8][8], Cm[8][8];
  for (mx_u32 i = 0; i < 32; ++i) {
    mx_u32 q = i / 4, row = (q & 4) + (i / 2) % 4, col = (q & 2) * 2 + (i % 2) * 2;
    const mma_lane& x = in<mma_lane>(l, i);
    for (int j = 0; j < 2; ++j) {
      A[row][col + j] = x.a[j];
      B[row][col + j] = x.b[j];
      Cm[row][col + j] = x.c[j];
    }
  }
  for (mx_u32 i = 0; i < 32; ++i) {
    mx_u32 q = i / 4, row = (q & 4) + (i / 2) % 4, col = (q & 2) * 2 + (i % 2) * 2;
    float* d = static_cast<float*>(l[i].out);
    for (int j = 0; j < 2; ++j) {
      float s = Cm[row][col + j];
      for (int k = 0; k < 8; ++k) s += A[row][k] * B[k][col + j];
      d[j] = s;
    }
  }
}
}  // namespace __mx

namespace metal {
// Metal loads and stores a simdgroup_matrix<T> from and to memory of T only
// (const T for loads); anything else does not compile on a Mac.
#define MX_MATRIX_MEMORY_MISMATCH                                                              \
  __attribute__((unavailable("the element type of the memory differs from the matrix's; Metal " \
                             "loads and stores a simdgroup_matrix<T> only from and to T")))
template <class T, class P, __mx::if_same_unqual<T, P> = 0>
inline void simdgroup_load(thread simdgroup_matrix<T, 8, 8>& d, P* src, ulong elements_per_row = 8,
                           ulong2 matrix_origin = ulong2(0), bool transpose_matrix = false,
                           const char* __file = __builtin_FILE(), mx_u32 __line = __builtin_LINE()) {
  __mx::matrix_args a{(const void*)src, elements_per_row, matrix_origin.x, matrix_origin.y, transpose_matrix};
  __mx::require_uniform(a, "simdgroup_load: the lanes of a simdgroup passed different arguments", MX_SIMD_MATRIX_LOAD);
  __mx::require_plain_origin(a, "simdgroup_load", __file, __line);
  mx_u32 row, col;
  __mx::frag_coord(row, col);
#if !MX_ADDRESS_SPACES
  if (!transpose_matrix) {  // the lane's two elements are adjacent: one access
    d.__e = ((const __mx::pair<T>*)(src + __mx::matrix_offset(a, row, col)))->v;
    return;
  }
#endif
  d.__e[0] = src[__mx::matrix_offset(a, row, col)];
  d.__e[1] = src[__mx::matrix_offset(a, row, col + 1)];
}
template <class T, class P, __mx::if_not_same_unqual<T, P> = 0>
MX_MATRIX_MEMORY_MISMATCH void simdgroup_load(thread simdgroup_matrix<T, 8, 8>& d, P* src, ulong elements_per_row = 8,
                                              ulong2 matrix_origin = ulong2(0), bool transpose_matrix = false);
template <class T, class P, __mx::if_same_unqual<T, P> = 0>
inline void simdgroup_store(simdgroup_matrix<T, 8, 8> m, P* dst, ulong elements_per_row = 8,
                            ulong2 matrix_origin = ulong2(0), bool transpose_matrix = false,
                            const char* __file = __builtin_FILE(), mx_u32 __line = __builtin_LINE()) {
  __mx::matrix_args a{(const void*)dst, elements_per_row, matrix_origin.x, matrix_origin.y, transpose_matrix};
  __mx::require_uniform(a, "simdgroup_store: the lanes of a simdgroup passed different arguments",
                        MX_SIMD_MATRIX_STORE);
  __mx::require_plain_origin(a, "simdgroup_store", __file, __line);
  mx_u32 row, col;
  __mx::frag_coord(row, col);
#if !MX_ADDRESS_SPACES
  if (!transpose_matrix) {  // the lane's two elements are adjacent: one access
    ((__mx::pair<T>*)(dst + __mx::matrix_offset(a, row, col)))->v = m.__e;
    return;
  }
#endif
  dst[__mx::matrix_offset(a, row, col)] = m.__e[0];
  dst[__mx::matrix_offset(a, row, col + 1)] = m.__e[1];
}
template <class T, class P, __mx::if_not_same_unqual<T, P> = 0>
MX_MATRIX_MEMORY_MISMATCH void simdgroup_store(simdgroup_matrix<T, 8, 8> m, P* dst, ulong elements_per_row = 8,
                                               ulong2 matrix_origin = ulong2(0), bool transpose_matrix = false);
#undef MX_MATRIX_MEMORY_MISMATCH
template <class TD, class TA, class TB, class TC>
inline void simdgroup_multiply_accumulate(thread simdgroup_matrix<TD, 8, 8>& d, simdgroup_matrix<TA, 8, 8> a,
                                          simdgroup_matrix<TB, 8, 8> b, simdgroup_matrix<TC, 8, 8> c) {
  __mx::mma_lane x{{(float)a.__e[0], (float)a.__e[1]}, {(float)b.__e[0], (float)b.__e[1]}, {(float)c.__e[0], (float)c.__e[1]}};
  float r[2];
  constexpr mx_u32 wide = sizeof(TA) >= 4 || sizeof(TB) >= 4 ? MX_SIMD_MATRIX_MMA_32 : 0u;
  __mx_simd(&__mx::mma_fn, &x, r, 0, MX_SIMD_UNIFORM | MX_SIMD_MATRIX | MX_SIMD_MATRIX_MMA | wide);
  d.__e[0] = TD(r[0]);
  d.__e[1] = TD(r[1]);
}
template <class TD, class TA, class TB>
inline void simdgroup_multiply(thread simdgroup_matrix<TD, 8, 8>& d, simdgroup_matrix<TA, 8, 8> a,
                               simdgroup_matrix<TB, 8, 8> b) {
  simdgroup_multiply_accumulate(d, a, b, make_filled_simdgroup_matrix<TD, 8, 8>(TD(0)));
}
}  // namespace metal

// A `threadgroup` variable declared in a function; the translator rewrites
// the declaration into a reference to this storage.
inline void* __mx_threadgroup_variable(const void* key, mx_u64 size, mx_u64 align) {
  return __mx_api->threadgroup_variable(key, size, align);
}

// Quad-group functions, matrices, more type traits (a file of its own).
#include "mx_metal_more.h"

#endif  // MX_METAL_H
