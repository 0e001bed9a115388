// What every op shares: its family (its switch, counters, policy rules and
// definition), and the stock kernel it falls back to for inputs it does not
// handle.
//
// A family ("softmax", "pad", ...: the table in dispatch/families.h) is what a
// user turns off. Each op runs through `route`, which sends the call to the
// kernel registered for the same aten op and dispatch key before mps_ext's
// override (on MPS: PyTorch's own kernel, captured when the override was
// installed; on CPU, for the torch.ops.mps_ext ops: aten's CPU kernel) when
//   - the family is turned off;
//   - a kernel the call needs cannot run on this device (its Metal library
//     or pipeline failed to build here, or its pipeline allows fewer threads
//     than the launch needs at least: BackendUnavailable, remembered per
//     kernel, or per library when the library failed, by launch.cpp); the
//     family's other kernels keep running;
//   - the kernel cannot take this call's shape on this GPU, though it takes
//     others (CallNotTaken: a row longer than its pipeline's threads hold);
//   - the call is on CPU tensors and no CPU backend is registered (the
//     product as shipped: backend/launch.h, CpuBackend), or the registered
//     one does not take this call (CpuBackend::accepts: a test's backend,
//     thousands of times slower than torch's CPU kernels, takes calls on a
//     Mac only when it is asked for);
//   - the policy leaves this op to the installed torch (mps_ext/_policy.py),
//     possibly not for dtypes or argument values torch's kernel refuses (a
//     LeftToTorch rule; a rule whose calls a named Condition picks is
//     applied by the op's own code: RoutedOp::picked);
//   - a tensor argument lives on another device than the kernel's (a 0-dim
//     CPU tensor beside MPS tensors: torch's kernel does what torch does);
//   - the op says it does not handle these inputs (`unsupported`);
// and counts the reason (dispatch/reasons.h). A reason that is a policy
// decision (torch has as good a kernel) starts with "policy: ": the
// self-check and the tests accept those fallbacks on MPS, and "turned off",
// but no other. Everything here is generic over op families: a new family
// gets all of it by calling route.
//
// Routing costs a few loads when the kernel runs: an op's family and policy
// slot are resolved once (RoutedOp, a static per op), counters are relaxed
// atomics, and a reason is an id of the reasons table (dispatch/reasons.h),
// turned into text only when stats() reports it. A call that falls back
// calls torch's kernel unboxed, with the op's own C++ signature (route<Sig>).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/boxing/impl/boxing.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

#include <array>
#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "backend/launch.h"
#include "backend/torch_compat.h"
#include "dispatch/families.h"
#include "dispatch/reasons.h"

namespace mps_ext {

enum class FamilyId : uint8_t {
#define MPS_EXT_FAMILY_ID(name) name,
  MPS_EXT_FAMILIES(MPS_EXT_FAMILY_ID)
#undef MPS_EXT_FAMILY_ID
};
#define MPS_EXT_FAMILY_ONE(name) +1
constexpr size_t kFamilyCount = 0 MPS_EXT_FAMILIES(MPS_EXT_FAMILY_ONE);
#undef MPS_EXT_FAMILY_ONE

// The named conditions of policy rules (mps_ext/_policy.py's Condition: the
// same names, checked by tests/test_policy.py): the calls of an op a rule
// leaves to torch, where the arguments' dtypes and bools do not say which.
// Each is decided by the op's own code (RoutedOp::picked), by what torch's
// kernel takes.
//   one_row: mm and addmm with one row of the activation (or one column):
//     torch 2.14's own GEMV (linear.cpp).
//   torch_scaled_mm: tensor-wise and row-wise float8_e4m3fn _scaled_mm_v2
//     with outputs, bias and alignment torch 2.15's kernel takes (scaled_mm.cpp).
//   torch_grouped_mm: every _grouped_mm call but the bfloat16 jagged-row
//     prefills (more than 64 rows, the experts' K contiguous), which torch
//     2.15 runs on its simdgroup tile and mps_ext on gmm_tiled (grouped_mm.cpp).
#define MPS_EXT_CONDITIONS(X) \
  X(one_row)                  \
  X(torch_scaled_mm)          \
  X(torch_grouped_mm)

enum class Condition : uint8_t {
  all,  // no condition: route applies the rule (with its kept dtypes and arguments)
#define MPS_EXT_CONDITION_ID(name) name,
  MPS_EXT_CONDITIONS(MPS_EXT_CONDITION_ID)
#undef MPS_EXT_CONDITION_ID
};
// "one_row" -> Condition::one_row ("" -> all); an error naming the
// conditions for any other name.
Condition condition_named(const std::string& name);
std::vector<std::string> condition_names();

// A policy decision (mps_ext/_policy.py): which calls of an op go to the
// stock kernel because torch's own is as good.
struct LeftToTorch {
  std::string why;  // the fallback's reason: "policy: ..."
  // Not calls with a tensor argument (or one in a list) of one of these
  // dtypes, nor those whose argument at this index (of the op's schema) is
  // this bool: inputs torch's kernel refuses, which mps_ext keeps.
  std::vector<c10::ScalarType> kept_dtypes;
  std::vector<std::pair<size_t, bool>> kept_args;
  // Not `all`: the op's own code picks the calls by this condition, and
  // gives `why` as its `unsupported` reason; route does not apply the rule.
  Condition calls = Condition::all;

