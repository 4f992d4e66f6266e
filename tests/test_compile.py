"""torch.compile(fullgraph=True) of every public entry point, with the sequence dims marked
dynamic: one compile serves every length (a recompile fails the test), and the compiled
results and gradients equal eager ones.

aot_eager traces what inductor traces (dynamo, the fake implementations, AOT autograd's
joint graph) without generating code; one test runs inductor for real.
"""

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend

import mha_ext

from conftest import seeded_generator

# Lengths >= 2: dynamo specializes sizes 0 and 1 whatever mark_dynamic says.
LENGTHS = (5, 9, 17)
B, H, HKV, D = 2, 4, 2, 16


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _randn(*shape, requires_grad=False, generator=None):
    return torch.randn(shape, generator=generator).requires_grad_(requires_grad)


def _dynamic(tensor, *dims):
    for dim in dims:
        torch._dynamo.mark_dynamic(tensor, dim)
    return tensor


def _check_lengths(fn, make_inputs, backend="aot_eager", mutated=(), compiles=1, lengths=LENGTHS):
    """Runs fn compiled and eagerly on make_inputs(n) for each n in LENGTHS: equal outputs,
    equal inputs at the indices `mutated` (in-place ops), equal gradients of the inputs that
    require grad (through fn's first output), and `compiles` compiled frames for all lengths
    (error_on_recompile makes a later recompile raise, naming the guard that failed)."""
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(fn, backend=counter, fullgraph=True)
    for index, length in enumerate(lengths):
        inputs = make_inputs(length)
        eager_inputs = [
            x.detach().clone().requires_grad_(x.requires_grad) if torch.is_tensor(x) else x
            for x in inputs
        ]
        with torch._dynamo.config.patch(error_on_recompile=index >= compiles):
            actual = compiled(*inputs)
        expected = fn(*eager_inputs)
        torch.testing.assert_close(actual, expected)
        for position in mutated:
            torch.testing.assert_close(inputs[position], eager_inputs[position], rtol=0, atol=0)
        leaves = [x for x in inputs if torch.is_tensor(x) and x.requires_grad]
        if leaves:
            eager_leaves = [x for x in eager_inputs if torch.is_tensor(x) and x.requires_grad]
            actual, expected = (
                out[0] if isinstance(out, tuple) else out for out in (actual, expected)
            )
            weights = torch.randn(actual.shape, generator=seeded_generator(length))
            torch.testing.assert_close(
                torch.autograd.grad(actual, leaves, weights),
                torch.autograd.grad(expected, eager_leaves, weights),
            )
    assert counter.frame_count == compiles


def _qkv(length, requires_grad=False):
    """q (B, H, L, D), k and v (B, HKV, L + 3, D), the sequence dims dynamic."""
    q = _dynamic(_randn(B, H, length, D, requires_grad=requires_grad), 2)
    k = _dynamic(_randn(B, HKV, length + 3, D, requires_grad=requires_grad), 2)
    v = _dynamic(_randn(B, HKV, length + 3, D, requires_grad=requires_grad), 2)
    return [q, k, v]


def test_attention_forward_and_backward():
    sinks = torch.randn(H, requires_grad=True)

    def attend(q, k, v, sinks):
        return mha_ext.attention(
            q,
            k,
            v,
            causal="bottom_right",
            window=(6, 0),
            softcap=20.0,
            sinks=sinks,
            return_lse=True,
        )

    _check_lengths(attend, lambda n: _qkv(n, requires_grad=True) + [sinks])


def test_attention_with_a_dynamic_mask():
    def attend(q, k, v, mask):
        return mha_ext.attention(q, k, v, attn_mask=mask)

    def inputs(length):
        mask = torch.rand(length, length + 3, generator=seeded_generator(length)) > 0.3
        return _qkv(length, requires_grad=True) + [_dynamic(mask, 0, 1)]

    _check_lengths(attend, inputs)


def test_attention_varlen_forward_and_backward():
    # max_seqlen changes with the lengths. Dynamo compiles a Python int argument as a
    # constant first and, when it changes, once more with it symbolic (automatic dynamic);
    # the op's SymInt max_seqlen arguments keep it symbolic from then on.
    def attend(q, k, v, cu_seqlens, max_seqlen):
        return mha_ext.attention_varlen(
            q,
            k,
            v,
            cu_seqlens,
            cu_seqlens,
            max_seqlen,
            max_seqlen,
            causal="bottom_right",
            return_lse=True,
        )

    def inputs(length):
        lengths = torch.tensor([length, 2, length + 4], dtype=torch.int32)
        cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
        total = int(lengths.sum())
        q = _dynamic(_randn(total, H, D, requires_grad=True), 0)
        k = _dynamic(_randn(total, HKV, D, requires_grad=True), 0)
        v = _dynamic(_randn(total, HKV, D, requires_grad=True), 0)
        return [q, k, v, cu_seqlens, length + 4]

    _check_lengths(attend, inputs, compiles=2, lengths=LENGTHS + (30,))


