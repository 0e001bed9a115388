// Why a call goes to torch's kernel instead of mps_ext's: the one table of
// fallback reasons, counted per family by route (dispatch/registry.h) and
// reported as text by mps_ext.stats().
//
// A reason is an id of this table and up to two small arguments, packed in
// 64 bits: passing, returning and counting one moves an integer, and its text
// is made only when stats() (or an error) reports it. Ops name a reason as
// because::<name> (a plain one) or because::<name>(args...) (one whose text
// has placeholders); a name not in the table, a string literal, or arguments
// that do not fit the text's placeholders do not compile.
//
// X(name, text): a reason whose text is fixed. A(name, text): one whose text
// has placeholders, filled in order from its arguments when reported:
//   {dtype}  a c10::ScalarType        {device}  a c10::DeviceType
//   {n}      a count below 2^24       {text}    text made where the reason
//                                               is given (interned once: a
//                                               policy rule's reason, a
//                                               shape listing)
// A reason that is a policy decision starts with "policy: " (registry.h).
#pragma once

#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#define MPS_EXT_REASONS(X, A)                                                                                       \
  /* route's own (dispatch/registry.h) */                                                                           \
  X(turned_off, "turned off")                                                                                       \
  X(kernels_unavailable, "kernels unavailable on this device")                                                      \
  X(no_cpu_backend, "no backend runs kernels on CPU tensors here")                                                  \
  X(cpu_backend_not_asked, "the CPU backend was not asked for")                                                     \
  A(foreign_device, "a {device} tensor beside {device} tensors")                                                    \
  A(policy, "{text}") /* a rule's reason, "policy: ..." (mps_ext/_policy.py) */                                     \
  /* a shape the kernel's pipeline cannot take on this GPU, though others it can (CallNotTaken) */                  \
  A(past_pipeline, "{text} past {n}, the most the kernel's pipeline takes on this GPU")                             \
  /* every family */                                                                                                \
  X(not_strided, "layout is not strided")                                                                           \
  X(shapes_torch_rejects, "shapes torch rejects")                                                                   \
  X(mixed_dtypes, "operands of different dtypes")                                                                   \
  A(dtype_not_float, "dtype {dtype} (float32, float16 and bfloat16 are handled)")                                   \
  /* fp8, scaled_mm */                                                                                              \
  X(neg_or_conj, "a tensor with the neg or conj bit")                                                               \
  X(operands_not_fp8, "operands that are not float8")                                                               \
  A(output_dtype, "output dtype {dtype}")                                                                           \
  A(bias_dtype, "bias dtype {dtype}")                                                                               \
  X(bias_torch_rejects, "a bias torch rejects")                                                                     \
  X(scales_torch_rejects, "scales torch rejects")                                                                   \
  A(block_scales, "{text}") /* the shapes of block-wise scales mps_ext does not read (scaled_mm.cpp) */             \
  X(scale_result_torch_rejects, "a scale_result torch rejects")                                                     \
  X(several_scales, "more than one scale per operand")                                                              \
  X(swizzled_scales, "swizzled scales")                                                                             \
  X(contraction_dim, "contraction_dim")                                                                             \
  X(block_scales_e5m2, "block-wise scales with float8_e5m2 operands")                                               \
  /* grouped_mm */                                                                                                  \
  X(group_past_2_32, "a matrix with more than 2^32 elements per group")                                             \
  X(dimension_past_2_31, "a dimension past 2^31")                                                                   \
  A(grouped_scale_recipes, "{text}; mps_ext takes RowWise (1) for both, one float32 scale tensor each, unswizzled") \
  A(grouped_contraction_dim, "contraction_dim {text}; mps_ext takes [] or [-1, -2]")                                \
  /* linalg */                                                                                                      \
  A(dtype_not_linalg, "dtype {dtype} (float32 and complex64 are handled)")                                          \
  X(input_torch_rejects, "an input torch rejects (torch's kernel reports it)")                                      \
  X(columns_past_512, "matrices of more than 512 columns")                                                          \
  X(pivots_shape, "pivots not of the shape LU.shape[:-2] + (k,)")                                                   \
  X(batch_dims_past_8, "more than 8 batch dimensions")                                                              \
  X(matrix_spans_2_31, "a matrix spans 2^31 elements or more")                                                      \
  A(rows_past, "matrices of more than {n} rows")                                                                    \
  /* linear */                                                                                                      \
  X(activation_offsets_past_2_31, "activation offsets past 2^31 elements")                                          \
  X(float32_rows_past_8, "float32 with more than 8 rows (a general matmul)")                                        \
  X(tile_beta_alpha, "beta or alpha other than 1 with more than 8 rows")                                            \
  X(bias_not_1d_n, "a bias that is not 1-D of size N")                                                              \
  X(rows_do_not_flatten, "activation rows that do not flatten without a copy")                                      \
  X(out_of_another_dtype, "an out tensor of another dtype")                                                         \
  X(out_needs_resizing, "an out tensor that needs resizing")                                                        \
  X(out_not_contiguous, "a non-contiguous out tensor")                                                              \
  X(out_overlaps_input, "an out tensor that overlaps an input")                                                     \
  /* pad */                                                                                                         \
  X(quantized, "quantized tensor")                                                                                  \
  A(dtype_not_1248_bytes, "dtype {dtype} (elements of 1, 2, 4 or 8 bytes are handled)")                             \
  X(dims_past_8, "more than 8 dimensions")                                                                          \
  /* softmax */                                                                                                     \
  X(dims_past_9, "more than 9 dimensions")                                                                          \
  A(gradient_dtype, "gradient {dtype} to input dtype {dtype}")

