// The family table behind MPS_EXT_FAMILY, and installation of the MPS
// overrides (see registration.h).
#include "ops/registration.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <set>

#include "ops/registry.h"

namespace mps_ext {
namespace {

std::mutex g_mutex;
std::map<std::string, FamilyDef>& table() {
  static auto* t = new std::map<std::string, FamilyDef>();
  return *t;
}

const FamilyDef& find(const std::string& name) {
  std::lock_guard<std::mutex> g(g_mutex);
  auto it = table().find(name);
  TORCH_CHECK(it != table().end(), "mps_ext: no op family named '", name, "'");
  return it->second;
}

}  // namespace

FamilyRegistrar::FamilyRegistrar(FamilyDef def) {
  std::lock_guard<std::mutex> g(g_mutex);
  std::string name = def.name;
  table().emplace(name, std::move(def));
}

std::vector<std::string> families() {
  std::vector<std::string> names;
  {
    std::lock_guard<std::mutex> g(g_mutex);
    for (const auto& kv : table()) names.push_back(kv.first);
  }
  for (const auto& n : names) family(n);  // create its switch and counters
  return names;
}

std::vector<std::string> family_aten_ops(const std::string& fam) { return find(fam).aten_ops; }

void define_like_aten(torch::Library& m, const std::vector<std::string>& ops) {
  for (const auto& op : ops) {
    std::string schema = c10::toString(op_handle(op).schema());
    TORCH_CHECK(schema.rfind("aten::", 0) == 0, "mps_ext: unexpected schema ", schema);
    m.def(torch::schema(schema.substr(6).c_str()));
  }
}

// Override the aten ops of these families on the MPS key. Each op's current
// MPS kernel is captured first: it is where unsupported inputs go.
std::vector<std::string> install_overrides(const std::vector<std::string>& fams) {
  static std::unique_ptr<torch::Library> lib;
  static std::set<std::string> installed;
  if (!lib) lib = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", c10::DispatchKey::MPS, __FILE__, __LINE__);
  std::vector<std::string> done;
  for (const auto& name : fams) {
    const FamilyDef& def = find(name);
    if (!installed.count(name)) {
      for (const auto& op : def.aten_ops) capture_stock_kernel(op, c10::DispatchKey::MPS);
      def.register_mps(*lib);
      installed.insert(name);
    }
    done.push_back(name);
  }
  return done;
}

}  // namespace mps_ext
