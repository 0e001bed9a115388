// torch.ops.mps_ext.commit(x): commits the command buffer of the stream that
// x's device encodes on (backend/launch.h, commit), so that the GPU starts
// the work encoded so far while the host goes on encoding; mps_ext/stream.py
// installs it after chosen decoder layers (install_commits). A tensor picks
// the device (MPS: the current MPS stream; CPU: nothing to commit, since the
// CPU Metal executor runs each launch when it is encoded) and, under
// torch.compile, orders the commit after the work that produced x: the op is
// registered as an ordered effect (mps_ext/stream.py) and has a fake kernel
// (mps_ext/_meta.py). It is not a kernel family: there is nothing to turn off
// or fall back to.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "backend/launch.h"

namespace mps_ext {
namespace {

void commit_impl(const at::Tensor& x) { commit(x.device()); }

}  // namespace
}  // namespace mps_ext

TORCH_LIBRARY_FRAGMENT(mps_ext, m) { m.def("commit(Tensor x) -> ()"); }

TORCH_LIBRARY_IMPL(mps_ext, CPU, m) { m.impl("commit", TORCH_FN(mps_ext::commit_impl)); }

#ifdef __APPLE__
TORCH_LIBRARY_IMPL(mps_ext, MPS, m) { m.impl("commit", TORCH_FN(mps_ext::commit_impl)); }
#endif
