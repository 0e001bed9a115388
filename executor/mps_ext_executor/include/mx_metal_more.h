// More of the Metal standard library for the CPU Metal executor (included at
// the end of mx_metal.h): quad-group functions, precise:: and fast:: min,
// max and clamp, matrix types, and the type traits and small pieces that
// Apple-compiled kernels (MLX, PyTorch) use. Each follows the Metal Shading
// Language specification 3.1 (chapter 6); tests/cpu_metal/test_math.py
// compares each with an independent reference.
#ifndef MX_METAL_MORE_H
#define MX_METAL_MORE_H

// ------------------------------------------------------ quad-group functions --
// A quad is 4 consecutive lanes of a simdgroup (lanes 4q .. 4q+3, MSL 6.9.3):
// each function below is its simd_ counterpart within the caller's quad.
namespace __mx {
constexpr int quad_base(int lane) { return lane & ~3; }

template <class Op, class T>
void quad_reduce_fn(const mx_simd_lane* l, mx_u32 mask, mx_u32) {
  for (int q = 0; q < 32; q += 4) {
    T v[4];
    bool has[4];
    for (int i = 0; i < 4; ++i) {
      has[i] = active(mask, q + i);
      if (has[i]) v[i] = in<T>(l, q + i);
    }
    for (int d = 2; d >= 1; d >>= 1)  // pairs at distance 2, then 1, as the simd reduction's tree
      for (int i = 0; i < d; ++i) {
        if (has[i] && has[i + d]) v[i] = Op::apply(v[i], v[i + d]);
        else if (has[i + d]) { v[i] = v[i + d]; has[i] = true; }
      }
    for (int i = 0; i < 4; ++i)
      if (active(mask, q + i)) out<T>(l, q + i, v[0]);
  }
}

template <class Op, class T, bool Inclusive>
void quad_scan_fn(const mx_simd_lane* l, mx_u32 mask, mx_u32) {
  for (int q = 0; q < 32; q += 4) {
    T acc = T(Op::identity);
    for (int i = q; i < q + 4; ++i) {
      if (!active(mask, i)) continue;
      T x = in<T>(l, i);
      if (Inclusive) { acc = Op::apply(acc, x); out<T>(l, i, acc); }
      else { out<T>(l, i, acc); acc = Op::apply(acc, x); }
    }
  }
}

// Lane k of the caller's quad (undefined, here poison, outside 0..3).
template <class T>
inline T from_quad_lane(const mx_simd_lane* l, mx_u32 mask, int lane, long k) {
  if (k < 0 || k > 3) return poison<T>();
  return from_lane<T>(l, mask, quad_base(lane) + (int)k);
}

template <class T, int Kind>
void quad_shuffle_fn(const mx_simd_lane* l, mx_u32 mask, mx_u32) {
  for (int i = 0; i < 32; ++i) {
    if (!active(mask, i)) continue;
    long a = l[i].arg;
    int k = i & 3;
    T r;
    switch (Kind) {
      case SH_INDEX: r = from_quad_lane<T>(l, mask, i, a); break;
      case SH_UP: r = k >= a ? from_quad_lane<T>(l, mask, i, k - a) : in<T>(l, i); break;
      case SH_DOWN: r = k + a < 4 ? from_quad_lane<T>(l, mask, i, k + a) : in<T>(l, i); break;
      case SH_XOR: r = from_quad_lane<T>(l, mask, i, k ^ a); break;
      case SH_BROADCAST_FIRST: {
        mx_u32 quad = (mask >> quad_base(i)) & 0xfu;
        r = in<T>(l, quad_base(i) + __builtin_ctz(quad));
        break;
      }
      case SH_ROTATE_UP: r = from_quad_lane<T>(l, mask, i, ((k - a) % 4 + 4) % 4); break;
      case SH_ROTATE_DOWN: r = from_quad_lane<T>(l, mask, i, (k + a) % 4); break;
    }
    out<T>(l, i, r);
  }
}

// Votes of the caller's quad, in bits 0..3 (quad_vote::vote_t is ushort).
inline void quad_ballot_fn(const mx_simd_lane* l, mx_u32 mask, mx_u32) {
  for (int i = 0; i < 32; ++i) {
    if (!active(mask, i)) continue;
    mx_u64 v = 0;
    for (int k = 0; k < 4; ++k)
      if (active(mask, quad_base(i) + k) && in<bool>(l, quad_base(i) + k)) v |= 1ull << k;
    out<mx_u64>(l, i, v);
  }
}
inline void quad_mask_fn(const mx_simd_lane* l, mx_u32 mask, mx_u32) {
  for (int i = 0; i < 32; ++i)
    if (active(mask, i)) out<mx_u64>(l, i, (mx_u64)((mask >> quad_base(i)) & 0xfu));
}
}  // namespace __mx