  Reason reason;  // because::policy(why), made once with the rule

  bool applies(const torch::jit::Stack& args) const;
};

// Where route reads an op's rule for each key: one load per call.
struct RuleSlot {
  std::atomic<const LeftToTorch*> cpu{nullptr}, mps{nullptr};
  std::atomic<const LeftToTorch*>& of(c10::DispatchKey key) { return key == c10::DispatchKey::MPS ? mps : cpu; }
};

class FamilyOps;  // dispatch/registration.h
// A family's Register function for one key (dispatch/registration.h).
using RegisterKernels = void (*)(FamilyOps&);

// Counts per reason without a lock: a reason is one 64-bit code, so a slot
// is claimed once (compare-and-swap) and then only incremented.
class ReasonCounts {
 public:
  void add(Reason r);
  std::map<std::string, uint64_t> read() const;  // text -> count, the nonzero ones
  void reset();

 private:
  static constexpr size_t kSlots = 64;
  std::array<std::atomic<uint64_t>, kSlots> keys_{};  // Reason::code(); 0: free
  std::array<std::atomic<uint64_t>, kSlots> counts_{};
  std::atomic<uint64_t> other_{0};  // when more than kSlots distinct reasons came
};

class Family {
 public:
  Family(FamilyId id, const char* name) : id(id), name(name) {}
  const FamilyId id;
  const char* const name;
  std::atomic<bool> enabled{true};

  // Its definition, given once by MPS_EXT_FAMILY in the family's own file.
  struct Def {
    std::vector<std::string> aten_ops;  // "aten::_softmax", ...
    std::vector<std::string> own_ops;   // "mps_ext::kv_append", ...
    RegisterKernels register_mps = nullptr, register_cpu = nullptr;
  };
  void define(Def def);
  const Def& def() const;  // an error if no file defined it
  bool defined() const { return definitions_.load(std::memory_order_relaxed) > 0; }
  int definitions() const { return definitions_.load(std::memory_order_relaxed); }

  void count_ran() { ran_.fetch_add(1, std::memory_order_relaxed); }
  void count_fallback(Reason reason) { fallbacks_.add(reason); }
  uint64_t ran() const { return ran_.load(std::memory_order_relaxed); }
  std::map<std::string, uint64_t> fallbacks() const { return fallbacks_.read(); }
  void reset();

  // Why some of the family's kernels cannot run for `key` in this process,
  // for stats(): a record, not a switch (launch.cpp remembers which kernels
  // failed; only the calls that need one of them go to the stock kernel).
  // The first note of a failure warns once, naming it; a repeated one is a
  // no-op.
  void note_unavailable(c10::DispatchKey key, const BackendUnavailable& e);
  std::map<c10::DispatchKey, std::string> unavailable_all() const;  // each key's causes, joined by "; "
  void clear_unavailable();                                         // for tests only: a real failure does not heal

  // The policy's per-op decision: calls of `op` (one of the family's aten
  // ops, else an error) for `key` go to the stock kernel, counted under
  // `why` (empty `why`: clears it); not those with a tensor of one of
  // `kept_dtypes`, nor those whose bool argument named in `kept_args` has
  // the value given there; with a condition, those the op's code picks.
  void leave_to_torch(const std::string& op, c10::DispatchKey key, const std::string& why,
                      const std::vector<c10::ScalarType>& kept_dtypes = {},
                      const std::vector<std::pair<std::string, bool>>& kept_args = {},
                      Condition calls = Condition::all);
  RuleSlot& rule_slot(const std::string& op);  // made on first use, never freed

