// The executor's CPU backend (backend.cpp) and its test hooks, as the
// executor's Python bindings (bindings.cpp) reach them.
#pragma once

#include <cstdint>
#include <string>

#include "backend/launch.h"  // the product's launch interface (csrc/, same repository)

namespace mps_ext {

// Registers the executor as the product's CPU backend through `slot`
// (mps_ext._C._backend_slot()); refuses a slot of another layout.
void install(const BackendSlot* slot);
// The slot install() was given; an error before install().
const BackendSlot& slot();

PipelineInfo executor_pipeline(const std::string& library, const std::string& kernel);
void executor_encode(const Launch& launch);

// The GPU the executor stands for in the ops' launch geometry (default:
// kLargestMacProfile), so that CI runs the geometry of a small and of a
// large GPU. Cores must be at least 1.
void set_executor_profile(const DeviceProfile& profile);
DeviceProfile executor_profile();

// request() of mps_ext_executor, for this thread (nests as a count): where a
// Metal backend is present (a Mac, or simulated) the executor takes CPU
// calls only inside it; elsewhere always.
void set_executor_requested(bool requested);
bool executor_requested();
bool metal_backend_present();
void set_metal_backend_present(int present);  // tests: 1 yes, 0 no, -1 as built

// Test hook: the executor fails the way the Metal backend can on a Mac.
enum class SimulatedFailure { kNone, kLibrary, kPipeline, kMaxThreads };
void simulate_executor_failure(const std::string& library, const std::string& kernel, SimulatedFailure kind,
                               uint64_t max_threads);
// How often a simulated failure was hit since it was set.
uint64_t simulated_failure_hits();

// The executor's libraries are compiled once per process; a test that
// changes how they are compiled (mps_ext_executor.math_mode) drops them, so
// that the next launch compiles each again in the new mode.
void forget_executor_libraries();

}  // namespace mps_ext