namespace metal {
#define MX_QUAD_REDUCE(name, Op) \
  template <class T>             \
  inline T name(T x) { return __mx::simd_call<T>(&__mx::quad_reduce_fn<__mx::Op, T>, x); }
MX_QUAD_REDUCE(quad_sum, op_add)
MX_QUAD_REDUCE(quad_product, op_mul)
MX_QUAD_REDUCE(quad_min, op_min)
MX_QUAD_REDUCE(quad_max, op_max)
MX_QUAD_REDUCE(quad_and, op_and)
MX_QUAD_REDUCE(quad_or, op_or)
MX_QUAD_REDUCE(quad_xor, op_xor)
#undef MX_QUAD_REDUCE

#define MX_QUAD_SCAN(name, Op, incl) \
  template <class T>                 \
  inline T name(T x) { return __mx::simd_call<T>(&__mx::quad_scan_fn<__mx::Op, T, incl>, x); }
MX_QUAD_SCAN(quad_prefix_inclusive_sum, op_add, true)
MX_QUAD_SCAN(quad_prefix_exclusive_sum, op_add, false)
MX_QUAD_SCAN(quad_prefix_inclusive_product, op_mul, true)
MX_QUAD_SCAN(quad_prefix_exclusive_product, op_mul, false)
#undef MX_QUAD_SCAN

#define MX_QUAD_SHUFFLE(name, kind) \
  template <class T>                \
  inline T name(T x, ushort a) { return __mx::simd_call<T>(&__mx::quad_shuffle_fn<T, __mx::kind>, x, a); }
MX_QUAD_SHUFFLE(quad_shuffle, SH_INDEX)
MX_QUAD_SHUFFLE(quad_broadcast, SH_INDEX)
MX_QUAD_SHUFFLE(quad_shuffle_up, SH_UP)
MX_QUAD_SHUFFLE(quad_shuffle_down, SH_DOWN)
MX_QUAD_SHUFFLE(quad_shuffle_xor, SH_XOR)
MX_QUAD_SHUFFLE(quad_shuffle_rotate_up, SH_ROTATE_UP)
MX_QUAD_SHUFFLE(quad_shuffle_rotate_down, SH_ROTATE_DOWN)
#undef MX_QUAD_SHUFFLE

template <class T>
inline T quad_broadcast_first(T x) {
  return __mx::simd_call<T>(&__mx::quad_shuffle_fn<T, __mx::SH_BROADCAST_FIRST>, x);
}
// The simd versions with segments of `modulo` lanes; a quad is a segment of 4.
template <class T>
inline T quad_shuffle_and_fill_up(T data, T fill, ushort delta, ushort modulo = 4) {
  return simd_shuffle_and_fill_up(data, fill, delta, modulo);
}
template <class T>
inline T quad_shuffle_and_fill_down(T data, T fill, ushort delta, ushort modulo = 4) {
  return simd_shuffle_and_fill_down(data, fill, delta, modulo);
}

struct quad_vote {
  typedef ushort vote_t;
  vote_t v;
  explicit constexpr quad_vote(vote_t x = 0) : v(x) {}
  explicit constexpr operator vote_t() const { return v; }
  constexpr bool all() const { return v == 0xf; }
  constexpr bool any() const { return v != 0; }
};
inline quad_vote quad_ballot(bool pred) {
  return quad_vote((ushort)__mx::simd_call<bool, mx_u64>(&__mx::quad_ballot_fn, pred));
}
inline quad_vote quad_active_threads_mask() {
  return quad_vote((ushort)__mx::simd_call<bool, mx_u64>(&__mx::quad_mask_fn, true));
}
inline bool quad_all(bool pred) {
  mx_u64 active = __mx::simd_call<bool, mx_u64>(&__mx::quad_mask_fn, true);
  return __mx::simd_call<bool, mx_u64>(&__mx::quad_ballot_fn, pred) == active;
}
inline bool quad_any(bool pred) { return __mx::simd_call<bool, mx_u64>(&__mx::quad_ballot_fn, pred) != 0; }
// True in the active lane of lowest index (of the simdgroup, of the quad).
inline bool simd_is_first() { return (ushort)simd_broadcast_first((ushort)__mx::lane_id()) == __mx::lane_id(); }
inline bool quad_is_first() { return (ushort)quad_broadcast_first((ushort)__mx::lane_id()) == __mx::lane_id(); }
}  // namespace metal