 private:
  Def def_;
  std::atomic<int> definitions_{0};  // MPS_EXT_FAMILY definitions seen; 1 is right
  std::atomic<uint64_t> ran_{0};
  ReasonCounts fallbacks_;
  mutable std::mutex mutex_;  // what follows, all cold: set up, failure, policy installation
  std::map<c10::DispatchKey, std::vector<std::string>> unavailable_;  // causes, in the order met
  std::map<std::string, std::unique_ptr<RuleSlot>> slots_;
  std::vector<std::unique_ptr<LeftToTorch>> rules_;  // every rule ever set: a slot may still point at one
};

// The family of an id: an element of a fixed table, no lock.
Family& family(FamilyId id);
// By name, for Python: an error naming the families for an unknown name.
Family& family(const std::string& name);
std::vector<std::string> family_names();
// Why the family table is wrong ("" if it is not): a family that no file
// defines, or that two do. Raised when mps_ext._C loads.
std::string family_table_problem();
// The same for given families and how many files define each.
std::string family_table_problem(const std::vector<std::pair<std::string, int>>& definitions);

// The kernel `op` ("aten::_softmax") had for `key` before mps_ext overrode
// it. Captured now if it was not captured before; an error if there was none
// (check has_stock_kernel first where torch may lack one, e.g. an op torch
// has no MPS kernel for, which mps_ext registers rather than overrides).
const c10::SafeKernelFunction& stock_kernel(const std::string& op, c10::DispatchKey key);
bool has_stock_kernel(const std::string& op, c10::DispatchKey key);
// Captures the current kernel of `op` for `key`, if there is one.
void capture_stock_kernel(const std::string& op, c10::DispatchKey key);

// The dispatcher's handle of `op` ("aten::_softmax", "aten::add.Tensor"):
// an error if the installed torch lacks it; find_op: none.
c10::OperatorHandle op_handle(const std::string& op);
c10::optional<c10::OperatorHandle> find_op(const std::string& op);

namespace detail {
// A captured kernel called as the dispatcher calls it: unboxed, with the
// op's C++ signature `Sig` (the aten op's own, at::_ops::<op>::schema: the
// dispatcher makes every kernel of an op take it, so an override's own
// function type is it too). No IValue stack is built.
template <class Sig>
struct Unboxed;
template <class Ret, class... Params>
struct Unboxed<Ret(Params...)> {
  template <class... Args>
  static Ret call(const c10::KernelFunction& k, const c10::OperatorHandle& op, c10::DispatchKeySet ks, Args&&... args) {
    return k.call<Ret, Params...>(op, ks, std::forward<Args>(args)...);
  }
  // Whether KernelFunction::call boxes after all: a kernel with no unboxed
  // function for Sig (a SymInt kernel called with int64_t arguments, or a
  // boxed-only kernel).
  static bool boxes(const c10::KernelFunction& k) {
    if constexpr (std::disjunction_v<c10::has_symint<Params>...>) return !k.isValidSymUnboxed() && !k.isValidUnboxed();
    else return !k.isValidUnboxed();
  }
};
// Fallbacks of route that went through a boxed call (Unboxed::boxes): for
// the test that none does.
void count_boxed_fallback();
uint64_t boxed_fallbacks();

template <class Ret, class... Args>
Ret call_boxed(const c10::SafeKernelFunction& kernel, const c10::OperatorHandle& op, c10::DispatchKey key,
               const Args&... args) {
  torch::jit::Stack stack;
  (torch::jit::push(stack, args), ...);
  kernel.callBoxed(op, c10::DispatchKeySet(key), &stack);
  return c10::impl::PopResult<Ret>::call(stack);
}
}  // namespace detail

// Calls the stock kernel with boxed arguments and returns its result: a
// tensor, or a tuple of them for ops with several outputs.
template <class Ret = at::Tensor, class... Args>
Ret call_stock(const std::string& op, c10::DispatchKey key, const Args&... args) {
  return detail::call_boxed<Ret>(stock_kernel(op, key), op_handle(op), key, args...);
}

// One op as route sees it, resolved once (keep it in a static): its
// family, its policy slot, and its stock kernel per key once looked up.
class RoutedOp {
 public:
  RoutedOp(FamilyId fam, const char* name) : family(mps_ext::family(fam)), name(name), slot_(family.rule_slot(name)) {}
  Family& family;
  const char* const name;  // "aten::mm"

