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

// Schemas of aten ops that the oldest supported torch (2.9) lacks, from the
// newest release that has them, so that torch.ops.mps_ext has them anyway.
static const std::map<std::string, std::string> kNewerSchemas = {
    {"aten::_scaled_mm_v2",  // torch 2.10-2.15
     "aten::_scaled_mm_v2(Tensor self, Tensor mat2, Tensor[] scale_a, int[] recipe_a, int[] swizzle_a, "
     "Tensor[] scale_b, int[] recipe_b, int[] swizzle_b, Tensor? bias, ScalarType? out_dtype, "
     "int[] contraction_dim=[], bool use_fast_accum=False) -> Tensor"},
};

bool aten_has(const std::string& op) {
  auto dot = op.find('.');
  std::string name = op.substr(0, dot), overload = dot == std::string::npos ? "" : op.substr(dot + 1);
  return c10::Dispatcher::singleton().findSchema({name, overload}).has_value();
}

void define_like_aten(torch::Library& m, const std::vector<std::string>& ops) {
  for (const auto& op : ops) {
    auto newer = kNewerSchemas.find(op);
    std::string schema = !aten_has(op) && newer != kNewerSchemas.end() ? newer->second
                                                                        : c10::toString(op_handle(op).schema());
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
      // An op this torch lacks gets mps_ext's kernel and nothing to fall back to.
      for (const auto& op : def.aten_ops)
        if (aten_has(op)) capture_stock_kernel(op, c10::DispatchKey::MPS);
      def.register_mps(*lib);
      installed.insert(name);
    }
    done.push_back(name);
  }
  return done;
}

}  // namespace mps_ext