// -------------------------------------------------------------- type traits --
// The rest of <metal_type_traits> (MSL 6.1), with the std:: meanings; Metal's
// own: is_scalar and is_vector (of its scalar and vector types), vec_elements,
// and remove_address_space (MLX's kernels use it and the internal
// _disjunction/_conjunction and remove_addrspace_t under
// `#pragma METAL internals : enable`).
namespace metal {
template <class T, T v>
struct integral_constant {
  static constexpr T value = v;
  typedef T value_type;
  typedef integral_constant type;
  constexpr operator value_type() const { return value; }
  constexpr value_type operator()() const { return value; }
};
template <bool B> using bool_constant = integral_constant<bool, B>;
typedef bool_constant<true> true_type;
typedef bool_constant<false> false_type;

template <class T> struct remove_const { typedef T type; };
template <class T> struct remove_const<const T> { typedef T type; };
template <class T> struct remove_volatile { typedef T type; };
template <class T> struct remove_volatile<volatile T> { typedef T type; };
template <class T> struct remove_reference { typedef typename __mx::remove_ref<T>::type type; };
template <class T> struct remove_pointer { typedef typename __mx::remove_ptr<T>::type type; };
template <class T> struct remove_address_space { typedef T type; };
#if MX_ADDRESS_SPACES
template <class T> struct remove_address_space<__attribute__((address_space(1))) T> { typedef T type; };
template <class T> struct remove_address_space<__attribute__((address_space(2))) T> { typedef T type; };
template <class T> struct remove_address_space<__attribute__((address_space(3))) T> { typedef T type; };
#endif
template <class T> struct add_const { typedef const T type; };
template <class T> struct add_volatile { typedef volatile T type; };
template <class T> struct add_cv { typedef const volatile T type; };
template <class T> using remove_const_t = typename remove_const<T>::type;
template <class T> using remove_volatile_t = typename remove_volatile<T>::type;
template <class T> using remove_reference_t = typename remove_reference<T>::type;
template <class T> using remove_pointer_t = typename remove_pointer<T>::type;
template <class T> using remove_address_space_t = typename remove_address_space<T>::type;
template <class T> using remove_addrspace_t = typename remove_address_space<T>::type;
template <class T> using add_const_t = typename add_const<T>::type;
template <class T> struct decay { typedef remove_cv_t<remove_reference_t<T>> type; };
template <class T> using decay_t = typename decay<T>::type;
template <class T> struct type_identity { typedef T type; };
template <class T> typename __mx::remove_ref<T>::type&& declval() noexcept;

template <class T> struct is_const : false_type {};
template <class T> struct is_const<const T> : true_type {};
template <class T> struct is_volatile : false_type {};
template <class T> struct is_volatile<volatile T> : true_type {};
template <class T> struct is_pointer : false_type {};
template <class T> struct is_pointer<T*> : true_type {};
template <class T> struct is_pointer<T* const> : true_type {};
template <class T> struct is_reference : false_type {};
template <class T> struct is_reference<T&> : true_type {};
template <class T> struct is_reference<T&&> : true_type {};
template <class T> struct is_void : bool_constant<__is_void(T)> {};
template <class T> struct is_array : bool_constant<__is_array(T)> {};
template <class T> struct is_enum : bool_constant<__is_enum(T)> {};
template <class T> struct is_class : bool_constant<__is_class(T)> {};
template <class T> struct is_union : bool_constant<__is_union(T)> {};
template <class T> struct is_trivially_copyable : bool_constant<__is_trivially_copyable(T)> {};
template <class B, class D> struct is_base_of : bool_constant<__is_base_of(B, D)> {};
template <class F, class T> struct is_convertible : bool_constant<__is_convertible_to(F, T)> {};
template <class T, class... A> struct is_constructible : bool_constant<__is_constructible(T, A...)> {};
template <class T> struct is_arithmetic
    : bool_constant<is_integral<T>::value || is_floating_point<T>::value> {};
template <class T> struct is_signed
    : bool_constant<is_arithmetic<T>::value && remove_cv_t<T>(-1) < remove_cv_t<T>(0)> {};
template <class T> struct is_unsigned
    : bool_constant<is_arithmetic<T>::value && !(remove_cv_t<T>(-1) < remove_cv_t<T>(0))> {};
template <class T> struct is_scalar : bool_constant<is_arithmetic<T>::value> {};
template <class T> struct is_vector : bool_constant<__mx::vt<remove_cv_t<T>>::is_vec> {};
template <class T> struct vec_elements : integral_constant<int, __mx::vt<remove_cv_t<T>>::n> {};

template <class T> struct make_signed;
template <class T> struct make_unsigned;
#define MX_SIGN_PAIR(S, U)                                                               \
  template <> struct make_signed<S> { typedef S type; };                                 \
  template <> struct make_signed<U> { typedef S type; };                                 \
  template <> struct make_unsigned<S> { typedef U type; };                               \
  template <> struct make_unsigned<U> { typedef U type; };
MX_SIGN_PAIR(signed char, uchar) MX_SIGN_PAIR(short, ushort) MX_SIGN_PAIR(int, uint) MX_SIGN_PAIR(long, ulong)
#undef MX_SIGN_PAIR
template <> struct make_signed<char> { typedef signed char type; };
template <> struct make_unsigned<char> { typedef uchar type; };
template <class T> using make_signed_t = typename make_signed<T>::type;
template <class T> using make_unsigned_t = typename make_unsigned<T>::type;

template <class... B> struct _conjunction : true_type {};
template <class B, class... R> struct _conjunction<B, R...> : bool_constant<B::value && _conjunction<R...>::value> {};
template <class... B> struct _disjunction : false_type {};
template <class B, class... R> struct _disjunction<B, R...> : bool_constant<B::value || _disjunction<R...>::value> {};
template <class... B> using conjunction = _conjunction<B...>;
template <class... B> using disjunction = _disjunction<B...>;
template <class B> struct negation : bool_constant<!B::value> {};

template <class T> constexpr bool is_const_v = is_const<T>::value;
template <class T> constexpr bool is_pointer_v = is_pointer<T>::value;
template <class T> constexpr bool is_reference_v = is_reference<T>::value;
template <class T> constexpr bool is_void_v = is_void<T>::value;
template <class T> constexpr bool is_array_v = is_array<T>::value;
template <class T> constexpr bool is_enum_v = is_enum<T>::value;
template <class T> constexpr bool is_class_v = is_class<T>::value;
template <class B, class D> constexpr bool is_base_of_v = is_base_of<B, D>::value;
template <class F, class T> constexpr bool is_convertible_v = is_convertible<F, T>::value;
template <class T> constexpr bool is_arithmetic_v = is_arithmetic<T>::value;
template <class T> constexpr bool is_signed_v = is_signed<T>::value;
template <class T> constexpr bool is_unsigned_v = is_unsigned<T>::value;
template <class T> constexpr bool is_scalar_v = is_scalar<T>::value;
template <class T> constexpr bool is_vector_v = is_vector<T>::value;
}  // namespace metal

