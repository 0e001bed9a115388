#include "ops/registry.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <set>

#include "ops/kernel_choice.h"

namespace mps_ext {

void Family::count_ran() {
  std::lock_guard<std::mutex> g(mutex_);
  ++ran_;
}
void Family::count_fallback(const std::string& reason) {
  std::lock_guard<std::mutex> g(mutex_);
  ++fallbacks_[reason];
}
uint64_t Family::ran() const {
  std::lock_guard<std::mutex> g(mutex_);
  return ran_;
}
std::map<std::string, uint64_t> Family::fallbacks() const {
  std::lock_guard<std::mutex> g(mutex_);
  return fallbacks_;
}
void Family::reset() {
  std::lock_guard<std::mutex> g(mutex_);
  ran_ = 0;
  fallbacks_.clear();
}

std::string Family::unavailable(c10::DispatchKey key) const {
  if (!any_unavailable_.load()) return "";
  std::lock_guard<std::mutex> g(mutex_);
  auto it = unavailable_.find(key);
  return it == unavailable_.end() ? "" : it->second;
}

void Family::mark_unavailable(c10::DispatchKey key, const std::string& cause) {
  {
    std::lock_guard<std::mutex> g(mutex_);
    if (!unavailable_.emplace(key, cause).second) return;  // another thread got there first
    any_unavailable_ = true;
  }
  const std::string device = c10::DeviceTypeName(detail::device_of(key));
  TORCH_WARN("mps_ext: the ", name, " kernels cannot run on ", device, " here (", cause, "); every ", name,
             " call on ", device, " now goes to PyTorch's own kernel for the rest of this process.");
}

std::map<c10::DispatchKey, std::string> Family::unavailable_all() const {
  std::lock_guard<std::mutex> g(mutex_);
  return unavailable_;
}

void Family::clear_unavailable() {
  std::lock_guard<std::mutex> g(mutex_);
  unavailable_.clear();
  any_unavailable_ = false;
}

bool LeftToTorch::applies(const torch::jit::Stack& args) const {
  auto kept = [&](const at::Tensor& t) {
    return t.defined() && std::find(kept_dtypes.begin(), kept_dtypes.end(), t.scalar_type()) != kept_dtypes.end();
  };
  for (const auto& a : args) {
    if (a.isTensor() && kept(a.toTensor())) return false;
    if (a.isTensorList())
      for (const at::Tensor& t : a.toTensorVector())
        if (kept(t)) return false;
  }
  for (const auto& [index, value] : kept_args)
    if (index < args.size() && args[index].isBool() && args[index].toBool() == value) return false;
  return true;
}

void Family::leave_to_torch(const std::string& op, c10::DispatchKey key, const std::string& why,
                            const std::vector<c10::ScalarType>& kept_dtypes,
                            const std::vector<std::pair<std::string, bool>>& kept_args, bool op_picks) {
  LeftToTorch rule{why, kept_dtypes, {}, op_picks};
  if (!kept_args.empty()) {
    const c10::FunctionSchema& schema = op_handle(op).schema();
    for (const auto& [name, value] : kept_args) {
      auto index = schema.argumentIndexWithName(name);
      TORCH_CHECK(index && schema.arguments()[*index].type()->kind() == c10::TypeKind::BoolType, "mps_ext: ", op,
                  " has no bool argument named '", name, "'");
      rule.kept_args.emplace_back(static_cast<size_t>(*index), value);
    }
  }
  std::lock_guard<std::mutex> g(mutex_);
  if (why.empty())
    left_to_torch_.erase(std::make_pair(op, key));
  else
    left_to_torch_[std::make_pair(op, key)] = std::move(rule);
  any_left_to_torch_ = !left_to_torch_.empty();
}

c10::optional<LeftToTorch> Family::left_to_torch(const std::string& op, c10::DispatchKey key) const {
  if (!any_left_to_torch_.load()) return c10::nullopt;
  std::lock_guard<std::mutex> g(mutex_);
  auto it = left_to_torch_.find(std::make_pair(op, key));
  if (it == left_to_torch_.end()) return c10::nullopt;
  return it->second;
}

namespace detail {

c10::DeviceType device_of(c10::DispatchKey key) {
  switch (key) {
    case c10::DispatchKey::CPU: return c10::DeviceType::CPU;
    case c10::DispatchKey::MPS: return c10::DeviceType::MPS;
    default: TORCH_CHECK(false, "mps_ext: no kernels for dispatch key ", key);
  }
}

std::string precheck(Family& fam, c10::DispatchKey key) {
  if (!fam.enabled.load()) return "turned off";
  if (!fam.unavailable(key).empty()) return "kernels unavailable on this device";
  return "";
}

std::string cannot_run(const std::string& op, c10::DispatchKey key, const std::string& reason) {
  return "mps_ext: " + op + " cannot run on " + c10::DeviceTypeName(device_of(key)) + " here (" + reason +
         ") and torch has no kernel of its own for it to run instead";
}

}  // namespace detail

namespace {
std::mutex g_mutex;
std::map<std::string, std::unique_ptr<Family>>& families() {
  static auto* f = new std::map<std::string, std::unique_ptr<Family>>();
  return *f;
}
std::map<std::pair<std::string, c10::DispatchKey>, c10::SafeKernelFunction>& stock() {
  static auto* s = new std::map<std::pair<std::string, c10::DispatchKey>, c10::SafeKernelFunction>();
  return *s;
}
// Ops that had no kernel for a key when mps_ext looked (mps_ext registers one).
std::set<std::pair<std::string, c10::DispatchKey>>& no_stock() {
  static auto* s = new std::set<std::pair<std::string, c10::DispatchKey>>();
  return *s;
}
std::pair<std::string, std::string> split_name(const std::string& op) {
  auto dot = op.find('.');
  if (dot == std::string::npos) return {op, ""};
  return {op.substr(0, dot), op.substr(dot + 1)};
}
}  // namespace

Family& family(const std::string& name) {
  std::lock_guard<std::mutex> g(g_mutex);
  auto& f = families()[name];
  if (!f) f = std::make_unique<Family>(name);
  return *f;
}

std::vector<std::string> family_names() {
  std::lock_guard<std::mutex> g(g_mutex);
  std::vector<std::string> names;
  for (auto& kv : families()) names.push_back(kv.first);
  return names;
}

c10::OperatorHandle op_handle(const std::string& op) {
  auto [name, overload] = split_name(op);
  return c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str());
}