  const LeftToTorch* rule(c10::DispatchKey key) const { return slot_.of(key).load(std::memory_order_acquire); }
  // The reason of a rule whose calls `c` names, if one is set for `key`
  // (the op's code calls this only for the calls `c` picks).
  Reason picked(c10::DispatchKey key, Condition c) const {
    const LeftToTorch* r = rule(key);
    return r && r->calls == c ? r->reason : Reason();
  }
  // Calls the stock kernel unboxed, with the op's signature (route's
  // fallback).
  template <class Sig, class... Args>
  decltype(auto) call_stock_unboxed(c10::DispatchKey key, Args&&... args) const {
    const Stock& s = stock(key);
    if (detail::Unboxed<Sig>::boxes(*s.unboxed)) detail::count_boxed_fallback();
    return detail::Unboxed<Sig>::call(*s.unboxed, s.handle, c10::DispatchKeySet(key), std::forward<Args>(args)...);
  }
  // Calls the stock kernel boxed, with any arguments it takes (an fp8
  // kernel running torch's on bytes).
  template <class Ret, class... Args>
  Ret call_stock(c10::DispatchKey key, const Args&... args) const {
    const Stock& s = stock(key);
    return detail::call_boxed<Ret>(*s.kernel, s.handle, key, args...);
  }
  bool has_stock(c10::DispatchKey key) const;

 private:
  struct Stock {
    const c10::SafeKernelFunction* kernel;  // in stock_kernel's map, never erased
    const c10::KernelFunction* unboxed;     // what `kernel` wraps
    c10::OperatorHandle handle;
  };
  const Stock& stock(c10::DispatchKey key) const;
  RuleSlot& slot_;
  mutable std::atomic<const Stock*> stock_cpu_{nullptr}, stock_mps_{nullptr};
  mutable std::atomic<int8_t> has_cpu_{-1}, has_mps_{-1};  // -1: not looked up yet
};

// The stock kernel of one aten op and key, looked up once, for inputs an
// override never handles and sees on every call (the fp8 family overrides
// copy_ for every dtype to handle float8): they go there without route's
// bookkeeping, and are not counted (they are not a fallback: the family
// never takes them). `Op` is the op's at::_ops struct (at::_ops::copy_),
// whose schema types the call: it is unboxed, as the dispatcher would make
// it. Keep one in a function-local static.
template <class Op>
class PassThrough {
 public:
  explicit PassThrough(c10::DispatchKey key)
      : kernel_(compat::kernel_function(stock_kernel(name(), key))), op_(op_handle(name())), key_(key) {}
  template <class... Args>
  decltype(auto) operator()(Args&&... args) const {
    return detail::Unboxed<typename Op::schema>::call(kernel_, op_, c10::DispatchKeySet(key_),
                                                      std::forward<Args>(args)...);
  }

