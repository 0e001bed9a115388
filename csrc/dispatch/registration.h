// Registration of op families with torch's dispatcher.
//
// Each family registers itself from its own file with MPS_EXT_FAMILY: its
// name (an entry of dispatch/families.h: any other does not compile), the aten
// ops it implements and a function template that registers its kernels for
// a dispatch key. That gives, on every platform,
// torch.ops.mps_ext.<aten name> with the aten op's own schema (read from the
// installed torch, so it matches every release) for CPU tensors (the CPU
// Metal executor) and, on macOS, MPS tensors; and, on a Mac,
// install_overrides() puts the same kernels on the MPS key of the aten ops
// themselves, after capturing the kernel each replaces. Which families to
// install is decided in Python (mps_ext/_policy.py). Every torch.ops.mps_ext
// op also gets a Meta kernel, the aten op's own or the family's (so
// FakeTensor and torch.compile can trace it).
#pragma once

#include <c10/core/DispatchKey.h>
#include <torch/library.h>

#include <functional>
#include <string>
#include <vector>

#include "dispatch/registry.h"

namespace mps_ext {

// Called at static initialisation by MPS_EXT_FAMILY: the family's
// definition, into its entry of the one family table (dispatch/registry.h).
struct FamilyRegistrar {
  FamilyRegistrar(FamilyId id, std::vector<std::string> aten_ops, RegisterKernels register_mps,
                  RegisterKernels register_cpu);
};

// The aten ops a family implements.
std::vector<std::string> family_aten_ops(const std::string& family);
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

// MPS_EXT_FAMILY(name, Register, "aten::op", ...): `name` is the family's
// entry in dispatch/families.h, unquoted (softmax); `Register` is a function
// template `template <c10::DispatchKey K> void Register(torch::Library& m)`
// that calls m.impl for each op with kernels that fall back to the stock
// kernel of key K (through route(), dispatch/registry.h). The Meta kernels are
// the aten ops'. MPS_EXT_FAMILY_OWN_META: the same, for a family whose Meta
// kernels are mps_ext's own (mps_ext/_meta.py), where the aten op's meta
// function rejects inputs mps_ext takes.
#define MPS_EXT_FAMILY(NAME, REGISTER, ...)                                              \
  TORCH_LIBRARY_IMPL(mps_ext, Meta, m) { ::mps_ext::register_meta(m, {__VA_ARGS__}); } \
  MPS_EXT_FAMILY_OWN_META(NAME, REGISTER, __VA_ARGS__)

#define MPS_EXT_FAMILY_OWN_META(NAME, REGISTER, ...)                                      \
  TORCH_LIBRARY_FRAGMENT(mps_ext, m) { ::mps_ext::define_like_aten(m, {__VA_ARGS__}); } \
  TORCH_LIBRARY_IMPL(mps_ext, CPU, m) { REGISTER<c10::DispatchKey::CPU>(m); }            \
  MPS_EXT_FAMILY_MPS_IMPL(REGISTER)                                                      \
  static const ::mps_ext::FamilyRegistrar C10_CONCATENATE(mps_ext_family_, __COUNTER__)( \
      ::mps_ext::FamilyId::NAME, {__VA_ARGS__}, &REGISTER<c10::DispatchKey::MPS>,        \
      &REGISTER<c10::DispatchKey::CPU>);

#ifdef __APPLE__
#define MPS_EXT_FAMILY_MPS_IMPL(REGISTER) \
  TORCH_LIBRARY_IMPL(mps_ext, MPS, m) { REGISTER<c10::DispatchKey::MPS>(m); }
#else
#define MPS_EXT_FAMILY_MPS_IMPL(REGISTER)
#endif
