// Registration of op families with torch's dispatcher: the one path for
// both kinds of op a family has.
//
// Each family registers itself from its own file with MPS_EXT_FAMILY: its
// name (an entry of dispatch/families.h: any other does not compile) and a
// function template `template <c10::DispatchKey K> void Register(FamilyOps&
// ops)` that names each of its ops once, with its kernel for key K:
//   ops.aten("mm", TORCH_FN(mm_impl<K>)): an aten op the family overrides;
//   ops.own("kv_append(Tensor(a!) k_cache, ...) -> ()", TORCH_FN(...)): an
//     op of mps_ext's own, by its schema.
// MPS_EXT_FAMILY runs that function once per registration pass (FamilyOps::
// Pass), which gives, on every platform, torch.ops.mps_ext.<op> for both
// kinds (an aten op with the aten op's own schema, read from the installed
// torch, so it matches every release) with kernels for CPU tensors (the CPU
// Metal executor) and, on macOS, MPS tensors; and, on a Mac,
// install_overrides() puts the aten ops' kernels on the MPS key of the aten
// ops themselves, after capturing the kernel each replaces. Which families to
// install is decided in Python (mps_ext/_policy.py). Every torch.ops.mps_ext
// op that shares an aten op's name also gets a Meta kernel, the aten op's own
// or the family's (mps_ext/_meta.py, which also has the own ops' ones), so
// FakeTensor and torch.compile can trace it.
#pragma once

#include <c10/core/DispatchKey.h>
#include <torch/library.h>

#include <functional>
#include <string>
#include <vector>

#include "dispatch/registry.h"

namespace mps_ext {

// What a family's Register function is handed: each call names one op and
// its kernel; what is done with it depends on the pass.
class FamilyOps {
 public:
  enum class Pass {
    list,       // records the ops' names (the family's definition)
    define,     // defines them in the mps_ext namespace (TORCH_LIBRARY_FRAGMENT)
    aten_meta,  // registers the aten ops' Meta kernels for their mps_ext twins
    kernels,    // registers every kernel in the mps_ext namespace (CPU, MPS)
    overrides,  // registers the aten ops' kernels on aten itself (install_overrides)
  };
  FamilyOps(Pass pass, torch::Library* lib) : pass_(pass), lib_(lib) {}

  // An aten op the family overrides ("mm", "fill_.Scalar"), with its kernel.
  template <class Kernel>
  FamilyOps& aten(const char* op, Kernel&& kernel) {
    if (pass_ == Pass::kernels || pass_ == Pass::overrides) lib_->impl(op, std::forward<Kernel>(kernel));
    else aten_op(std::string("aten::") + op);
    return *this;
  }
  // An op of mps_ext's own, by its schema ("kv_append(Tensor(a!) k_cache,
  // ...) -> ()"), with its kernel. Not on aten, so not in the overrides.
  template <class Kernel>
  FamilyOps& own(const char* schema, Kernel&& kernel) {
    if (pass_ == Pass::kernels) lib_->impl(own_name(schema).c_str(), std::forward<Kernel>(kernel));
    else own_op(schema);
    return *this;
  }

  // What the list pass recorded: "aten::mm", ...; "mps_ext::kv_append", ...
  std::vector<std::string> aten_ops, own_ops;

