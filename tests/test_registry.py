"""Op registration: opcheck for every op, and the ops inside torch.compile(fullgraph=True)."""

import pytest
import torch

import mha_ext
from mha_ext import ops

from conftest import random_qkv


def attention_cases():
    q, k, v = random_qkv(2, 4, 2, 9, 13, 16, head_dim_v=8)
    grad = [t.clone().requires_grad_() for t in (q, k, v)]
    mask = torch.randn(2, 1, 9, 13)
    seed = torch.tensor([42], dtype=torch.int64)
    return [
        (q, k, v, None, None, 0.0, 0.25, -1, -1, False),
        (*grad, None, None, 0.0, 0.25, -1, 0, True),
        (*grad, mask, seed, 0.3, 0.5, 4, 0, False),
        (
            q.transpose(1, 2).contiguous().transpose(1, 2),
            k,
            v,
            mask > 0,
            None,
            0.0,
            0.25,
            3,
            2,
            True,
        ),
    ]


@pytest.mark.parametrize("case", range(4))
def test_opcheck_attention_forward(case):
    torch.library.opcheck(torch.ops.mha_ext.attention_forward.default, attention_cases()[case])


def test_opcheck_attention_backward():
    q, k, v = random_qkv(2, 4, 2, 9, 13, 16)
    seed = torch.tensor([7], dtype=torch.int64)
    options = (torch.randn(2, 1, 9, 13), seed, 0.2, 0.25, -1, 0, True)
    out, lse = ops.attention_forward(q, k, v, *options)
    args = (torch.randn_like(out), torch.randn_like(lse), q, k, v, out, lse, *options)
    torch.library.opcheck(torch.ops.mha_ext.attention_backward.default, args)


def test_opcheck_dropout_mask():
    seed = torch.tensor([3], dtype=torch.int64)
    torch.library.opcheck(torch.ops.mha_ext.dropout_mask.default, (seed, 2, 3, 5, 7, 0.25))


def test_compile_fullgraph_forward_and_backward():
    layer = mha_ext.MultiHeadAttention(64, 8, dropout=0.0, num_kv_heads=2)
    x = torch.randn(2, 33, 64)

    def step(x):
        out = layer(x, x, x, is_causal=True)
        return out, mha_ext.attention(
            *(x.unflatten(-1, (8, 8)).transpose(1, 2),) * 3, window=(4, 4)
        )

    compiled = torch.compile(step, fullgraph=True)
    eager_out, eager_windowed = step(x)
    compiled_out, compiled_windowed = compiled(x)
    torch.testing.assert_close(compiled_out, eager_out)
    torch.testing.assert_close(compiled_windowed, eager_windowed)
    compiled_out.sum().backward()
    grad = layer.w_q.weight.grad.clone()
    layer.zero_grad()
    eager_out.sum().backward()
    torch.testing.assert_close(grad, layer.w_q.weight.grad)


def test_compile_fullgraph_with_dropout_is_reproducible():
    q, k, v = random_qkv(1, 4, 4, 20, 20, 16)
    compiled = torch.compile(
        lambda q, k, v: mha_ext.attention(q, k, v, dropout_p=0.3), fullgraph=True
    )
    torch.manual_seed(9)
    first = compiled(q, k, v)
    torch.manual_seed(9)
    second = compiled(q, k, v)
    assert torch.equal(first, second)
    assert not torch.equal(first, compiled(q, k, v))


# ---------------------------------------------------------------- direct entry points
# ops.py calls attention_forward, paged_kv_append and paged_attention through _C's direct
# entry points (csrc/python_calls.cpp) except under torch.compile and __torch_function__.


def paged_case():
    key_cache, value_cache = torch.zeros(2, 6, 2, 8, 32).unbind(0)  # [blocks, kv heads, block, dim]
    keys, values = torch.randn(2, 20, 2, 32).unbind(0)
    slots = torch.arange(20) + 12  # from the middle of block 1
    tables = torch.tensor([[1, 2, 3, 4]], dtype=torch.int32)
    q = torch.randn(3, 4, 32)
    return (
        keys,
        values,
        key_cache,
        value_cache,
        slots,
        (
            q,
            tables,
            torch.tensor([22], dtype=torch.int32),
            torch.tensor([0, 3], dtype=torch.int32),
            0.3,
        ),
    )