// ---------------------------------------------------------- small pieces --
// uniform<T> (MSL 2.? 6.16): a value the same in every thread; the executor
// does not check uniformity, so it is T itself.
namespace metal {
template <class T> using uniform = T;
template <class T> inline T make_uniform(T x) { return x; }
}  // namespace metal

// as_type<T>(x) is an operator of the language (MSL 2.19), not a library
// function: shaders use it without `metal::` (PyTorch's c10/metal/float8.h).
using metal::as_type;
namespace metal {
// MSL 6.4 relational functions.
template <class T, typename __mx::enable_if<__mx::is_fp<T>::value, int>::type = 0>
inline bool isunordered(T x, T y) { return isnan(x) || isnan(y); }
template <class T, typename __mx::enable_if<__mx::is_fp<T>::value, int>::type = 0>
inline bool isordered(T x, T y) { return !isunordered(x, y); }
}  // namespace metal

// ------------------------------------------------------------------- arrays --
// <metal_array>'s array<T, N> (MSL 2.1): an aggregate of N elements, as
// std::array (PyTorch's c10/metal/common.h passes its parameters in them).
namespace metal {
template <class T, size_t N>
struct array {
  T __elems[N ? N : 1];
  T& operator[](size_t i) { return __elems[i]; }
  constexpr const T& operator[](size_t i) const { return __elems[i]; }
  constexpr size_t size() const { return N; }
  constexpr bool empty() const { return N == 0; }
  T* data() { return __elems; }
  constexpr const T* data() const { return __elems; }
  T* begin() { return __elems; }
  T* end() { return __elems + N; }
  constexpr const T* begin() const { return __elems; }
  constexpr const T* end() const { return __elems + N; }
  T& front() { return __elems[0]; }
  T& back() { return __elems[N - 1]; }
  __MX_DEFAULT_CONSTRUCTOR(array) __MX_COPIES(array)
};
}  // namespace metal

