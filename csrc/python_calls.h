// Direct Python entry points of the hot ops, added to the module mha_ext._C (module.cpp).
#pragma once

#include <Python.h>

namespace mha_ext {

// Null-terminated, for PyModule_AddFunctions.
PyMethodDef* direct_op_calls();

}  // namespace mha_ext
