#include "dispatch/registry.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <set>
#include <unordered_map>
#include <vector>

#include "dispatch/kernel_choice.h"

namespace mps_ext {

// ------------------------------------------------------------- reasons --
namespace reason_detail {
namespace {
std::mutex g_texts_mutex;
// Never shrinks: a counted reason may name any of them.
std::vector<std::string>& texts() {
  static auto* t = new std::vector<std::string>();
  return *t;
}
std::unordered_map<std::string, uint32_t>& text_index() {
  static auto* t = new std::unordered_map<std::string, uint32_t>();
  return *t;
}
}  // namespace

uint32_t intern(const std::string& text) {
  std::lock_guard<std::mutex> g(g_texts_mutex);
  auto [it, added] = text_index().emplace(text, static_cast<uint32_t>(texts().size()));
  if (added) {
    // A reason's text is made from what a call gets wrong, not from its
    // data: this many distinct ones means a bug that builds texts per call.
    TORCH_CHECK(texts().size() < kArgLimit, "mps_ext: more than 2^24 distinct fallback reason texts");
    texts().push_back(text);
  }
  return it->second;
}

std::string interned(uint32_t index) {
  std::lock_guard<std::mutex> g(g_texts_mutex);
  return index < texts().size() ? texts()[index] : "";
}
}  // namespace reason_detail

std::string Reason::text() const {
  using namespace reason_detail;
  const auto id = static_cast<size_t>(this->id());
  if (code_ == 0 || id >= std::size(kTexts)) return "";
  std::string out;
  uint64_t args = code_ >> 16;
  for (const char* s = kTexts[id]; *s;) {
    size_t length = 0;
    const Slot slot = slot_at(s, &length);
    if (slot == Slot::none) {
      out += *s++;
      continue;
    }
    const auto arg = static_cast<uint32_t>(args & (kArgLimit - 1));
    args >>= 24;
    s += length;
    switch (slot) {
      case Slot::dtype: out += c10::toString(static_cast<c10::ScalarType>(arg)); break;
      case Slot::device: out += c10::DeviceTypeName(static_cast<c10::DeviceType>(arg)); break;
      case Slot::n: out += std::to_string(arg); break;
      case Slot::text: out += interned(arg); break;
      case Slot::none: break;
    }
  }
  return out;
}

void ReasonCounts::add(Reason r) {
  const uint64_t key = r.code();
  size_t slot = std::hash<uint64_t>{}(key) % kSlots;
  for (size_t probe = 0; probe < kSlots; ++probe, slot = (slot + 1) % kSlots) {
    uint64_t k = keys_[slot].load(std::memory_order_acquire);
    if (k == 0 && keys_[slot].compare_exchange_strong(k, key, std::memory_order_acq_rel)) k = key;
    if (k == key) {
      counts_[slot].fetch_add(1, std::memory_order_relaxed);
      return;
    }
  }
  other_.fetch_add(1, std::memory_order_relaxed);
}

std::map<std::string, uint64_t> ReasonCounts::read() const {
  std::map<std::string, uint64_t> out;  // two codes may read the same (two identical policy texts: one text)
  for (size_t i = 0; i < kSlots; ++i) {
    const uint64_t k = keys_[i].load(std::memory_order_acquire);
    const uint64_t n = counts_[i].load(std::memory_order_relaxed);
    if (k && n) out[Reason::from_code(k).text()] += n;
  }
  if (uint64_t n = other_.load(std::memory_order_relaxed)) out["other reasons (more than the counters hold)"] += n;
  return out;
}

void ReasonCounts::reset() {
  for (auto& c : counts_) c.store(0, std::memory_order_relaxed);
  other_.store(0, std::memory_order_relaxed);
}

// ---------------------------------------------------------- conditions --
namespace {
const char* const kConditionNames[] = {"",
#define MPS_EXT_CONDITION_NAME(name) #name,
                                       MPS_EXT_CONDITIONS(MPS_EXT_CONDITION_NAME)
#undef MPS_EXT_CONDITION_NAME
};
}  // namespace

Condition condition_named(const std::string& name) {
  for (size_t i = 0; i < std::size(kConditionNames); ++i)
    if (name == kConditionNames[i]) return static_cast<Condition>(i);
  std::string known;
  for (const auto& n : condition_names()) known += (known.empty() ? "" : ", ") + n;
  TORCH_CHECK(false, "mps_ext: no policy condition named '", name, "'; the conditions are ", known,
              " (csrc/dispatch/registry.h, mps_ext/_policy.py)");
}

std::vector<std::string> condition_names() {
  return std::vector<std::string>(std::begin(kConditionNames) + 1, std::end(kConditionNames));
}

// ------------------------------------------------------------ families --
namespace {
std::array<Family, kFamilyCount>& table() {
  static auto* t = new std::array<Family, kFamilyCount>{{
#define MPS_EXT_FAMILY_ENTRY(n) Family(FamilyId::n, #n),
      MPS_EXT_FAMILIES(MPS_EXT_FAMILY_ENTRY)
#undef MPS_EXT_FAMILY_ENTRY
  }};
  return *t;
}
}  // namespace

Family& family(FamilyId id) { return table()[static_cast<size_t>(id)]; }

Family& family(const std::string& name) {
  for (Family& f : table())
    if (name == f.name) return f;
  std::string known;
  for (const auto& n : family_names()) known += (known.empty() ? "" : ", ") + n;
  TORCH_CHECK(false, "mps_ext: no op family named '", name, "'; the families are ", known);
}

std::vector<std::string> family_names() {
  std::vector<std::string> names;
  for (const Family& f : table()) names.push_back(f.name);
  return names;
}

std::string family_table_problem(const std::vector<std::pair<std::string, int>>& definitions) {
  std::string problem;
  for (const auto& [name, count] : definitions) {
    if (count == 1) continue;
    problem += std::string(problem.empty() ? "" : "; ") + "the family '" + name +
               (count == 0 ? "' is in dispatch/families.h but no file defines it with MPS_EXT_FAMILY"
                           : "' is defined " + std::to_string(count) + " times (MPS_EXT_FAMILY)");
  }
  return problem;
}

std::string family_table_problem() {
  std::vector<std::pair<std::string, int>> definitions;
  for (const Family& f : table()) definitions.emplace_back(f.name, f.definitions());
  return family_table_problem(definitions);
}

void Family::define(Def def) {
  // Static initialisation cannot raise: a second definition is counted and
  // raised when _C loads (family_table_problem); the first one stays.
  if (definitions_.fetch_add(1, std::memory_order_relaxed) == 0) def_ = std::move(def);
}

const Family::Def& Family::def() const {
  TORCH_CHECK(defined(), "mps_ext: the family '", name, "' is not defined (no MPS_EXT_FAMILY)");
  return def_;
}

void Family::reset() {
  ran_.store(0, std::memory_order_relaxed);
  fallbacks_.reset();
}

void Family::note_unavailable(c10::DispatchKey key, const BackendUnavailable& e) {
  {
    std::lock_guard<std::mutex> g(mutex_);
    auto& causes = unavailable_[key];
    // Said already: another thread, or another op of the family that needs the kernel.
    if (std::find(causes.begin(), causes.end(), e.cause) != causes.end()) return;
    causes.push_back(e.cause);
  }
  const std::string device = c10::DeviceTypeName(detail::device_of(key));
  const std::string what = e.whole_library ? "the kernels of " + e.library + ".metal" : "kernel " + e.kernel;
  TORCH_WARN("mps_ext: ", what, " cannot run on ", device, " here (", e.cause, "); the ", name, " calls on ", device,
             " that need ", e.whole_library ? "them" : "it",
             " go to PyTorch's own kernel for the rest of this "
             "process, and the family's other kernels keep running.");
}

std::map<c10::DispatchKey, std::string> Family::unavailable_all() const {
  std::lock_guard<std::mutex> g(mutex_);
  std::map<c10::DispatchKey, std::string> out;
  for (const auto& [key, causes] : unavailable_) out[key] = c10::Join("; ", causes);
  return out;
}

void Family::clear_unavailable() {
  std::lock_guard<std::mutex> g(mutex_);
  unavailable_.clear();
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

RuleSlot& Family::rule_slot(const std::string& op) {
  std::lock_guard<std::mutex> g(mutex_);
  auto& slot = slots_[op];
  if (!slot) slot = std::make_unique<RuleSlot>();
  return *slot;
}

void Family::leave_to_torch(const std::string& op, c10::DispatchKey key, const std::string& why,
                            const std::vector<c10::ScalarType>& kept_dtypes,
                            const std::vector<std::pair<std::string, bool>>& kept_args, Condition calls) {
  const auto& ops = def().aten_ops;
  TORCH_CHECK(std::find(ops.begin(), ops.end(), op) != ops.end(), "mps_ext: the ", name, " family has no op ", op,
              " (its ops: ", c10::Join(", ", ops), ")");
  TORCH_CHECK(calls == Condition::all || (kept_dtypes.empty() && kept_args.empty()), "mps_ext: ", op,
              ": a rule whose calls a condition picks keeps no dtypes or arguments");
  auto rule = std::make_unique<LeftToTorch>(LeftToTorch{why, kept_dtypes, {}, calls, Reason()});
  if (!why.empty()) rule->reason = because::policy(why);
  if (!kept_args.empty()) {
    const c10::FunctionSchema& schema = op_handle(op).schema();
    for (const auto& [arg, value] : kept_args) {
      auto index = schema.argumentIndexWithName(arg);
      TORCH_CHECK(index && schema.arguments()[*index].type()->kind() == c10::TypeKind::BoolType, "mps_ext: ", op,
                  " has no bool argument named '", arg, "'");
      rule->kept_args.emplace_back(static_cast<size_t>(*index), value);
    }
  }
  RuleSlot& slot = rule_slot(op);
  std::lock_guard<std::mutex> g(mutex_);
  // A call may be reading the rule this replaces: rules are kept, not freed.
  // A rule set again (the model runner re-applies a release's policy) is the
  // one kept before, so that its reason stays one counter.
  const LeftToTorch* kept = nullptr;
  for (const auto& r : rules_)
    if (r->why == rule->why && r->kept_dtypes == rule->kept_dtypes && r->kept_args == rule->kept_args &&
        r->calls == rule->calls)
      kept = r.get();
  if (!kept && !why.empty()) {
    kept = rule.get();
    rules_.push_back(std::move(rule));
  }
  slot.of(key).store(why.empty() ? nullptr : kept, std::memory_order_release);
}

// ----------------------------------------------------------- routing --
namespace detail {

c10::DeviceType device_of(c10::DispatchKey key) {
  switch (key) {
    case c10::DispatchKey::CPU: return c10::DeviceType::CPU;
    case c10::DispatchKey::MPS: return c10::DeviceType::MPS;
    default: TORCH_CHECK(false, "mps_ext: no kernels for dispatch key ", key);
  }
}

Reason precheck(const Family& fam, c10::DispatchKey key) {
  if (!fam.enabled.load(std::memory_order_relaxed)) return because::turned_off;
  if (key == c10::DispatchKey::CPU) {
    const CpuBackend* backend = cpu_backend();
    if (!backend) return because::no_cpu_backend;
    if (!backend->accepts()) return because::cpu_backend_not_asked;
  }
  return {};
}

namespace {
std::atomic<uint64_t> g_boxed_fallbacks{0};
}
void count_boxed_fallback() { g_boxed_fallbacks.fetch_add(1, std::memory_order_relaxed); }
uint64_t boxed_fallbacks() { return g_boxed_fallbacks.load(std::memory_order_relaxed); }

std::string cannot_run(const char* op, c10::DispatchKey key, Reason reason) {
  return std::string("mps_ext: ") + op + " cannot run on " + c10::DeviceTypeName(device_of(key)) + " here (" +
         reason.text() + ") and torch has no kernel of its own for it to run instead";
}

}  // namespace detail

const RoutedOp::Stock& RoutedOp::stock(c10::DispatchKey key) const {
  auto& cached = key == c10::DispatchKey::MPS ? stock_mps_ : stock_cpu_;
  if (const Stock* s = cached.load(std::memory_order_acquire)) return *s;
  // Two threads may both look it up: one copy is kept, the other leaks (once per op and key).
  const c10::SafeKernelFunction& kernel = stock_kernel(name, key);
  auto* s = new Stock{&kernel, &compat::kernel_function(kernel), op_handle(name)};
  const Stock* expected = nullptr;
  if (!cached.compare_exchange_strong(expected, s, std::memory_order_acq_rel)) return *expected;
  return *s;
}

bool RoutedOp::has_stock(c10::DispatchKey key) const {
  auto& cached = key == c10::DispatchKey::MPS ? has_mps_ : has_cpu_;
  int8_t has = cached.load(std::memory_order_relaxed);
  if (has < 0) cached.store(has = has_stock_kernel(name, key), std::memory_order_relaxed);
  return has;
}

namespace {
std::mutex g_mutex;
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
  else no_stock().insert(k);
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
