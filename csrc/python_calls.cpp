// Direct Python entry points of the ops a decode loop calls every step: attention_forward,
// paged_kv_append and paged_attention. Each makes the same dispatcher call as
// torch.ops.mha_ext.<op>.default (autograd, backend selection, fake tensors and dispatch
// modes all still apply), without torch.ops' boxed path, which converts every argument to
// an IValue against the schema: about 3.5 us of a 13 us forward call at shape (1, 1, 1, 64).
// mha_ext/ops.py takes torch.ops instead while torch.compile traces and when an
// argument overrides __torch_function__, which only torch.ops honours.
//
// The entry points derive from the op functions' signatures (ops/op_signature.h): each reads
// its positional arguments by their C++ types and names them, in errors, as the schema does.
// One more, _sdpa_in_kernel_layout, is scaled_dot_product_attention's whole call for inputs
// that need none of its Python checks' adaptations.
#include "python_calls.h"

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>

#include "ops/attention.h"
#include "ops/merge.h"
#include "ops/op_signature.h"
#include "ops/paged.h"

namespace mha_ext {
namespace {

// "mha_ext::attention_forward" -> "mha_ext.attention_forward", as a Python user calls it.
std::string python_name(const char* op_name) {
  std::string name = op_name;
  return name.replace(name.find("::"), 2, ".");
}

// Positional arguments of one call of Op, read in order; the first bad one raises a TypeError
// naming the op and the argument. Trailing arguments the schema gives defaults may be left
// out, as torch.ops allows.
template <typename Op>
class Arguments {
 public:
  Arguments(PyObject* const* args, Py_ssize_t count, Py_ssize_t expected)
      : args_(args), count_(static_cast<size_t>(count)) {
    const auto& arguments = op_handle<Op>().schema().arguments();
    Py_ssize_t required = 0;
    while (required < expected && !arguments[required].default_value().has_value()) ++required;
    if (count < required || count > expected) {
      throw c10::TypeError({__func__, __FILE__, __LINE__},
                           c10::str(python_name(Op::name), " takes ", required,
                                    required < expected ? c10::str(" to ", expected) : "",
                                    " positional arguments, got ", count));
    }
  }

  template <typename T>
  T next() {
    if (next_ >= count_) {
      return op_handle<Op>().schema().arguments()[next_++].default_value()->template to<T>();
    }
    PyObject* arg = args_[next_++];
    if constexpr (std::is_same_v<T, at::Tensor>) {
      if (!THPVariable_Check(arg)) throw wrong_type("a Tensor", arg);
      return THPVariable_Unpack(arg);
    } else if constexpr (std::is_same_v<T, std::optional<at::Tensor>>) {
      if (arg == Py_None) return std::nullopt;
      if (!THPVariable_Check(arg)) throw wrong_type("a Tensor", arg);
      return THPVariable_Unpack(arg);
    } else if constexpr (std::is_same_v<T, double>) {
      if (!PyFloat_Check(arg) && !PyLong_Check(arg)) throw wrong_type("a float", arg);
      const double value = PyFloat_AsDouble(arg);
      if (value == -1.0 && PyErr_Occurred()) throw python_error();
      return value;
    } else if constexpr (std::is_same_v<T, int64_t> || std::is_same_v<T, c10::SymInt>) {
      if (!PyLong_Check(arg)) throw wrong_type("an int", arg);
      const long long value = PyLong_AsLongLong(arg);
      if (value == -1 && PyErr_Occurred()) throw python_error();
      return T(value);
    } else {
      static_assert(std::is_same_v<T, bool>, "an argument type the direct calls cannot read");
      if (!PyBool_Check(arg)) throw wrong_type("a bool", arg);
      return arg == Py_True;
    }
  }

 private:
  c10::TypeError wrong_type(const char* expected, PyObject* arg) const {
    const std::string& name = op_handle<Op>().schema().arguments()[next_ - 1].name();
    return c10::TypeError({__func__, __FILE__, __LINE__},
                          c10::str(python_name(Op::name), ": ", name, " must be ", expected,
                                   ", got ", Py_TYPE(arg)->tp_name));
  }