// ------------------------------------------- precise:: and fast:: min/max --
// MSL 6.5 lists min, max, clamp (and fmin, fmax, ...) among the math
// functions that have precise:: and fast:: forms; on Apple GPUs the forms
// agree for these (no rounding involved), so each is the one metal:: form.
// min, max and clamp are exact in every math mode: precise:: and fast:: name
// metal::'s own.
#define MX_USING_EXACT using metal::clamp; using metal::max; using metal::max3; \
  using metal::median3; using metal::min; using metal::min3;
namespace metal {
namespace precise {
template <class T> inline T fmax3(T a, T b, T c) { return fmax(fmax(a, b), c); }
template <class T> inline T fmin3(T a, T b, T c) { return fmin(fmin(a, b), c); }
template <class T> inline T fmedian3(T a, T b, T c) { return fmax(fmin(a, b), fmin(fmax(a, b), c)); }
MX_USING_EXACT
}  // namespace precise

// The math functions are declared in metal:: and metal::fast:: themselves,
// not only reached through `using namespace precise`: a shader that adds an
// overload to metal:: (MLX's bf16_math.h adds metal::exp(bfloat) and the
// rest to metal::, metal::fast:: and metal::precise::) would otherwise hide
// them from qualified calls such as metal::exp(float4).
#define MX_MATH_NAMES(X)                                                                                  \
  X(acos) X(acosh) X(asin) X(asinh) X(atan) X(atanh) X(ceil) X(cos) X(cosh) X(cospi) X(exp) X(exp2)       \
  X(exp10) X(fabs) X(floor) X(fract) X(log) X(log2) X(log10) X(rint) X(round) X(rsqrt) X(sin) X(sinh)      \
  X(sinpi) X(sqrt) X(tan) X(tanh) X(tanpi) X(trunc) X(saturate) X(atan2) X(copysign) X(fdim) X(fmax)      \
  X(fmin) X(fmod) X(pow) X(powr) X(nextafter) X(divide) X(fma) X(ldexp) X(frexp) X(modf) X(sincos)        \
  X(fmax3) X(fmin3) X(fmedian3)
#define MX_USING(name) using precise::name;
MX_MATH_NAMES(MX_USING)
namespace fast {
MX_MATH_NAMES(MX_USING)
MX_USING_EXACT
}  // namespace fast
#undef MX_USING
#undef MX_USING_EXACT
}  // namespace metal