namespace mps_ext {

enum class ReasonId : uint16_t {
  none,  // mps_ext's kernel takes the call
#define MPS_EXT_REASON_ID(name, text) name,
  MPS_EXT_REASONS(MPS_EXT_REASON_ID, MPS_EXT_REASON_ID)
#undef MPS_EXT_REASON_ID
};

namespace reason_detail {

constexpr const char* kTexts[] = {"",
#define MPS_EXT_REASON_TEXT(name, text) text,
                                  MPS_EXT_REASONS(MPS_EXT_REASON_TEXT, MPS_EXT_REASON_TEXT)
#undef MPS_EXT_REASON_TEXT
};

enum class Slot : uint8_t { none, dtype, device, n, text };

constexpr bool starts(const char* s, const char* prefix) {
  for (; *prefix; ++s, ++prefix)
    if (*s != *prefix) return false;
  return true;
}
// The placeholder `s` starts with ("{dtype}" -> dtype), and its length.
constexpr Slot slot_at(const char* s, size_t* length = nullptr) {
  constexpr struct {
    const char* spelling;
    Slot slot;
  } kSlots[] = {{"{dtype}", Slot::dtype}, {"{device}", Slot::device}, {"{n}", Slot::n}, {"{text}", Slot::text}};
  for (const auto& k : kSlots)
    if (starts(s, k.spelling)) {
      if (length) *length = std::char_traits<char>::length(k.spelling);
      return k.slot;
    }
  return Slot::none;
}
// The i-th placeholder of `text` (Slot::none past the last).
constexpr Slot slot(const char* text, size_t i) {
  for (const char* s = text; *s; ++s)
    if (slot_at(s) != Slot::none && i-- == 0) return slot_at(s);
  return Slot::none;
}
constexpr size_t slots(const char* text) {
  size_t n = 0;
  while (slot(text, n) != Slot::none) ++n;
  return n;
}

// The placeholder an argument of type T fills.
template <class T>
constexpr Slot slot_of() {
  using U = std::decay_t<T>;
  if constexpr (std::is_same_v<U, c10::ScalarType>) return Slot::dtype;
  else if constexpr (std::is_same_v<U, c10::DeviceType>) return Slot::device;
  else if constexpr (std::is_integral_v<U> && !std::is_same_v<U, bool>) return Slot::n;
  else if constexpr (std::is_same_v<U, std::string>) return Slot::text;
  else return Slot::none;
}

template <class... Args, size_t... I>
constexpr bool fits(const char* text, std::index_sequence<I...>) {
  return slots(text) == sizeof...(Args) && ((slot(text, I) == slot_of<Args>()) && ...);
}

constexpr uint32_t kArgLimit = uint32_t(1) << 24;
uint32_t intern(const std::string& text);  // an index below kArgLimit, the same for the same text
std::string interned(uint32_t index);

}  // namespace reason_detail

class Reason {
 public:
  constexpr Reason() = default;
  constexpr explicit Reason(ReasonId id) : code_(static_cast<uint64_t>(id)) {}
  explicit operator bool() const { return code_ != 0; }
  ReasonId id() const { return static_cast<ReasonId>(code_ & 0xffff); }
  uint64_t code() const { return code_; }  // 0 for none; equal codes have equal texts
  static Reason from_code(uint64_t code) { return Reason(code, 0); }
  std::string text() const;  // "" for none

  // A reason of the table with its arguments (because::<name>(...) calls this).
  template <ReasonId Id, class... Args>
  static Reason with(const Args&... args) {
    static_assert(reason_detail::fits<Args...>(reason_detail::kTexts[static_cast<size_t>(Id)],
                                               std::index_sequence_for<Args...>{}),
                  "the arguments do not fit this reason's placeholders (dispatch/reasons.h)");
    uint64_t code = static_cast<uint64_t>(Id), shift = 16;
    ((code |= uint64_t(arg(args)) << shift, shift += 24), ...);
    return Reason(code, 0);
  }

 private:
  constexpr Reason(uint64_t code, int) : code_(code) {}
  static uint32_t arg(c10::ScalarType t) { return static_cast<uint32_t>(t); }
  static uint32_t arg(c10::DeviceType t) { return static_cast<uint32_t>(t); }
  static uint32_t arg(const std::string& text) { return reason_detail::intern(text); }
  template <class T, class = std::enable_if_t<std::is_integral_v<T>>>
  static uint32_t arg(T n) {
    return n < 0 ? 0 : uint64_t(n) >= reason_detail::kArgLimit ? reason_detail::kArgLimit - 1 : uint32_t(n);
  }
  uint64_t code_ = 0;
};

// The first of two reasons that is one.
inline Reason operator||(Reason a, Reason b) { return a ? a : b; }

// because::<name>: the reasons of the table, by name.
namespace because {
#define MPS_EXT_REASON_PLAIN(name, text)                                                              \
  static_assert(reason_detail::slots(text) == 0, "X(" #name "): a text with placeholders is A(...)"); \
  inline constexpr Reason name{ReasonId::name};
#define MPS_EXT_REASON_WITH_ARGS(name, text)                                                            \
  static_assert(reason_detail::slots(text) > 0, "A(" #name "): a text without placeholders is X(...)"); \
  template <class... Args>                                                                              \
  Reason name(const Args&... args) {                                                                    \
    return Reason::with<ReasonId::name>(args...);                                                       \
  }
MPS_EXT_REASONS(MPS_EXT_REASON_PLAIN, MPS_EXT_REASON_WITH_ARGS)
#undef MPS_EXT_REASON_PLAIN
#undef MPS_EXT_REASON_WITH_ARGS
}  // namespace because

}  // namespace mps_ext
