// torch.ops.mps_ext.commit(x): commits the command buffer of the stream that
// x's device encodes on (backend/launch.h, commit), so that the GPU starts
// the work encoded so far while the host goes on encoding; mps_ext/stream.py
// installs it after chosen decoder layers (install_commits). A tensor picks
// the device (MPS: the current MPS stream; CPU: nothing to commit, since the
// CPU Metal executor runs each launch when it is encoded) and, under
// torch.compile, orders the commit after the work that produced x: the op is
// registered as an ordered effect (mps_ext/stream.py) and has a fake kernel
// (mps_ext/_meta.py). It is not a kernel family: there is nothing to turn off
// or fall back to (MPS_EXT_OPS: registered as a family's ops are, without the
// family).
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "backend/launch.h"
#include "dispatch/registration.h"

namespace mps_ext {
namespace {

void commit_impl(const at::Tensor& x) { commit(x.device()); }

template <c10::DispatchKey>
void register_stream(FamilyOps& ops) {
  ops.own("commit(Tensor x) -> ()", TORCH_FN(commit_impl));
}

}  // namespace
}  // namespace mps_ext

MPS_EXT_OPS(mps_ext::register_stream)