  PyObject* const* args_;
  size_t count_;
  size_t next_ = 0;
};

PyObject* wrap(std::tuple<at::Tensor, at::Tensor> pair) {
  PyObject* first = THPVariable_Wrap(std::move(std::get<0>(pair)));
  PyObject* second = first ? THPVariable_Wrap(std::move(std::get<1>(pair))) : nullptr;
  if (second == nullptr) {
    Py_XDECREF(first);
    return nullptr;
  }
  PyObject* tuple = PyTuple_Pack(2, first, second);
  Py_DECREF(first);
  Py_DECREF(second);
  return tuple;
}

template <typename Op, typename Signature = typename Op::Signature>
struct DirectCall;

template <typename Op, typename Result, typename... Args>
struct DirectCall<Op, Result(Args...)> {
  static PyObject* call(PyObject*, PyObject* const* args, Py_ssize_t count) {
    HANDLE_TH_ERRORS
    Arguments<Op> read(args, count, sizeof...(Args));
    // A braced list reads the arguments in order.
    std::tuple<std::decay_t<Args>...> values{read.template next<std::decay_t<Args>>()...};
    const auto& op = op_handle<Op>();
    const auto call_op = [&] {
      pybind11::gil_scoped_release no_gil;
      return std::apply([&](auto&... value) { return op.call(value...); }, values);
    };
    if constexpr (std::is_void_v<Result>) {
      call_op();
      Py_RETURN_NONE;
    } else {
      return wrap(call_op());
    }
    END_HANDLE_TH_ERRORS
  }

  static PyMethodDef method(const char* doc) {
    // The Python name: the op's name without "mha_ext::", kept alive by the op's static string.
    return {Op::name + sizeof("mha_ext::") - 1,
            reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&call)), METH_FASTCALL, doc};
  }
};

constexpr const char* kDirectDoc = "torch.ops.mha_ext.<op>.default without boxing the arguments.";

// {name: (argument types, return types)} of one op, as the schema spells them.
template <typename Op>
bool add_signature(PyObject* dict) {
  using Types = SignatureTypes<typename Op::Signature>;
  PyObject* arguments = PyList_New(0);
  PyObject* returns = PyList_New(0);
  bool ok = arguments != nullptr && returns != nullptr;
  for (auto [list, names] :
       {std::pair{arguments, op_argument_types<Op>()}, std::pair{returns, Types::returns()}}) {
    for (const std::string& name : names) {
      PyObject* item = ok ? PyUnicode_FromString(name.c_str()) : nullptr;
      ok = item != nullptr && PyList_Append(list, item) == 0;
      Py_XDECREF(item);
    }
  }
  PyObject* pair = ok ? PyTuple_Pack(2, arguments, returns) : nullptr;
  Py_XDECREF(arguments);
  Py_XDECREF(returns);
  ok = pair != nullptr && PyDict_SetItemString(dict, Op::name, pair) == 0;
  Py_XDECREF(pair);
  return ok;
}

PyObject* op_signatures(PyObject*, PyObject*) {
  PyObject* dict = PyDict_New();
  const bool ok = dict != nullptr && add_signature<AttentionForwardOp>(dict) &&
                  add_signature<AttentionBackwardOp>(dict) && add_signature<DropoutMaskOp>(dict) &&
                  add_signature<PagedKvAppendOp>(dict) && add_signature<PagedAttentionOp>(dict) &&
                  add_signature<MergeAttentionStatesOp>(dict);
  if (!ok) Py_CLEAR(dict);
  return dict;
}

const at::Tensor* tensor_or_null(PyObject* arg) {
  return THPVariable_Check(arg) ? &THPVariable_Unpack(arg) : nullptr;
}

