// The op families: the one table a new family is added to
// (docs/dev/contributing.md, "Adding an op family").
//
// A family is what a user turns off (mps_ext.set_enabled("pad", False)), the
// key of its rules in mps_ext/_policy.py and of its counters in
// mps_ext.stats(). Its own file defines it once with MPS_EXT_FAMILY(name,
// Register) (dispatch/registration.h: its aten overrides and its own ops,
// with their kernels), and its ops route through it by FamilyId::name
// (dispatch/registry.h). A name missing here does not compile there; a name here that no file defines, or that two
// define, is an error when mps_ext._C loads; a name Python passes that is not here is an error when it is passed.
#pragma once

// Sorted by name: the order mps_ext.families() lists them in.
#define MPS_EXT_FAMILIES(X) \
  X(attention_gate)         \
  X(fp8)                    \
  X(grouped_mm)             \
  X(kv_cache)               \
  X(linalg)                 \
  X(linear)                 \
  X(linear_attention)       \
  X(moe)                    \
  X(norm)                   \
  X(pad)                    \
  X(scaled_mm)              \
  X(short_conv)             \
  X(softmax)
