// The Metal shader sources of kernels_metal/, flattened and embedded at build
// time by tools/embed_shaders.py (csrc/generated/shaders.cpp), with their
// kernel variants (tools/shader_variants.py).
#pragma once

#include <string>

namespace mps_ext {

// One [[host_name]] of a library: the explicit instantiation that defines it,
// and the bytes [site_begin, site_end) of the library's text that expand to
// it (with the other variants the same macro call instantiates).
struct ShaderVariant {
  const char* kernel;
  const char* statement;
  int site_begin, site_end;
};

struct ShaderSource {
  const char* name;  // file stem: "softmax" for kernels_metal/softmax.metal
  const char* text;
  const ShaderVariant* variants;
  int variant_count;
};
extern const ShaderSource kShaderSources[];
extern const int kShaderSourceCount;

// The flattened source of library `name`; throws if there is none.
const char* shader_source(const std::string& name);

// The source of library `name` that defines kernel `kernel` and no other:
// the library's text with every instantiation site blanked but the one of
// `kernel`, which holds that statement alone (newlines kept, so compiler
// messages keep their lines). Metal compiles a template only where it is
// instantiated, so this costs a fraction of the whole library's compile.
// Empty when the library has no variant table (a library registered at run
// time) or no such kernel: the caller compiles the whole library.
std::string variant_source(const std::string& name, const std::string& kernel);

}  // namespace mps_ext