// Apple's compiler builtins behind its stdlib, which MLX's bf16_math.h
// calls directly: __metal_NAME(x..., fast) computes NAME in float (the
// executor has one, precise, form of each), the simd ones as simd_NAME.
#define __METAL_MAYBE_FAST_MATH__ 0
#define __METAL_FAST_MATH__ 1
#define __METAL_PRECISE_MATH__ 0
#define MX_BUILTIN1(name) inline float __metal_##name(float x, int = 0) { return metal::precise::name(x); }
#define MX_BUILTIN2(name) inline float __metal_##name(float x, float y, int = 0) { return metal::precise::name(x, y); }
#define MX_BUILTIN3(name) \
  inline float __metal_##name(float x, float y, float z, int = 0) { return metal::precise::name(x, y, z); }
MX_BUILTIN1(acos) MX_BUILTIN1(acosh) MX_BUILTIN1(asin) MX_BUILTIN1(asinh) MX_BUILTIN1(atan) MX_BUILTIN1(atanh)
MX_BUILTIN1(ceil) MX_BUILTIN1(cos) MX_BUILTIN1(cosh) MX_BUILTIN1(cospi) MX_BUILTIN1(exp) MX_BUILTIN1(exp2)
MX_BUILTIN1(exp10) MX_BUILTIN1(fabs) MX_BUILTIN1(floor) MX_BUILTIN1(fract) MX_BUILTIN1(log) MX_BUILTIN1(log2)
MX_BUILTIN1(log10) MX_BUILTIN1(rint) MX_BUILTIN1(round) MX_BUILTIN1(rsqrt) MX_BUILTIN1(sin) MX_BUILTIN1(sinh)
MX_BUILTIN1(sinpi) MX_BUILTIN1(sqrt) MX_BUILTIN1(tan) MX_BUILTIN1(tanh) MX_BUILTIN1(tanpi) MX_BUILTIN1(trunc)
MX_BUILTIN2(atan2) MX_BUILTIN2(divide) MX_BUILTIN2(fdim) MX_BUILTIN2(fmax) MX_BUILTIN2(fmin) MX_BUILTIN2(fmod)
MX_BUILTIN2(nextafter) MX_BUILTIN2(pow) MX_BUILTIN2(powr)
MX_BUILTIN3(fma) MX_BUILTIN3(fmax3) MX_BUILTIN3(fmin3) MX_BUILTIN3(fmedian3)
#undef MX_BUILTIN1
#undef MX_BUILTIN2
#undef MX_BUILTIN3
inline float __metal_ldexp(float x, int k, int = 0) { return metal::precise::ldexp(x, k); }
inline float __metal_frexp(float x, thread int* e) { return metal::precise::frexp(x, *e); }
inline ushort __metal_get_simdgroup_size(ushort) { return 32; }
#define MX_SIMD_BUILTIN(name, params, args) \
  template <class T>                        \
  inline T __metal_##name params { return metal::name args; }
MX_SIMD_BUILTIN(simd_sum, (T x), (x)) MX_SIMD_BUILTIN(simd_product, (T x), (x))
MX_SIMD_BUILTIN(simd_min, (T x), (x)) MX_SIMD_BUILTIN(simd_max, (T x), (x))
// The bitwise reductions work on the bits of any type (MLX passes floats).
#define MX_SIMD_BITS_BUILTIN(name)                                                              \
  template <class T>                                                                            \
  inline T __metal_##name(T x) {                                                                \
    typedef metal::conditional_t<sizeof(T) == 2, ushort, metal::conditional_t<sizeof(T) == 4, uint, ulong>> U; \
    return metal::as_type<T>(metal::name(metal::as_type<U>(x)));                                \
  }
