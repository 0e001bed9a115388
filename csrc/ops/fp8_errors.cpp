// Every aten op the fp8 family does not handle, on a float8 MPS tensor:
// torch 2.9-2.14 (and 2.15 for float8_e5m2) refuse it with an error that
// names the dtype but not the op ("Trying to convert Float8_e4m3fn to the
// MPS backend but it does not have support for that dtype."), deep in the
// MPS kernel. The error users should get names the op and says to cast.
//
// No dispatch key is taken only by float8 tensors, so the wording can only
// come from a wrapper around each op's MPS kernel. The wrapper calls torch's
// kernel and looks at nothing unless that kernel throws; then, if the
// message is about a float8 dtype, it throws the same kind of error naming
// the op, with torch's message kept. It never refuses a call torch would run.
//
// Which kernel it calls. The dispatcher cannot call "the kernel beneath this
// one" (no API reaches a shadowed registration), so a wrapper holds the
// kernel it wraps, and a held kernel that is later deregistered is
// invalidated: every call then raises (torch's SafeKernelFunction). So a
// wrapper goes only over torch's own kernel: an op whose key has exactly one
// registration (torch's, made when libtorch loads, never removed while the
// process lives). An op a third party already overrides is left unwrapped
// (its errors are its own); one overridden after the wrappers, and that
// override removed again, finds the wrapper and torch's kernel beneath.
//
// When. The dispatcher's tables are read without a lock by every thread
// that dispatches, so rewriting about 1,000 entries while other threads run
// ops is a data race. On MPS the wrappers are installed at `import mps_ext`
// (mps_ext/__init__.py, with the overrides: when every extension registers
// its kernels), not when float8 values first reach the GPU. Each wrapper is
// inert (a plain call of torch's kernel) until the last one is registered,
// then one atomic store arms them all: a thread sees all ops named or none.
//
// What it costs: a boxed call per op (arguments moved to and from a stack),
// a few hundred nanoseconds on a small CPU op here, against the 20 us or
// more of CPU an eager MPS op costs. Views (dtype-blind, and the most
// frequent calls) and ops without a tensor argument are not wrapped, nor are
// the ops mps_ext overrides (their errors are its own).
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <sstream>
#include <string>

#include "ops/fp8.h"
#include "dispatch/registration.h"

namespace mps_ext {
namespace {

bool about_float8(const std::string& message) { return message.find("Float8_e") != std::string::npos; }

std::string qualified(const c10::OperatorName& name) {
  return name.overload_name.empty() ? name.name : name.name + "." + name.overload_name;
}

class NameFloat8Errors final : public c10::OperatorKernel {
 public:
  NameFloat8Errors(c10::SafeKernelFunction torchs, const std::atomic<bool>& armed)
      : torchs_(std::move(torchs)), armed_(armed) {}

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
    try {
      torchs_.callBoxed(op, keys, stack);
    } catch (const c10::Error& e) {
      if (!armed_.load(std::memory_order_acquire) || !about_float8(e.msg())) throw;
      const std::string message = "mps_ext fp8: " + qualified(op.operator_name()) +
                                  " does not take float8 tensors on this device in this torch release; cast "
                                  "first, e.g. x.to(torch.bfloat16) (torch: " +
                                  e.msg() + ")";
      if (dynamic_cast<const c10::NotImplementedError*>(&e)) TORCH_CHECK_NOT_IMPLEMENTED(false, message);
      if (dynamic_cast<const c10::TypeError*>(&e)) TORCH_CHECK_TYPE(false, message);
      if (dynamic_cast<const c10::ValueError*>(&e)) TORCH_CHECK_VALUE(false, message);
      TORCH_CHECK(false, message);
    }
  }

 private:
  c10::SafeKernelFunction torchs_;
  const std::atomic<bool>& armed_;
};

bool holds_tensor(const c10::TypePtr& type) {
  if (type->kind() == c10::TypeKind::TensorType) return true;
  for (const auto& contained : type->containedTypes())
    if (holds_tensor(contained)) return true;
  return false;
}

// A view returns an alias of an argument that it does not write.
bool is_view(const c10::FunctionSchema& schema) {
  for (const auto& r : schema.returns())
    if (r.alias_info() && !r.alias_info()->isWrite()) return true;
  return false;
}

bool wrapped(const c10::FunctionSchema& schema, const std::set<std::string>& overridden) {
  if (schema.name().rfind("aten::", 0) != 0 || is_view(schema)) return false;
  if (overridden.count(qualified(schema.operator_name()))) return false;
  for (const auto& a : schema.arguments())
    if (holds_tensor(a.type())) return true;
  return false;
}

// The kernels registered for `key` (the active one and those it shadows),
// as the dispatcher lists them ("CPU: ..." and "CPU (inactive): ...").
int registrations(const c10::OperatorHandle& op, c10::DispatchKey key) {
  const std::string name = c10::toString(key), active = name + ": ", shadowed = name + " (inactive): ";
  std::istringstream lines(op.dumpState());
  int n = 0;
  for (std::string line; std::getline(lines, line);)
    if (line.rfind(active, 0) == 0 || line.rfind(shadowed, 0) == 0) ++n;
  return n;
}

}  // namespace

int64_t name_float8_errors(c10::DispatchKey key) {
  TORCH_CHECK(key == c10::DispatchKey::MPS || key == c10::DispatchKey::CPU,
              "mps_ext: float8 errors are named on the MPS key (or CPU, in tests), not ", key);
  static std::mutex mutex;
  static std::map<c10::DispatchKey, int64_t> done;  // key -> ops wrapped
  static std::atomic<bool> armed_mps{false}, armed_cpu{false};
  std::lock_guard<std::mutex> lock(mutex);
  auto it = done.find(key);
  if (it != done.end()) return it->second;
  std::atomic<bool>& armed = key == c10::DispatchKey::MPS ? armed_mps : armed_cpu;

  std::set<std::string> overridden;
  for (const auto& fam : family_names())
    for (const auto& op : family_aten_ops(fam)) overridden.insert(op);
  auto& dispatcher = c10::Dispatcher::singleton();
  // Never destroyed: destroying it would unregister the wrappers.
  auto* lib = new torch::Library(torch::Library::IMPL, "aten", key, __FILE__, __LINE__);
  int64_t count = 0;
  without_override_warning([&] {
    for (const auto& name : dispatcher.getAllOpNamesForDispatchKey(key)) {
      auto op = dispatcher.findOp(name);
      if (!op || !wrapped(op->schema(), overridden) || registrations(*op, key) != 1) continue;
      auto wrapper = std::make_unique<NameFloat8Errors>(op->getComputedKernelForDispatchKey(key), armed);
      const std::string qualified_name = qualified(name);
      lib->impl(qualified_name.substr(6).c_str(), torch::CppFunction::makeFromBoxedFunctor(std::move(wrapper)));
      ++count;
    }
  });
  armed.store(true, std::memory_order_release);
  done[key] = count;
  return count;
}

}  // namespace mps_ext
