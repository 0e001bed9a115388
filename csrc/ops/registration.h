#pragma once
#include <string>
#include <vector>

namespace mps_ext {
// Names of the op families ("pad", "softmax", ...).
std::vector<std::string> families();
// The aten ops a family overrides.
std::vector<std::string> family_aten_ops(const std::string& family);
// Override those aten ops on the MPS key (macOS); returns the families done.
std::vector<std::string> install_overrides(const std::vector<std::string>& families);
}  // namespace mps_ext