class OpLog(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls.append(func)
        return func(*args, **(kwargs or {}))


def test_plain_tensors_take_the_direct_entry_points():
    q, k, v = random_qkv(1, 2, 2, 3, 3, 8)
    assert ops.calls_directly((q, k, v, None))
    with OpLog() as log:
        assert not ops.calls_directly((q, k, v, None))
        mha_ext.attention(q, k, v)
    assert torch.ops.mha_ext.attention_forward.default in log.calls


@pytest.mark.parametrize("case", range(4))
def test_direct_attention_forward_equals_torch_ops(case):
    args = attention_cases()[case]
    direct_out, direct_lse = mha_ext._C.attention_forward(*args)
    out, lse = torch.ops.mha_ext.attention_forward.default(*args)
    assert torch.equal(direct_out, out) and torch.equal(direct_lse, lse)
    assert direct_out.stride() == out.stride()
    if args[0].requires_grad:  # the direct call records the same autograd graph
        grad = torch.randn_like(out)
        direct_grads = torch.autograd.grad(direct_out, args[:3], grad)
        grads = torch.autograd.grad(out, args[:3], grad)
        for direct_grad, expected in zip(direct_grads, grads):
            assert torch.equal(direct_grad, expected)


def test_direct_paged_calls_equal_torch_ops():
    keys, values, key_cache, value_cache, slots, attention_args = paged_case()
    mha_ext._C.paged_kv_append(keys, values, key_cache, value_cache, slots)
    ops_key_cache, ops_value_cache = torch.zeros_like(key_cache), torch.zeros_like(value_cache)
    torch.ops.mha_ext.paged_kv_append.default(keys, values, ops_key_cache, ops_value_cache, slots)
    assert torch.equal(key_cache, ops_key_cache) and torch.equal(value_cache, ops_value_cache)
    assert torch.equal(key_cache[1, :, 4:], keys[:4].transpose(0, 1))  # really written in place
    q, tables, seq_lens, cu_seqlens_q, scale = attention_args
    direct = mha_ext._C.paged_attention(
        q, key_cache, value_cache, tables, seq_lens, cu_seqlens_q, scale
    )
    expected = torch.ops.mha_ext.paged_attention.default(
        q, key_cache, value_cache, tables, seq_lens, cu_seqlens_q, scale
    )
    assert torch.equal(direct[0], expected[0]) and torch.equal(direct[1], expected[1])


def test_direct_calls_raise_what_torch_ops_raises():
    q, k, v = random_qkv(1, 2, 2, 3, 3, 8)
    bad = (q, k[:, :, :, :4], v, None, None, 0.0, 0.25, -1, -1, False)
    with pytest.raises(RuntimeError, match=r"q has head_dim 8 but k has 4") as expected:
        torch.ops.mha_ext.attention_forward.default(*bad)
    with pytest.raises(RuntimeError) as direct:
        mha_ext._C.attention_forward(*bad)
    assert str(direct.value) == str(expected.value)
    keys, values, key_cache, value_cache, slots, _ = paged_case()
    before = key_cache.clone()
    slots[5] = 48  # one past the cache's last slot
    with pytest.raises(RuntimeError, match=r"slot_mapping\[5\] = 48 is outside"):
        mha_ext._C.paged_kv_append(keys, values, key_cache, value_cache, slots)
    assert torch.equal(key_cache, before)


def test_direct_calls_name_an_argument_of_the_wrong_type():
    q, k, v = random_qkv(1, 2, 2, 3, 3, 8)
    with pytest.raises(TypeError, match=r"mha_ext.attention_forward: k must be a Tensor, got list"):
        mha_ext._C.attention_forward(q, [1.0], v, None, None, 0.0, 0.25, -1, -1, False)
    with pytest.raises(
        TypeError, match=r"mha_ext.attention_forward: bottom_right must be a bool, got int"
    ):
        mha_ext._C.attention_forward(q, k, v, None, None, 0.0, 0.25, -1, -1, 1)
    with pytest.raises(
        TypeError, match=r"mha_ext.attention_forward: scale must be a float, got str"
    ):
        mha_ext._C.attention_forward(q, k, v, None, None, 0.0, "0.25", -1, -1, False)
    with pytest.raises(
        TypeError, match=r"mha_ext.attention_forward: window_left must be an int, got float"
    ):
        mha_ext._C.attention_forward(q, k, v, None, None, 0.0, 0.25, 1.0, -1, False)
    with pytest.raises(OverflowError, match=r"int too big to convert"):  # Python's own, past int64
        mha_ext._C.attention_forward(q, k, v, None, None, 0.0, 0.25, 2**64, -1, False)
    with pytest.raises(
        TypeError, match=r"mha_ext.paged_attention takes 7 to 15 positional arguments, got 6"
    ):
        mha_ext._C.paged_attention(q[0], k, v, None, None, None)


def registered_ops():
    """The mha_ext ops torch knows, by name without the namespace."""
    names = torch._C._dispatch_get_all_op_names()
    return sorted(name.split("::")[1] for name in names if name.startswith("mha_ext::"))


def schema_types(op):
    """(argument types, return types) of an op's registered schema as the schema text spells
    them ("Tensor?", not Python's "Optional[Tensor]"); a written tensor is "Tensor!" (the
    schema's "Tensor(a!)")."""
    schema = getattr(torch.ops.mha_ext, op).default._schema
    arguments = [
        # A SymInt argument's type is int; its real_type says SymInt (but prints "int").
        ("SymInt" if isinstance(a.real_type, torch.SymIntType) else str(a.type)).replace(
            "Optional[Tensor]", "Tensor?"
        )
        + ("!" if a.alias_info is not None and a.alias_info.is_write else "")
        for a in schema.arguments
    ]
    return arguments, [str(r.type) for r in schema.returns]


def test_cpp_op_signatures_match_the_schemas():
    # The typed handles, the direct entry points and attention's autograd kernel all derive
    # from these C++ signatures, so a signature that drifts from its schema fails here.
    signatures = mha_ext._C._op_signatures()
    assert sorted(name.split("::")[1] for name in signatures) == registered_ops()
    for name, (arguments, returns) in signatures.items():
        assert (arguments, returns) == schema_types(name.split("::")[1]), name


# A value of each schema type that a direct entry point accepts, and one it must refuse.
VALID = {
    "Tensor": torch.zeros(1),
    "Tensor!": torch.zeros(1),
    "Tensor?": None,
    "Tensor?!": None,
    "float": 1.0,
    "int": 1,
    "SymInt": 1,
    "bool": True,
}
WRONG = {
    "Tensor": "x",
    "Tensor!": "x",
    "Tensor?": 1.5,
    "Tensor?!": 1.5,
    "float": "x",
    "int": 1.5,
    "SymInt": 1.5,
    "bool": 1,
}


@pytest.mark.parametrize("op", ["attention_forward", "paged_kv_append", "paged_attention"])
def test_direct_entry_points_match_the_schemas(op):
    direct = getattr(mha_ext._C, op)
    schema = getattr(torch.ops.mha_ext, op).default._schema
    arguments, _ = schema_types(op)
    required = sum(1 for argument in schema.arguments if not argument.has_default_value())
    count = str(required) if required == len(arguments) else f"{required} to {len(arguments)}"
    with pytest.raises(TypeError, match=rf"mha_ext.{op} takes {count} positional arguments, got 0"):
        direct()
    # Left-out trailing arguments take the schema's defaults.
    if required < len(arguments):
        with pytest.raises(
            TypeError, match=rf"mha_ext.{op} takes {count} positional arguments, got {required - 1}"
        ):
            direct(*[VALID[t] for t in arguments[: required - 1]])
    # Each position reads the schema's type under the schema's name: a wrong value there is
    # refused by name, after every earlier position accepted a value of its schema type.
    for position, (argument, type_name) in enumerate(zip(schema.arguments, arguments)):
        args = [VALID[t] for t in arguments]
        args[position] = WRONG[type_name]
        with pytest.raises(TypeError, match=rf"^mha_ext.{op}: {argument.name} must be "):
            direct(*args)
