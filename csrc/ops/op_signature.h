#pragma once
// What derives from an op function's C++ signature (ops/<family>.h), so that an argument is
// spelled only in the schema and the op file: typed dispatcher handles for C++ callers, and
// the type names the schema test compares against torch.ops.mha_ext.<op>.default._schema.
//
// Each op file describes its ops for this header after defining them:
//   MHA_EXT_DESCRIBE_OP(AttentionForwardOp, attention_forward);
#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

namespace mha_ext {

// Names a backend where only an op function's type is needed: decltype does not instantiate
// the function's body.
struct AnyBackend;

// Description, the op `function` (a template over the backend, whose schema is
// "mha_ext::<function>(...)"): its name and its C++ signature.
#define MHA_EXT_DESCRIBE_OP(Description, function)             \
  struct Description {                                         \
    static constexpr const char* name = "mha_ext::" #function; \
    using Signature = decltype(function<AnyBackend>);          \
  }

// The typed dispatcher handle of Op, looked up on first use. typed() checks the signature
// against the kernels registered for the op's schema.
template <typename Op>
const c10::TypedOperatorHandle<typename Op::Signature>& op_handle() {
  static const auto handle = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow(Op::name, "")
                                 .template typed<typename Op::Signature>();
  return handle;
}

// The schema's spelling of a C++ argument or return type: "Tensor", "Tensor?", "float",
// "int", "SymInt", "bool"; a mutable tensor reference is "Tensor(a!)" in a schema, "Tensor!" here.
template <typename T>
std::string schema_type_name() {
  using Value = std::remove_cv_t<std::remove_reference_t<T>>;
  if constexpr (std::is_same_v<Value, at::Tensor>) {
    const bool mutable_ref =
        std::is_lvalue_reference_v<T> && !std::is_const_v<std::remove_reference_t<T>>;
    return mutable_ref ? "Tensor!" : "Tensor";
  } else if constexpr (std::is_same_v<Value, std::optional<at::Tensor>>) {
    return "Tensor?";
  } else if constexpr (std::is_same_v<Value, double>) {
    return "float";
  } else if constexpr (std::is_same_v<Value, int64_t>) {
    return "int";
  } else if constexpr (std::is_same_v<Value, c10::SymInt>) {
    return "SymInt";
  } else if constexpr (std::is_same_v<Value, bool>) {
    return "bool";
  } else {
    static_assert(!std::is_same_v<Value, Value>, "an op argument type without a schema name");
  }
}

template <typename Result>
std::vector<std::string> schema_return_names() {
  if constexpr (std::is_void_v<Result>) {
    return {};
  } else if constexpr (std::is_same_v<Result, at::Tensor>) {
    return {"Tensor"};
  } else {
    return std::apply(
        [](auto... parts) {
          return std::vector<std::string>{schema_type_name<decltype(parts)>()...};
        },
        Result{});
  }
}

// Positions of the optional tensors an op writes ("Tensor(a!)?" in its schema). C++ passes an
// optional tensor as const std::optional<at::Tensor>& whether or not the op writes it, so the
// signature cannot say; an op that writes some specializes this next to its description.
template <typename Op>
struct WrittenOptionalTensors {
  static constexpr int positions[] = {-1};
};

template <typename Signature>
struct SignatureTypes;

// The argument and return type names of a signature, in order.
template <typename Result, typename... Args>
struct SignatureTypes<Result(Args...)> {
  static std::vector<std::string> arguments() { return {schema_type_name<Args>()...}; }
  static std::vector<std::string> returns() { return schema_return_names<Result>(); }
};

// The schema type names of Op's arguments: its signature's, "Tensor?!" for a written optional.
template <typename Op>
std::vector<std::string> op_argument_types() {
  std::vector<std::string> types = SignatureTypes<typename Op::Signature>::arguments();
  for (const int position : WrittenOptionalTensors<Op>::positions) {
    if (position >= 0) types.at(position) += "!";
  }
  return types;
}

}  // namespace mha_ext