MX_SIMD_BITS_BUILTIN(simd_and) MX_SIMD_BITS_BUILTIN(simd_or) MX_SIMD_BITS_BUILTIN(simd_xor)
#undef MX_SIMD_BITS_BUILTIN
MX_SIMD_BUILTIN(simd_prefix_inclusive_sum, (T x), (x)) MX_SIMD_BUILTIN(simd_prefix_exclusive_sum, (T x), (x))
MX_SIMD_BUILTIN(simd_prefix_inclusive_product, (T x), (x))
MX_SIMD_BUILTIN(simd_prefix_exclusive_product, (T x), (x))
MX_SIMD_BUILTIN(simd_broadcast, (T x, ushort l), (x, l)) MX_SIMD_BUILTIN(simd_shuffle, (T x, ushort l), (x, l))
MX_SIMD_BUILTIN(simd_shuffle_up, (T x, ushort d), (x, d)) MX_SIMD_BUILTIN(simd_shuffle_down, (T x, ushort d), (x, d))
MX_SIMD_BUILTIN(simd_shuffle_xor, (T x, ushort m), (x, m))
MX_SIMD_BUILTIN(simd_shuffle_rotate_up, (T x, ushort d), (x, d))
MX_SIMD_BUILTIN(simd_shuffle_rotate_down, (T x, ushort d), (x, d))
MX_SIMD_BUILTIN(simd_shuffle_and_fill_up, (T x, T f, ushort d, ushort m), (x, f, d, m))
MX_SIMD_BUILTIN(simd_shuffle_and_fill_down, (T x, T f, ushort d, ushort m), (x, f, d, m))
#undef MX_SIMD_BUILTIN

// ----------------------------------------------------------------- matrices --
// matrix<T, C, R> (MSL 2.3): C columns of vec<T, R>, stored column after
// column; m[i] is column i, m[i][j] its row j. half and float, 2 to 4 columns
// and rows (float2x3: 2 columns, 3 rows).
namespace metal {
template <class T, int C, int R>
struct matrix {
  static_assert(C >= 2 && C <= 4 && R >= 2 && R <= 4, "matrix: 2 to 4 columns and rows");
  vec<T, R> columns[C];

  matrix() = default;
  __MX_COPIES(matrix)
  // T d: d on the diagonal, 0 elsewhere.
  explicit matrix(T d) {
    for (int c = 0; c < C; ++c) {
      columns[c] = vec<T, R>(T(0));
      if (c < R) columns[c][c] = d;
    }
  }
  // C columns, or C * R scalars in column order.
  template <class... A, typename __mx::enable_if<sizeof...(A) == C, int>::type = 0>
  matrix(A... cols) : columns{__builtin_convertvector(cols, vec<T, R>)...} {}
  template <class... A, typename __mx::enable_if<sizeof...(A) == C * R, int>::type = 0>
  matrix(A... xs) {
    T v[C * R] = {T(xs)...};
    for (int c = 0; c < C; ++c)
      for (int r = 0; r < R; ++r) columns[c][r] = v[c * R + r];
  }
  template <class U>
  explicit matrix(const matrix<U, C, R>& m) {
    for (int c = 0; c < C; ++c)
      for (int r = 0; r < R; ++r) columns[c][r] = T(m.columns[c][r]);
  }
  thread vec<T, R>& operator[](int c) { return columns[c]; }
  const thread vec<T, R>& operator[](int c) const { return columns[c]; }