 private:
  static std::string name() {
    return std::string(Op::name) + (*Op::overload_name ? std::string(".") + Op::overload_name : "");
  }
  c10::KernelFunction kernel_;  // a copy of the stock kernel (aten's are never deregistered)
  c10::OperatorHandle op_;
  c10::DispatchKey key_;
};

namespace detail {

// A tensor argument on another device than `want`: why the call goes to the
// stock kernel (none if none). Arguments that are not tensors are ignored.
inline void foreign_device(const at::Tensor& t, c10::DeviceType want, Reason& why) {
  if (!why && t.defined() && t.device().type() != want) why = because::foreign_device(t.device().type(), want);
}
inline void foreign_device(const c10::optional<at::Tensor>& t, c10::DeviceType want, Reason& why) {
  if (t) foreign_device(*t, want, why);
}
inline void foreign_device(at::TensorList ts, c10::DeviceType want, Reason& why) {
  for (const auto& t : ts) foreign_device(t, want, why);
}
template <class T>
void foreign_device(const T&, c10::DeviceType, Reason&) {}

// The device type whose tensors the kernels of `key` take.
c10::DeviceType device_of(c10::DispatchKey key);

// Why the call goes to the stock kernel before anything about its
// arguments is looked at (none if it does not): turned off, no CPU backend
// or one that does not take the call.
Reason precheck(const Family& fam, c10::DispatchKey key);

// The error of a call that cannot run mps_ext's kernel (`reason`) and has no
// torch kernel to go to.
std::string cannot_run(const char* op, c10::DispatchKey key, Reason reason);

// Why the policy sends this call to the stock kernel (none if it does not).
// The arguments are boxed only for a rule that looks at them.
template <class... Args>
Reason policy(const RoutedOp& op, c10::DispatchKey key, const Args&... args) {
  const LeftToTorch* rule = op.rule(key);
  if (!rule || rule->calls != Condition::all) return {};
  if (rule->kept_dtypes.empty() && rule->kept_args.empty()) return rule->reason;
  torch::jit::Stack stack;
  (torch::jit::push(stack, args), ...);
  return rule->applies(stack) ? rule->reason : Reason();
}

}  // namespace detail

// Thrown by an op's own code inside route's `ours` for a call its kernel
// cannot take on this GPU though it takes others (rms_norm: a row longer
// than the threads its pipeline allows here hold): that call goes to the
// stock kernel, counted under `reason`; nothing is remembered.
struct CallNotTaken {
  Reason reason;
};

// Runs `ours` unless a reason listed at the top of this file says no; then
// `theirs(reason)`. Returns what `ours` returns (by value: a tensor or a
// tuple of tensors). `unsupported`: the op's own reason not to handle these
// inputs, or none. `args`: the op's arguments (their devices are checked).
template <class Ours, class Theirs, class... Args>
auto route_to(const RoutedOp& op, c10::DispatchKey key, Reason unsupported, Ours ours, Theirs theirs,
              const Args&... args) -> std::decay_t<decltype(ours())> {
  using Ret = std::decay_t<decltype(ours())>;
  Family& fam = op.family;
  Reason reason = detail::precheck(fam, key);
  if (!reason) reason = detail::policy(op, key, args...);
  if (!reason) (detail::foreign_device(args, detail::device_of(key), reason), ...);
  if (!reason) reason = unsupported;
  if (!reason) {
    try {
      Ret out = ours();
      fam.count_ran();
      return out;
    } catch (const BackendUnavailable& e) {
      // Nothing ours() wrote is returned: the fallback recomputes the whole
      // result, so an op that failed at its second dispatch is safe.
      remember_unavailable(detail::device_of(key), e);
      fam.note_unavailable(key, e);
      reason = because::kernels_unavailable;
    } catch (const CallNotTaken& e) {
      reason = e.reason;
    }
  }
  fam.count_fallback(reason);
  return theirs(reason);
}

// route_to with the stock kernel of the op for `key` as the fallback, called
// unboxed with `Sig`, the op's C++ signature: the override's own type
// (route<decltype(mm_impl<K>)>(...)), `args` its parameters as it got them.
// (Not a redispatch below mps_ext's key: the override replaces torch's
// kernel on that key, so the dispatcher would find mps_ext's kernel again.)
template <class Sig, class Ours, class... Args>
auto route(const RoutedOp& op, c10::DispatchKey key, Reason unsupported, Ours ours, Args&&... args)
    -> std::decay_t<decltype(ours())> {
  using Ret = std::decay_t<decltype(ours())>;
  auto stock = [&](Reason reason) -> Ret {
    // An op torch has no kernel of its own for here (mps_ext registers it
    // rather than overriding it) has nowhere to go: say why.
    TORCH_CHECK(op.has_stock(key), detail::cannot_run(op.name, key, reason));
    return op.call_stock_unboxed<Sig>(key, args...);
  };
  return route_to(op, key, unsupported, ours, stock, args...);
}

// For an op of mps_ext's own (torch.ops.mps_ext.moe_route, ...: no torch
// kernel exists anywhere): runs `ours` and counts it, or raises, saying why,
// where route() would fall back (the family turned off, a kernel it needs
// unavailable on this device, the executor not asked for, ...).
template <class Ours>
auto run_own(const RoutedOp& op, c10::DispatchKey key, Ours ours) -> std::decay_t<decltype(ours())> {
  using Ret = std::decay_t<decltype(ours())>;
  auto refuse = [&](Reason reason) -> Ret { C10_THROW_ERROR(Error, detail::cannot_run(op.name, key, reason)); };
  return route_to(op, key, Reason(), ours, refuse);
}

}  // namespace mps_ext