// mha_ext.functional.scaled_dot_product_attention's way for its commonest calls, those of a
// decode loop, whose Python checks cost more than the kernel at (1, 1, 1, 64): arguments
// (query, key, value, is_causal, scale, enable_gqa), the call's own with no mask and no
// dropout. Returns the output where the inputs are already the kernels' query (B, H, L, E),
// key (B, Hkv, S, E), value (B, Hkv, S, Ev): dense, nonempty, one kernel dtype and device,
// contiguous rows, heads equal or grouped under enable_gqa, and scale None or a float; there
// every Python check would pass and adapt nothing. Returns None for all other inputs, which
// then take the Python path. The caller has checked calls_directly (mha_ext/ops.py).
PyObject* sdpa_in_kernel_layout(PyObject*, PyObject* const* args, Py_ssize_t count) {
  HANDLE_TH_ERRORS
  if (count != 6) {
    throw c10::TypeError({__func__, __FILE__, __LINE__},
                         c10::str("_sdpa_in_kernel_layout takes 6 positional arguments (query, "
                                  "key, value, is_causal, scale, enable_gqa), got ",
                                  count));
  }
  const at::Tensor* query = tensor_or_null(args[0]);
  const at::Tensor* key = tensor_or_null(args[1]);
  const at::Tensor* value = tensor_or_null(args[2]);
  PyObject* scale_arg = args[4];
  const bool plain_arguments = query != nullptr && key != nullptr && value != nullptr &&
                               PyBool_Check(args[3]) && PyBool_Check(args[5]) &&
                               (scale_arg == Py_None || PyFloat_CheckExact(scale_arg));
  if (!plain_arguments) Py_RETURN_NONE;
  for (const at::Tensor* tensor : {query, key, value}) {
    if (tensor->is_nested() || tensor->layout() != at::kStrided || tensor->dim() != 4 ||
        tensor->unsafeGetTensorImpl()->has_symbolic_sizes_strides() || tensor->stride(3) != 1) {
      Py_RETURN_NONE;
    }
  }
  const at::IntArrayRef q_sizes = query->sizes(), k_sizes = key->sizes(), v_sizes = value->sizes();
  const int64_t heads = q_sizes[1], kv_heads = k_sizes[1];
  const bool grouped = args[5] == Py_True;
  const bool heads_fit = grouped ? kv_heads > 0 && heads % kv_heads == 0 : kv_heads == heads;
  const bool kernel_layout =
      heads_fit && q_sizes[0] == k_sizes[0] && q_sizes[0] == v_sizes[0] && kv_heads == v_sizes[1] &&
      k_sizes[2] == v_sizes[2] && q_sizes[3] == k_sizes[3] &&
      std::min({q_sizes[0], heads, q_sizes[2], q_sizes[3], k_sizes[2], v_sizes[3]}) > 0 &&
      query->scalar_type() == key->scalar_type() && query->scalar_type() == value->scalar_type() &&
      kernel_dtype(query->scalar_type()).has_value() && query->device() == key->device() &&
      query->device() == value->device();
  if (!kernel_layout) Py_RETURN_NONE;

  // As Python computes the default, q.shape[-1] ** -0.5, to the bit.
  const double scale = scale_arg == Py_None ? std::pow(static_cast<double>(q_sizes[3]), -0.5)
                                            : PyFloat_AS_DOUBLE(scale_arg);
  const bool causal = args[3] == Py_True;
  const bool deterministic = at::globalContext().deterministicAlgorithms();
  at::Tensor out;
  {
    pybind11::gil_scoped_release no_gil;
    out = std::get<0>(op_handle<AttentionForwardOp>().call(
        *query, *key, *value, std::nullopt, std::nullopt, 0.0, scale, -1, causal ? 0 : -1, !causal,
        0.0, std::nullopt, std::nullopt, std::nullopt, std::nullopt, std::nullopt, 0, 0,
        deterministic));
  }
  return THPVariable_Wrap(std::move(out));
  END_HANDLE_TH_ERRORS
}

}  // namespace

PyMethodDef* direct_op_calls() {
  static PyMethodDef calls[] = {
      DirectCall<AttentionForwardOp>::method(kDirectDoc),
      DirectCall<PagedKvAppendOp>::method(kDirectDoc),
      DirectCall<PagedAttentionOp>::method(kDirectDoc),
      {"_sdpa_in_kernel_layout",
       reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&sdpa_in_kernel_layout)),
       METH_FASTCALL,
       "scaled_dot_product_attention(query, key, value, is_causal=..., scale=..., "
       "enable_gqa=...) with no mask or dropout, or None where the inputs need the Python "
       "path's checks and adaptations."},
      {"_op_signatures", op_signatures, METH_NOARGS,
       "{op name: (argument types, return types)} of the C++ op functions that the direct "
       "calls, the typed handles and the autograd kernel derive from: tests compare it with "
       "the registered schemas."},
      {nullptr, nullptr, 0, nullptr},
  };
  return calls;
}

}  // namespace mha_ext