 private:
  void aten_op(const std::string& op);                     // the list, define and aten_meta passes
  void own_op(const std::string& schema);                  // the list and define passes
  static std::string own_name(const std::string& schema);  // "kv_append"
  Pass pass_;
  torch::Library* lib_;
};

// Called at static initialisation by MPS_EXT_FAMILY: the family's
// definition (what its Register function lists), into its entry of the one
// family table (dispatch/registry.h).
struct FamilyRegistrar {
  FamilyRegistrar(FamilyId id, RegisterKernels register_mps, RegisterKernels register_cpu);
};

// The aten ops a family overrides, and its own ops ("mps_ext::kv_append").
std::vector<std::string> family_aten_ops(const std::string& family);
std::vector<std::string> family_own_ops(const std::string& family);
// Override those aten ops on `key` (MPS, on macOS; CPU only in tests, in a
// process of their own); returns the families done. Torch's "Overriding a
// previously registered kernel" warning is not printed (it is expected);
// any other warning is.
std::vector<std::string> install_overrides(const std::vector<std::string>& families,
                                           c10::DispatchKey key = c10::DispatchKey::MPS);
// Defines `ops` ("aten::x") in `m` (the mps_ext namespace) with aten's
// schemas as the installed torch has them (or, for an op it lacks, the
// schema of the newest release that has it: registration.cpp).
void define_like_aten(torch::Library& m, const std::vector<std::string>& ops);
// Registers in `m` (mps_ext, Meta key) each op's Meta kernel: the aten op's.
void register_meta(torch::Library& m, const std::vector<std::string>& ops);
// Runs `f` with torch's override warning filtered out (as install_overrides
// does); exposed for its test.
void without_override_warning(const std::function<void()>& f);

}  // namespace mps_ext

// MPS_EXT_FAMILY(name, Register): `name` is the family's entry in
// dispatch/families.h, unquoted (softmax); `Register` its function template
// (above). The kernels of its aten ops fall back to the stock kernel of key K
// (through route(), dispatch/registry.h); those of its own ops have no stock
// kernel (run_own). The Meta kernels of its aten ops are the aten ops'.
// MPS_EXT_FAMILY_OWN_META: the same, for a family whose aten ops' Meta
// kernels are mps_ext's own (mps_ext/_meta.py), where the aten op's meta
// function rejects inputs mps_ext takes.
#define MPS_EXT_FAMILY(NAME, REGISTER)                                   \
  TORCH_LIBRARY_IMPL(mps_ext, Meta, m) {                                 \
    ::mps_ext::FamilyOps ops(::mps_ext::FamilyOps::Pass::aten_meta, &m); \
    REGISTER<c10::DispatchKey::CPU>(ops);                                \
  }                                                                      \
  MPS_EXT_FAMILY_OWN_META(NAME, REGISTER)

#define MPS_EXT_FAMILY_OWN_META(NAME, REGISTER)                                          \
  MPS_EXT_OPS(REGISTER)                                                                  \
  static const ::mps_ext::FamilyRegistrar C10_CONCATENATE(mps_ext_family_, __COUNTER__)( \
      ::mps_ext::FamilyId::NAME, &REGISTER<c10::DispatchKey::MPS>, &REGISTER<c10::DispatchKey::CPU>);

// MPS_EXT_OPS(Register): the ops of a Register function (own ops only) that
// belong to no family: nothing to turn off, count or fall back to
// (mps_ext::commit, ops/stream.cpp). The same passes, without the family.
#define MPS_EXT_OPS(REGISTER)                                          \
  TORCH_LIBRARY_FRAGMENT(mps_ext, m) {                                 \
    ::mps_ext::FamilyOps ops(::mps_ext::FamilyOps::Pass::define, &m);  \
    REGISTER<c10::DispatchKey::CPU>(ops);                              \
  }                                                                    \
  TORCH_LIBRARY_IMPL(mps_ext, CPU, m) {                                \
    ::mps_ext::FamilyOps ops(::mps_ext::FamilyOps::Pass::kernels, &m); \
    REGISTER<c10::DispatchKey::CPU>(ops);                              \
  }                                                                    \
  MPS_EXT_OPS_MPS_IMPL(REGISTER)

#ifdef __APPLE__
#define MPS_EXT_OPS_MPS_IMPL(REGISTER)                                 \
  TORCH_LIBRARY_IMPL(mps_ext, MPS, m) {                                \
    ::mps_ext::FamilyOps ops(::mps_ext::FamilyOps::Pass::kernels, &m); \
    REGISTER<c10::DispatchKey::MPS>(ops);                              \
  }
#else
#define MPS_EXT_OPS_MPS_IMPL(REGISTER)
#endif
