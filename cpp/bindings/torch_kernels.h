// The torch.ops.simdnorm forward ops' C++ kernels in torch's dispatcher (torch_kernels.cpp): the
// functions of _core that attach them, register them and hand them the Python layer's plans.
#pragma once

#include <pybind11/pybind11.h>

namespace simdnorm {

void add_torch_kernel_functions(pybind11::module_& m);

}  // namespace simdnorm
