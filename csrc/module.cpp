// The Python module mha_ext._C. Importing it loads this library, whose static
// TORCH_LIBRARY blocks register the ops; the module reports what was built and holds the
// direct entry points of the hot ops (python_calls.cpp).
#include <Python.h>

#include <exception>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu/isa.h"
#include "cpu/peak_probe.h"
#include "python_calls.h"

#if defined(MHA_EXT_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

#define MHA_EXT_STRINGIFY_(...) #__VA_ARGS__
#define MHA_EXT_STRINGIFY(...) MHA_EXT_STRINGIFY_(__VA_ARGS__)

namespace {

// Adds key -> value to dict, dropping the reference to value; false on a Python error.
bool set_item(PyObject* dict, const char* key, PyObject* value) {
  if (value == nullptr) return false;
  const int status = PyDict_SetItemString(dict, key, value);
  Py_DECREF(value);
  return status == 0;
}

#if defined(MHA_EXT_WITH_CUDA)
// "8.0,9.0" -> ["8.0", "9.0"]
PyObject* split_list(const std::string& items) {
  PyObject* list = PyList_New(0);
  size_t start = 0;
  while (list != nullptr && start < items.size()) {
    size_t end = items.find(',', start);
    if (end == std::string::npos) end = items.size();
    PyObject* item = PyUnicode_FromString(items.substr(start, end - start).c_str());
    if (item == nullptr || PyList_Append(list, item) != 0) Py_CLEAR(list);
    Py_XDECREF(item);
    start = end + 1;
  }
  return list;
}
#endif

PyObject* build_info(PyObject*, PyObject*) {
  const char* active_isa = nullptr;
  bool vbmi = false;
  try {
    active_isa = mha_ext::cpu::cpu_isa_name(mha_ext::cpu::active_cpu_isa());
    vbmi = mha_ext::cpu::avx512_vbmi_enabled();
  } catch (const std::exception& error) {
    PyErr_SetString(PyExc_RuntimeError, error.what());
    return nullptr;
  }
  PyObject* isas = PyList_New(0);
  for (mha_ext::cpu::CpuIsa isa : mha_ext::cpu::compiled_cpu_isas()) {
    PyObject* name = PyUnicode_FromString(mha_ext::cpu::cpu_isa_name(isa));
    if (isas == nullptr || name == nullptr || PyList_Append(isas, name) != 0) Py_CLEAR(isas);
    Py_XDECREF(name);
  }
  PyObject* info = PyDict_New();
  bool ok = info != nullptr &&
            set_item(info, "torch_version",
                     PyUnicode_FromString(MHA_EXT_STRINGIFY(MHA_EXT_TORCH_VERSION))) &&
            set_item(info, "cpu_isas", isas) &&
            set_item(info, "cpu_isa", PyUnicode_FromString(active_isa)) &&
            set_item(info, "cpu_vbmi", PyBool_FromLong(vbmi));
#if defined(MHA_EXT_WITH_CUDA)
  const std::string cuda_version =
      std::to_string(CUDART_VERSION / 1000) + "." + std::to_string(CUDART_VERSION % 1000 / 10);
  ok = ok && set_item(info, "cuda_version", PyUnicode_FromString(cuda_version.c_str())) &&
       set_item(info, "cuda_archs", split_list(MHA_EXT_STRINGIFY(MHA_EXT_CUDA_ARCHS)));
#else
  ok = ok && set_item(info, "cuda_version", Py_NewRef(Py_None)) &&
       set_item(info, "cuda_archs", PyList_New(0));
#endif
  if (!ok) Py_CLEAR(info);
  return info;
}

// Private to mha_ext.bench.roofline: the names of the peak probes this process may run.
PyObject* peak_probe_kinds(PyObject*, PyObject*) {
  std::vector<mha_ext::cpu::PeakProbeKind> kinds;
  try {
    kinds = mha_ext::cpu::available_peak_probes();
  } catch (const std::exception& error) {
    PyErr_SetString(PyExc_RuntimeError, error.what());
    return nullptr;
  }
  PyObject* names = PyList_New(0);
  for (mha_ext::cpu::PeakProbeKind kind : kinds) {
    PyObject* name = PyUnicode_FromString(mha_ext::cpu::peak_probe_name(kind));
    if (names == nullptr || name == nullptr || PyList_Append(names, name) != 0) Py_CLEAR(names);
    Py_XDECREF(name);
  }
  return names;
}

// Private to mha_ext.bench.roofline: _run_peak_probe(kind, iterations) -> {"threads",
// "iterations", "flops_per_iteration" (one thread's), "seconds" (the slowest thread's),
// "gflops" (all threads')}.
PyObject* run_peak_probe(PyObject*, PyObject* args) {
  const char* name = nullptr;
  long long iterations = 0;
  if (!PyArg_ParseTuple(args, "sL:_run_peak_probe", &name, &iterations)) return nullptr;
  mha_ext::cpu::PeakProbeKind kind;
  mha_ext::cpu::PeakProbeResult result;
  try {
    kind = mha_ext::cpu::peak_probe_kind(name);
    // The loop runs seconds on every thread: let other Python threads run meanwhile.
    std::exception_ptr failure;
    Py_BEGIN_ALLOW_THREADS;
    try {
      result = mha_ext::cpu::run_peak_probe(kind, iterations);
    } catch (...) {
      failure = std::current_exception();
    }
    Py_END_ALLOW_THREADS;
    if (failure) std::rethrow_exception(failure);
  } catch (const std::invalid_argument& error) {
    PyErr_SetString(PyExc_ValueError, error.what());
    return nullptr;
  } catch (const std::exception& error) {
    PyErr_SetString(PyExc_RuntimeError, error.what());
    return nullptr;
  }
  PyObject* info = PyDict_New();
  const bool ok =
      info != nullptr && set_item(info, "threads", PyLong_FromLongLong(result.threads)) &&
      set_item(info, "iterations", PyLong_FromLongLong(result.iterations)) &&
      set_item(info, "flops_per_iteration",
               PyFloat_FromDouble(mha_ext::cpu::peak_probe_flops_per_iteration(kind))) &&
      set_item(info, "seconds", PyFloat_FromDouble(result.slowest_seconds)) &&
      set_item(info, "gflops", PyFloat_FromDouble(result.gflops()));
  if (!ok) Py_CLEAR(info);
  return info;
}

PyMethodDef methods[] = {
    {"build_info", build_info, METH_NOARGS,
     "What this build of mha_ext compiled: torch version, CPU ISA variants (and the active "
     "one), CUDA version and architectures."},
    {"_peak_probe_kinds", peak_probe_kinds, METH_NOARGS,
     "Private (mha_ext.bench.roofline): the peak-arithmetic probes this CPU and "
     "MHA_EXT_CPU_ISA allow."},
    {"_run_peak_probe", run_peak_probe, METH_VARARGS,
     "Private (mha_ext.bench.roofline): _run_peak_probe(kind, iterations) runs a peak probe on "
     "every thread and returns its timing and GFLOP/s."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, methods};

}  // namespace

extern "C" PyMODINIT_FUNC PyInit__C(void) {
  PyObject* module = PyModule_Create(&module_def);
  if (module != nullptr && PyModule_AddFunctions(module, mha_ext::direct_op_calls()) != 0)
    Py_CLEAR(module);
  return module;
}
