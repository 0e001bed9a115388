// What every op shares: its family's on/off switch and counters, and the
// stock kernel it falls back to for inputs it does not handle.
//
// A family ("softmax", "pad", ...) is what a user turns off. Each op runs
// through `route`: if the family is off or the op returns a reason it
// cannot handle these inputs, the call goes to the kernel registered for the
// same aten op and dispatch key before mps_ext's override (on MPS: PyTorch's
// own kernel, captured when the override was installed; on CPU, for the
// torch.ops.mps_ext ops: aten's CPU kernel), and the reason is counted.
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

namespace mps_ext {

struct Family {
  explicit Family(std::string n) : name(std::move(n)) {}
  const std::string name;
  std::atomic<bool> enabled{true};

  void count_ran();
  void count_fallback(const std::string& reason);
  uint64_t ran() const;
  std::map<std::string, uint64_t> fallbacks() const;
  void reset();

 private:
  mutable std::mutex mutex_;
  uint64_t ran_ = 0;
  std::map<std::string, uint64_t> fallbacks_;
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

// The dispatcher's handle of `op` ("aten::_softmax", "aten::add.Tensor").
c10::OperatorHandle op_handle(const std::string& op);

// Calls the stock kernel with boxed arguments and returns its result: a
// tensor, or a tuple of them for ops with several outputs.
template <class Ret = at::Tensor, class... Args>
Ret call_stock(const std::string& op, c10::DispatchKey key, const Args&... args) {
  const c10::SafeKernelFunction& k = stock_kernel(op, key);
  torch::jit::Stack stack;
  (torch::jit::push(stack, args), ...);
  k.callBoxed(op_handle(op), c10::DispatchKeySet(key), &stack);
  return c10::impl::PopResult<Ret>::call(stack);
}

// Runs `ours` unless the family is off or `unsupported` (a reason, or empty)
// says no; then the stock kernel of `op` for `key`. Returns what `ours`
// returns (by value: a tensor or a tuple of tensors).
template <class Ours, class... Args>
auto route(Family& fam, const std::string& op, c10::DispatchKey key, const std::string& unsupported, Ours ours,
           const Args&... args) -> std::decay_t<decltype(ours())> {
  using Ret = std::decay_t<decltype(ours())>;
  std::string reason = !fam.enabled.load() ? "turned off" : unsupported;
  if (!reason.empty()) {
    fam.count_fallback(reason);
    return call_stock<Ret>(op, key, args...);
  }
  Ret out = ours();
  fam.count_ran();
  return out;
}

}  // namespace mps_ext
