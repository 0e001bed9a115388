// What every op shares: its family's on/off switch and counters, and the
// stock kernel it falls back to for inputs it does not handle.
//
// A family ("softmax", "pad", ...) is what a user turns off. Each op runs
// through `route`, which sends the call to the kernel registered for the
// same aten op and dispatch key before mps_ext's override (on MPS: PyTorch's
// own kernel, captured when the override was installed; on CPU, for the
// torch.ops.mps_ext ops: aten's CPU kernel) when
//   - the family is turned off;
//   - the family's kernels cannot run on this device (a Metal library or
//     pipeline that failed to build here: see BackendUnavailable);
//   - the policy leaves this op to the installed torch (mps_ext/_policy.py),
//     possibly not for dtypes or argument values torch's kernel refuses (a
//     LeftToTorch rule; a rule whose calls the op's own code picks is the
//     op's `unsupported` reason);
//   - a tensor argument lives on another device than the kernel's (a 0-dim
//     CPU tensor beside MPS tensors: torch's kernel does what torch does);
//   - the op says it does not handle these inputs (`unsupported`);
// and counts the reason. A reason that is a policy decision (torch has as
// good a kernel) starts with "policy: ": the self-check and the tests accept
// those fallbacks on MPS, and "turned off", but no other. Everything here is
// generic over op families: a new family gets all of it by calling route.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/boxing/impl/boxing.h>
#include <ATen/core/stack.h>

#include <atomic>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "backend/launch.h"

namespace mps_ext {

// A policy decision (mps_ext/_policy.py): which calls of an op go to the
// stock kernel because torch's own is as good.
struct LeftToTorch {
  std::string why;  // the fallback's reason: "policy: ..."
  // Not calls with a tensor argument (or one in a list) of one of these
  // dtypes, nor those whose argument at this index (of the op's schema) is
  // this bool: inputs torch's kernel refuses, which mps_ext keeps.
  std::vector<c10::ScalarType> kept_dtypes;
  std::vector<std::pair<size_t, bool>> kept_args;
  // The op's own code picks the calls (by what torch's kernel takes: a row
  // count, a scale recipe) and gives `why` as its `unsupported` reason;
  // route does not apply the rule itself.
  bool op_picks = false;

  bool applies(const torch::jit::Stack& args) const;
};

struct Family {
  explicit Family(std::string n) : name(std::move(n)) {}
  const std::string name;
  std::atomic<bool> enabled{true};

  void count_ran();
  void count_fallback(const std::string& reason);
  uint64_t ran() const;
  std::map<std::string, uint64_t> fallbacks() const;
  void reset();

  // The family's kernels cannot run for `key` in this process (empty: they
  // can). The first call warns once, naming the cause; later ones are no-ops.
  std::string unavailable(c10::DispatchKey key) const;
  void mark_unavailable(c10::DispatchKey key, const std::string& cause);
  std::map<c10::DispatchKey, std::string> unavailable_all() const;
  void clear_unavailable();  // for tests only: a real failure does not heal

  // The policy's per-op decision: calls of `op` for `key` go to the stock
  // kernel, counted under `why` (empty `why`: clears it); not those with a
  // tensor of one of `kept_dtypes`, nor those whose bool argument named in
  // `kept_args` has the value given there; with `op_picks`, those the op's
  // code picks (LeftToTorch).
  void leave_to_torch(const std::string& op, c10::DispatchKey key, const std::string& why,
                      const std::vector<c10::ScalarType>& kept_dtypes = {},
                      const std::vector<std::pair<std::string, bool>>& kept_args = {}, bool op_picks = false);
  c10::optional<LeftToTorch> left_to_torch(const std::string& op, c10::DispatchKey key) const;

 private:
  mutable std::mutex mutex_;
  uint64_t ran_ = 0;
  std::map<std::string, uint64_t> fallbacks_;
  std::map<c10::DispatchKey, std::string> unavailable_;
  std::map<std::pair<std::string, c10::DispatchKey>, LeftToTorch> left_to_torch_;
  // Read on every call without the lock: most families have neither.
  std::atomic<bool> any_unavailable_{false}, any_left_to_torch_{false};
};

// The family of this name, created on first use.
Family& family(const std::string& name);
std::vector<std::string> family_names();

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

// The stock kernel of one op and key, looked up once, for inputs an
// override never handles and sees on every call (the fp8 family overrides
// copy_ for every dtype to handle float8): they go there for one boxed call,
// without route's bookkeeping, and are not counted (they are not a fallback:
// the family never takes them). Keep one in a function-local static.
class PassThrough {
 public:
  PassThrough(const std::string& op, c10::DispatchKey key)
      : kernel_(stock_kernel(op, key)), op_(op_handle(op)), key_(key) {}
  template <class Ret = at::Tensor, class... Args>
  Ret operator()(const Args&... args) const {
    return detail::call_boxed<Ret>(kernel_, op_, key_, args...);
  }