def test_scaled_dot_product_attention_forward_and_backward():
    def attend(q, k, v):
        return mha_ext.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    _check_lengths(attend, lambda n: _qkv(n, requires_grad=True))


def test_scaled_dot_product_attention_broadcast_mask_and_5d():
    # Leading dims folded into the kernels' batch, a mask over the dynamic lengths.
    def attend(q, k, v, mask):
        return mha_ext.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def inputs(length):
        q = _dynamic(_randn(3, B, H, length, D, requires_grad=True), 3)
        k = _dynamic(_randn(1, B, H, length + 3, D, requires_grad=True), 3)
        v = _dynamic(_randn(1, B, H, length + 3, D, requires_grad=True), 3)
        mask = torch.randn(3, 1, 1, length, length + 3, generator=seeded_generator(length))
        return [q, k, v, _dynamic(mask, 3, 4)]

    _check_lengths(attend, inputs)


def test_paged_append_and_attention():
    block_size, num_blocks, max_blocks = 4, 24, 8
    block_tables = torch.arange(B * max_blocks, dtype=torch.int32).reshape(B, max_blocks)

    def step(q, key, value, k_cache, v_cache, slot_mapping, seq_lens, cu_seqlens_q):
        mha_ext.paged_kv_append(key, value, k_cache, v_cache, slot_mapping)
        return mha_ext.paged_attention(
            q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, return_lse=True
        )

    def inputs(length):
        # B sequences of `length` tokens each, all of them new (prefill).
        generator = seeded_generator(length)
        positions = torch.arange(length)
        slot_mapping = torch.cat(
            [mha_ext.slot_mapping_for(block_tables[b], positions, block_size) for b in range(B)]
        )
        caches = [torch.zeros(num_blocks, HKV, block_size, D) for _ in range(2)]
        return [
            _dynamic(_randn(B * length, H, D, generator=generator), 0),
            _dynamic(_randn(B * length, HKV, D, generator=generator), 0),
            _dynamic(_randn(B * length, HKV, D, generator=generator), 0),
            *caches,
            _dynamic(slot_mapping, 0),
            torch.full((B,), length, dtype=torch.int32),
            torch.arange(0, B * length + 1, length, dtype=torch.int32),
        ]

    _check_lengths(step, inputs, mutated=(3, 4))


def test_merge_attention_states_forward_and_backward():
    def inputs(length):
        out_a, out_b = (_dynamic(_randn(B, H, length, D, requires_grad=True), 2) for _ in "ab")
        lse_a, lse_b = (_dynamic(_randn(B, H, length, requires_grad=True), 2) for _ in "ab")
        return [out_a, lse_a, out_b, lse_b]

    _check_lengths(mha_ext.merge_attention_states, inputs)


def _module():
    torch.manual_seed(0)
    return mha_ext.MultiHeadAttention(64, H, dropout=0.0, num_kv_heads=HKV, sinks=True)


def test_module_forward_and_backward():
    module = _module()

    def forward(x):
        return module(x, x, x, is_causal=True)

    _check_lengths(forward, lambda n: [_dynamic(_randn(B, n, 64, requires_grad=True), 1)])


def test_module_forward_paged_prefill_and_decode():
    module = _module()
    caches = [
        mha_ext.PagedKVCache(
            num_layers=1,
            num_blocks=16,
            block_size=4,
            num_kv_heads=HKV,
            head_dim=64 // H,
            device=torch.get_default_device(),
        )
        for _ in range(2)
    ]
    sequences = [[cache.allocate() for _ in range(B)] for cache in caches]
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(module.forward_paged, backend=counter, fullgraph=True)
    # A prefill of 5 tokens per sequence, two decode steps, a chunk of 3; inference, as
    # serving runs it (the paged ops have no autograd).
    for step, new_tokens in enumerate((5, 1, 1, 3)):
        batches = [cache.prepare(seqs, [new_tokens] * B) for cache, seqs in zip(caches, sequences)]
        x = _dynamic(_randn(B * new_tokens, 64, generator=seeded_generator(step)), 0)
        _dynamic(batches[0].slot_mapping, 0)
        _dynamic(batches[0].block_tables, 1)
        with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=step > 0):
            actual = compiled(x, caches[0], 0, batches[0])
            expected = module.forward_paged(x, caches[1], 0, batches[1])
        torch.testing.assert_close(actual, expected)
        torch.testing.assert_close(caches[0].key_caches, caches[1].key_caches)
        torch.testing.assert_close(caches[0].value_caches, caches[1].value_caches)
    assert counter.frame_count == 1


def test_inductor_compiles_the_module_with_the_ops_as_extern_calls():
    # A real compile: inductor generates the projections' code around mha_ext's ops.
    module = _module()

    def forward(x):
        return module(x, x, x, is_causal=True)

    _check_lengths(
        forward, lambda n: [_dynamic(_randn(B, n, 64, requires_grad=True), 1)], "inductor"
    )
