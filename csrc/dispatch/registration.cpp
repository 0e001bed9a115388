// MPS_EXT_FAMILY's entry into the family table (dispatch/registry.h),
// installation of the MPS overrides and the Meta kernels of torch.ops.mps_ext
// (see registration.h).
#include "dispatch/registration.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <set>

#include "dispatch/registry.h"

namespace mps_ext {
namespace {

// Torch warns (once per process) when a kernel replaces another for the same
// op and key, which is what an override does on purpose. This handler drops
// that one warning and hands every other to the handler it replaced.
class OverrideWarningFilter : public c10::WarningHandler {
 public:
  explicit OverrideWarningFilter(c10::WarningHandler* next) : next_(next) {}
  void process(const c10::Warning& warning) override {
    if (warning.msg().find(
            "Overriding a previously registered kernel for the same operator and the same dispatch key") !=
        std::string::npos)
      return;
    next_->process(warning);
  }

 private:
  c10::WarningHandler* next_;
};

// Meta kernel of every torch.ops.mps_ext op: the same-named aten op's Meta
// kernel (its structured meta function, or its composite implementation),
// called with the same stack: the schemas are the same.
void aten_meta_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  const c10::OperatorName& name = op.schema().operator_name();
  std::string aten = "aten::" + name.name.substr(name.name.find("::") + 2);
  if (!name.overload_name.empty()) aten += "." + name.overload_name;
  stock_kernel(aten, c10::DispatchKey::Meta)
      .callBoxed(op_handle(aten), c10::DispatchKeySet(c10::DispatchKey::Meta), stack);
}

}  // namespace

FamilyRegistrar::FamilyRegistrar(FamilyId id, RegisterKernels register_mps, RegisterKernels register_cpu) {
  FamilyOps listed(FamilyOps::Pass::list, nullptr);
  register_cpu(listed);
  family(id).define(Family::Def{listed.aten_ops, listed.own_ops, register_mps, register_cpu});
}

void FamilyOps::aten_op(const std::string& op) {
  switch (pass_) {
    case Pass::list: aten_ops.push_back(op); break;
    case Pass::define: define_like_aten(*lib_, {op}); break;
    case Pass::aten_meta: register_meta(*lib_, {op}); break;
    default: break;  // the kernels' passes register them in aten()
  }
}

void FamilyOps::own_op(const std::string& schema) {
  if (pass_ == Pass::list) own_ops.push_back("mps_ext::" + own_name(schema));
  if (pass_ == Pass::define) lib_->def(schema.c_str());
}

std::string FamilyOps::own_name(const std::string& schema) {
  const size_t paren = schema.find('(');
  TORCH_CHECK(paren != std::string::npos && paren > 0 && schema.find("::") == std::string::npos,
              "mps_ext: an own op is given by its schema without namespace (\"name(Tensor x) -> Tensor\"), not ",
              schema);
  return schema.substr(0, paren);
}

std::vector<std::string> family_aten_ops(const std::string& fam) { return family(fam).def().aten_ops; }
std::vector<std::string> family_own_ops(const std::string& fam) { return family(fam).def().own_ops; }

// Schemas of aten ops that the oldest supported torch (2.9) lacks, from the
// newest release that has them, so that torch.ops.mps_ext has them anyway.
static const std::map<std::string, std::string> kNewerSchemas = {
    {"aten::_scaled_mm_v2",  // torch 2.10-2.15
     "aten::_scaled_mm_v2(Tensor self, Tensor mat2, Tensor[] scale_a, int[] recipe_a, int[] swizzle_a, "
     "Tensor[] scale_b, int[] recipe_b, int[] swizzle_b, Tensor? bias, ScalarType? out_dtype, "
     "int[] contraction_dim=[], bool use_fast_accum=False) -> Tensor"},
    {"aten::_scaled_grouped_mm_v2",  // torch 2.10-2.15
     "aten::_scaled_grouped_mm_v2(Tensor self, Tensor mat2, Tensor[] scale_a, int[] recipe_a, int[] swizzle_a, "
     "Tensor[] scale_b, int[] recipe_b, int[] swizzle_b, Tensor? offs=None, Tensor? bias=None, "
     "ScalarType? out_dtype=None, int[] contraction_dim=[], bool use_fast_accum=False) -> Tensor"},
};

void define_like_aten(torch::Library& m, const std::vector<std::string>& ops) {
  for (const auto& op : ops) {
    auto newer = kNewerSchemas.find(op);
    std::string schema =
        !find_op(op) && newer != kNewerSchemas.end() ? newer->second : c10::toString(op_handle(op).schema());
    TORCH_CHECK(schema.rfind("aten::", 0) == 0, "mps_ext: unexpected schema ", schema);
    m.def(torch::schema(schema.substr(6).c_str()));
  }
}

void register_meta(torch::Library& m, const std::vector<std::string>& ops) {
  for (const auto& op : ops)
    m.impl(op.substr(6).c_str(), torch::CppFunction::makeFromBoxedFunction<&aten_meta_kernel>());
}

void without_override_warning(const std::function<void()>& f) {
  OverrideWarningFilter filter(c10::WarningUtils::get_warning_handler());
  c10::WarningUtils::WarningHandlerGuard guard(&filter);
  f();
}

// Override the aten ops of these families on `key`. Each op's current
// kernel is captured first: it is where unsupported inputs go.
std::vector<std::string> install_overrides(const std::vector<std::string>& fams, c10::DispatchKey key) {
  TORCH_CHECK(key == c10::DispatchKey::MPS || key == c10::DispatchKey::CPU,
              "mps_ext: overrides go on the MPS key (or CPU, in tests), not ", key);
  static std::mutex install_mutex;
  static std::map<c10::DispatchKey, std::unique_ptr<torch::Library>> libs;
  static std::set<std::pair<std::string, c10::DispatchKey>> installed;
  std::lock_guard<std::mutex> lock(install_mutex);
  auto& lib = libs[key];
  if (!lib) lib = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", key, __FILE__, __LINE__);
  std::vector<std::string> done;
  for (const auto& name : fams) {
    const Family::Def& def = family(name).def();
    if (!installed.count({name, key})) {
      for (const auto& op : def.aten_ops) capture_stock_kernel(op, key);
      FamilyOps ops(FamilyOps::Pass::overrides, lib.get());
      without_override_warning([&] { (key == c10::DispatchKey::MPS ? def.register_mps : def.register_cpu)(ops); });
      installed.insert({name, key});
    }
    done.push_back(name);
  }
  return done;
}

}  // namespace mps_ext
