// The op families: the one table a new family is added to
// (docs/dev/contributing.md, "Adding an op family").
//
// A family is what a user turns off (mps_ext.set_enabled("pad", False)), the
// key of its rules in mps_ext/_policy.py and of its counters in
// mps_ext.stats(). Its own file defines it once with MPS_EXT_FAMILY(name,
// ...) (dispatch/registration.h: its aten ops and kernels), and its ops route
// through it by FamilyId::name (dispatch/registry.h). A name missing here does not
// compile there; a name here that no file defines, or that two define, is
// an error when mps_ext._C loads; a name Python passes that is not here is
// an error when it is passed.
#pragma once

// Sorted by name: the order mps_ext.families() lists them in.
#define MPS_EXT_FAMILIES(X) \
  X(fp8)                    \
  X(grouped_mm)             \
  X(linalg)                 \
  X(linear)                 \
  X(norm)                   \
  X(pad)                    \
  X(scaled_mm)              \
  X(softmax)