 private:
  const c10::SafeKernelFunction& kernel_;  // in stock_kernel's map, never erased
  c10::OperatorHandle op_;
  c10::DispatchKey key_;
};

namespace detail {

// A tensor argument on another device than `want`: why the call goes to the
// stock kernel ("" if none). Arguments that are not tensors are ignored.
inline void foreign_device(const at::Tensor& t, c10::DeviceType want, std::string& why) {
  if (why.empty() && t.defined() && t.device().type() != want)
    why = std::string("a ") + c10::DeviceTypeName(t.device().type()) + " tensor beside " +
          c10::DeviceTypeName(want) + " tensors";
}
inline void foreign_device(const c10::optional<at::Tensor>& t, c10::DeviceType want, std::string& why) {
  if (t) foreign_device(*t, want, why);
}
inline void foreign_device(at::TensorList ts, c10::DeviceType want, std::string& why) {
  for (const auto& t : ts) foreign_device(t, want, why);
}
template <class T>
void foreign_device(const T&, c10::DeviceType, std::string&) {}

// The device type whose tensors the kernels of `key` take.
c10::DeviceType device_of(c10::DispatchKey key);

// Why the call goes to the stock kernel before anything about its
// arguments is looked at ("" if it does not): turned off, unavailable.
std::string precheck(Family& fam, c10::DispatchKey key);

// The error of a call that cannot run mps_ext's kernel (`reason`) and has no
// torch kernel to go to.
std::string cannot_run(const std::string& op, c10::DispatchKey key, const std::string& reason);

// Why the policy sends this call to the stock kernel ("" if it does not).
// The arguments are boxed only for a rule that looks at them.
template <class... Args>
std::string policy(Family& fam, const std::string& op, c10::DispatchKey key, const Args&... args) {
  c10::optional<LeftToTorch> rule = fam.left_to_torch(op, key);
  if (!rule || rule->op_picks) return "";
  if (rule->kept_dtypes.empty() && rule->kept_args.empty()) return rule->why;
  torch::jit::Stack stack;
  (torch::jit::push(stack, args), ...);
  return rule->applies(stack) ? rule->why : "";
}

}  // namespace detail

// Runs `ours` unless a reason listed at the top of this file says no; then
// `theirs(reason)`. Returns what `ours` returns (by value: a tensor or a
// tuple of tensors). `unsupported`: the op's own reason not to handle these
// inputs, or empty. `args`: the op's arguments (their devices are checked).
template <class Ours, class Theirs, class... Args>
auto route_to(Family& fam, const std::string& op, c10::DispatchKey key, const std::string& unsupported, Ours ours,
              Theirs theirs, const Args&... args) -> std::decay_t<decltype(ours())> {
  using Ret = std::decay_t<decltype(ours())>;
  std::string reason = detail::precheck(fam, key);
  if (reason.empty()) reason = detail::policy(fam, op, key, args...);
  if (reason.empty()) (detail::foreign_device(args, detail::device_of(key), reason), ...);
  if (reason.empty()) reason = unsupported;
  if (reason.empty()) {
    try {
      Ret out = ours();
      fam.count_ran();
      return out;
    } catch (const BackendUnavailable& e) {
      // Nothing ours() wrote is returned: the fallback recomputes the whole
      // result, so an op that failed at its second dispatch is safe.
      fam.mark_unavailable(key, e.cause);
      reason = "kernels unavailable on this device";
    }
  }
  fam.count_fallback(reason);
  return theirs(reason);
}

// route_to with the stock kernel of `op` for `key` as the fallback.
template <class Ours, class... Args>
auto route(Family& fam, const std::string& op, c10::DispatchKey key, const std::string& unsupported, Ours ours,
           const Args&... args) -> std::decay_t<decltype(ours())> {
  using Ret = std::decay_t<decltype(ours())>;
  auto stock = [&](const std::string& reason) {
    // An op torch has no kernel of its own for here (mps_ext registers it
    // rather than overriding it) has nowhere to go: say why.
    TORCH_CHECK(has_stock_kernel(op, key), detail::cannot_run(op, key, reason));
    return call_stock<Ret>(op, key, args...);
  };
  return route_to(fam, op, key, unsupported, ours, stock, args...);
}

// For an op of mps_ext's own (torch.ops.mps_ext.moe_route, ...: no torch
// kernel exists anywhere): runs `ours` and counts it, or raises, saying why,
// where route() would fall back (the family turned off, its kernels
// unavailable on this device).
template <class Ours>
auto run_own(Family& fam, const std::string& op, c10::DispatchKey key, Ours ours) -> std::decay_t<decltype(ours())> {
  using Ret = std::decay_t<decltype(ours())>;
  auto refuse = [&](const std::string& reason) -> Ret { C10_THROW_ERROR(Error, detail::cannot_run(op, key, reason)); };
  return route_to(fam, op, key, "", ours, refuse);
}

}  // namespace mps_ext
