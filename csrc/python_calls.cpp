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
#include "python_calls.h"

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

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

}  // namespace

PyMethodDef* direct_op_calls() {
  static PyMethodDef calls[] = {
      DirectCall<AttentionForwardOp>::method(kDirectDoc),
      DirectCall<PagedKvAppendOp>::method(kDirectDoc),
      DirectCall<PagedAttentionOp>::method(kDirectDoc),
      {"_op_signatures", op_signatures, METH_NOARGS,
       "{op name: (argument types, return types)} of the C++ op functions that the direct "
       "calls, the typed handles and the autograd kernel derive from: tests compare it with "
       "the registered schemas."},
      {nullptr, nullptr, 0, nullptr},
  };
  return calls;
}

}  // namespace mha_ext
