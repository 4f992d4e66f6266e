"""64-bit indexing: tensors and caches of more than 2^31 elements (bf16, 4 GiB each), read
and written at their far ends. The tensors come from torch.empty and only the parts a call
reads are filled, so the pages the kernels never touch are never allocated: a run touches a
few MiB. Each test still asks for the whole span in MemAvailable, so that a kernel that did
read everything could not push the machine out of memory."""

import pytest
import torch

import mha_ext
from mha_ext.reference import attention_reference

from memory_probe import available_bytes

# Resident memory and virtual spans of the CPU backend.
pytestmark = pytest.mark.cpu_only

HEAD_DIM = 128
BLOCK_SIZE = 16
# 2^20 + 2 blocks of one kv head: 2^31 + 4096 elements in each of k_cache and v_cache.
NUM_BLOCKS = (1 << 20) + 2
LAST_BLOCK = NUM_BLOCKS - 1
HEADROOM = 1 << 30


def empty_beyond_int32(*shape):
    """An unfilled bf16 tensor of more than 2^31 elements (no page of it allocated yet)."""
    tensor = torch.empty(shape, dtype=torch.bfloat16)
    assert tensor.numel() > 2**31
    return tensor


def require_available(byte_count):
    """Skips the test when the machine has less memory available than its tensors span."""
    available = available_bytes()
    if available < byte_count + HEADROOM:
        pytest.skip(
            f"needs {(byte_count + HEADROOM) / 2**30:.1f} GiB of MemAvailable for two "
            f"tensors of 2^31+ bf16 elements, the machine has {available / 2**30:.1f} GiB"
        )


def test_forward_reads_keys_and_values_past_2_to_the_31():
    # k and v (2, 1, 2^23 + 64, 128): batch 1's last keys start 2^31 elements in. A window
    # of 60 keys bottom-right makes the queries read only each batch's last 64 keys.
    seq_k = (1 << 23) + 64
    require_available(2 * 2 * seq_k * HEAD_DIM * 2)
    k, v = (empty_beyond_int32(2, 1, seq_k, HEAD_DIM) for _ in range(2))
    generator = torch.Generator().manual_seed(0)
    k[:, :, -64:] = torch.randn(2, 1, 64, HEAD_DIM, generator=generator).bfloat16()
    v[:, :, -64:] = torch.randn(2, 1, 64, HEAD_DIM, generator=generator).bfloat16()
    q = torch.randn(2, 2, 3, HEAD_DIM, generator=generator).bfloat16()
    out = mha_ext.attention(q, k, v, causal="bottom_right", window=(60, 0))
    reference, _ = attention_reference(
        q.double(),
        k[:, :, -64:].double(),
        v[:, :, -64:].double(),
        causal="bottom_right",
        window=(60, 0),
    )
    torch.testing.assert_close(out.double(), reference, atol=1e-2, rtol=1e-2)


def huge_caches():
    require_available(2 * NUM_BLOCKS * BLOCK_SIZE * HEAD_DIM * 2)
    return (empty_beyond_int32(NUM_BLOCKS, 1, BLOCK_SIZE, HEAD_DIM) for _ in range(2))


def test_append_writes_slots_past_2_to_the_31():
    k_cache, v_cache = huge_caches()
    sentinel = -7.0
    for cache in (k_cache, v_cache):
        cache[LAST_BLOCK - 1 :] = sentinel
        cache[:1] = sentinel
    # Slots 0, 5 of block 0 and 3, 15 of the last block (element 2^31 + 2048 + ...).
    slots = torch.tensor([0, 5, LAST_BLOCK * BLOCK_SIZE + 3, LAST_BLOCK * BLOCK_SIZE + 15])
    keys, values = torch.randn(4, 1, HEAD_DIM).bfloat16(), torch.randn(4, 1, HEAD_DIM).bfloat16()
    mha_ext.paged_kv_append(keys, values, k_cache, v_cache, slots)
    for cache, new in ((k_cache, keys), (v_cache, values)):
        for row, slot in enumerate(slots.tolist()):
            block, offset = divmod(slot, BLOCK_SIZE)
            assert torch.equal(cache[block, 0, offset], new[row, 0]), f"slot {slot}"
        untouched = torch.ones(BLOCK_SIZE, dtype=torch.bool)
        untouched[[3, 15]] = False
        assert (cache[LAST_BLOCK, 0, untouched] == sentinel).all()
        assert (cache[LAST_BLOCK - 1] == sentinel).all()


def test_paged_attention_reads_blocks_past_2_to_the_31():
    k_cache, v_cache = huge_caches()
    generator = torch.Generator().manual_seed(1)
    # Two sequences over blocks at both ends of the caches: a decode step and a prefill
    # chunk of 5 queries, with GQA (4 query heads on the one kv head).
    tables = torch.tensor([[LAST_BLOCK, 0, LAST_BLOCK - 1], [1, LAST_BLOCK - 2, 2]]).int()
    seq_lens = torch.tensor([40, 37], dtype=torch.int32)
    keys, values = [], []
    for table, length in zip(tables, seq_lens.tolist()):
        key = torch.randn(length, 1, HEAD_DIM, generator=generator).bfloat16()
        value = torch.randn(length, 1, HEAD_DIM, generator=generator).bfloat16()
        slots = mha_ext.slot_mapping_for(table, torch.arange(length), BLOCK_SIZE)
        mha_ext.paged_kv_append(key, value, k_cache, v_cache, slots)
        keys.append(key)
        values.append(value)
    cu_seqlens_q = torch.tensor([0, 1, 6], dtype=torch.int32)
    q = torch.randn(6, 4, HEAD_DIM, generator=generator).bfloat16()
    out = mha_ext.paged_attention(q, k_cache, v_cache, tables, seq_lens, cu_seqlens_q)
    for b in range(2):
        rows = slice(cu_seqlens_q[b].item(), cu_seqlens_q[b + 1].item())
        reference, _ = attention_reference(
            q[rows].transpose(0, 1).unsqueeze(0).double(),  # (1, H, Sq, D)
            keys[b].transpose(0, 1).unsqueeze(0).double(),  # (1, Hkv, Sk, D)
            values[b].transpose(0, 1).unsqueeze(0).double(),
            causal="bottom_right",
        )
        torch.testing.assert_close(
            out[rows].transpose(0, 1).unsqueeze(0).double(), reference, atol=1e-2, rtol=1e-2
        )