c10::optional<c10::OperatorHandle> find_op(const std::string& op) {
  auto [name, overload] = split_name(op);
  return c10::Dispatcher::singleton().findSchema({name, overload});
}

void capture_stock_kernel(const std::string& op, c10::DispatchKey key) {
  std::lock_guard<std::mutex> g(g_mutex);
  auto k = std::make_pair(op, key);
  if (stock().count(k) || no_stock().count(k)) return;
  // An op this torch lacks (aten::_scaled_mm_v2 before 2.10) has no kernel.
  auto handle = find_op(op);
  if (handle && handle->hasComputedKernelForDispatchKey(key))
    stock().emplace(k, handle->getComputedKernelForDispatchKey(key));
  else
    no_stock().insert(k);
}

bool has_stock_kernel(const std::string& op, c10::DispatchKey key) {
  capture_stock_kernel(op, key);
  std::lock_guard<std::mutex> g(g_mutex);
  return stock().count(std::make_pair(op, key)) > 0;
}

const c10::SafeKernelFunction& stock_kernel(const std::string& op, c10::DispatchKey key) {
  capture_stock_kernel(op, key);
  std::lock_guard<std::mutex> g(g_mutex);
  auto it = stock().find(std::make_pair(op, key));
  TORCH_CHECK(it != stock().end(), "mps_ext: ", op, " has no kernel for ", key, " to fall back to");
  return it->second;
}

}  // namespace mps_ext

// ------------------------------------------------------- index width --
namespace mps_ext {
namespace {
constexpr int64_t kDefaultIndexLimit = INT32_MAX;
std::atomic<int64_t> g_index_limit{kDefaultIndexLimit};
}  // namespace

int64_t index_limit() { return g_index_limit.load(); }
void set_index_limit(int64_t limit) { g_index_limit = limit > 0 ? limit : kDefaultIndexLimit; }

}  // namespace mps_ext