  matrix operator-() const { matrix m; for (int c = 0; c < C; ++c) m.columns[c] = -columns[c]; return m; }
  matrix& operator+=(const matrix& b) { for (int c = 0; c < C; ++c) columns[c] += b.columns[c]; return *this; }
  matrix& operator-=(const matrix& b) { for (int c = 0; c < C; ++c) columns[c] -= b.columns[c]; return *this; }
  matrix& operator*=(T s) { for (int c = 0; c < C; ++c) columns[c] *= s; return *this; }
};

template <class T, int C, int R>
inline matrix<T, C, R> operator+(matrix<T, C, R> a, const matrix<T, C, R>& b) { return a += b; }
template <class T, int C, int R>
inline matrix<T, C, R> operator-(matrix<T, C, R> a, const matrix<T, C, R>& b) { return a -= b; }
template <class T, int C, int R>
inline matrix<T, C, R> operator*(matrix<T, C, R> a, T s) { return a *= s; }
template <class T, int C, int R>
inline matrix<T, C, R> operator*(T s, matrix<T, C, R> a) { return a *= s; }
// Matrix times column vector: the sum of the columns weighted by v.
template <class T, int C, int R>
inline vec<T, R> operator*(const matrix<T, C, R>& m, vec<T, C> v) {
  vec<T, R> r = m.columns[0] * v[0];
  for (int c = 1; c < C; ++c) r += m.columns[c] * v[c];
  return r;
}
// Row vector times matrix: the dot product of v with each column.
template <class T, int C, int R>
inline vec<T, C> operator*(vec<T, R> v, const matrix<T, C, R>& m) {
  vec<T, C> r;
  for (int c = 0; c < C; ++c) {
    T s = v[0] * m.columns[c][0];
    for (int k = 1; k < R; ++k) s += v[k] * m.columns[c][k];
    r[c] = s;
  }
  return r;
}
template <class T, int K, int C, int R>
inline matrix<T, K, R> operator*(const matrix<T, C, R>& a, const matrix<T, K, C>& b) {
  matrix<T, K, R> m;
  for (int k = 0; k < K; ++k) m.columns[k] = a * b.columns[k];
  return m;
}
template <class T, int C, int R>
inline matrix<T, C, R>& operator*=(thread matrix<T, C, R>& a, const matrix<T, C, C>& b) { return a = a * b; }
template <class T, int C, int R>
inline bool operator==(const matrix<T, C, R>& a, const matrix<T, C, R>& b) {
  for (int c = 0; c < C; ++c) if (!all(a.columns[c] == b.columns[c])) return false;
  return true;
}
template <class T, int C, int R>
inline bool operator!=(const matrix<T, C, R>& a, const matrix<T, C, R>& b) { return !(a == b); }

template <class T, int C, int R>
inline matrix<T, R, C> transpose(const matrix<T, C, R>& m) {
  matrix<T, R, C> t;
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) t.columns[r][c] = m.columns[c][r];
  return t;
}
template <class T>
inline T determinant(const matrix<T, 2, 2>& m) { return m[0][0] * m[1][1] - m[1][0] * m[0][1]; }
template <class T>
inline T determinant(const matrix<T, 3, 3>& m) {
  return m[0][0] * (m[1][1] * m[2][2] - m[2][1] * m[1][2]) - m[1][0] * (m[0][1] * m[2][2] - m[2][1] * m[0][2]) +
         m[2][0] * (m[0][1] * m[1][2] - m[1][1] * m[0][2]);
}
// Expansion along row 0, each 3x3 minor by determinant() above.
template <class T>
inline T determinant(const matrix<T, 4, 4>& m) {
  T d = T(0);
  for (int c = 0; c < 4; ++c) {
    matrix<T, 3, 3> minor;
    for (int cc = 0, k = 0; cc < 4; ++cc) {
      if (cc == c) continue;
      minor.columns[k++] = vec<T, 3>{m[cc][1], m[cc][2], m[cc][3]};
    }
    T term = m[c][0] * determinant(minor);
    d = (c % 2) ? d - term : d + term;
  }
  return d;
}

#define MX_MATRIX_TYPES(T)                                                                        \
  typedef matrix<T, 2, 2> T##2x2; typedef matrix<T, 2, 3> T##2x3; typedef matrix<T, 2, 4> T##2x4; \
  typedef matrix<T, 3, 2> T##3x2; typedef matrix<T, 3, 3> T##3x3; typedef matrix<T, 3, 4> T##3x4; \
  typedef matrix<T, 4, 2> T##4x2; typedef matrix<T, 4, 3> T##4x3; typedef matrix<T, 4, 4> T##4x4;
MX_MATRIX_TYPES(float)
MX_MATRIX_TYPES(half)
#undef MX_MATRIX_TYPES
}  // namespace metal
using metal::matrix;
// As the vector types, the matrix types are also global names.
#define MX_MATRIX_NAMES(T)                                                                        \
  using metal::T##2x2; using metal::T##2x3; using metal::T##2x4; using metal::T##3x2;             \
  using metal::T##3x3; using metal::T##3x4; using metal::T##4x2; using metal::T##4x3; using metal::T##4x4;
MX_MATRIX_NAMES(float)
MX_MATRIX_NAMES(half)
#undef MX_MATRIX_NAMES

#endif  // MX_METAL_MORE_H
