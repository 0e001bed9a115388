// The Metal shader sources of kernels_metal/, flattened and embedded at build
// time by tools/embed_shaders.py (csrc/generated/shaders.cpp).
#pragma once

#include <string>

namespace mps_ext {

struct ShaderSource {
  const char* name;  // file stem: "softmax" for kernels_metal/softmax.metal
  const char* text;
};
extern const ShaderSource kShaderSources[];
extern const int kShaderSourceCount;

// The flattened source of library `name`; throws if there is none.
const char* shader_source(const std::string& name);

}  // namespace mps_ext
