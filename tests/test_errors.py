"""Every documented bad input fails with a message naming the argument and the values."""

import pytest
import torch

import mha_ext
from mha_ext import ops


def qkv(batch=2, heads=8, kv_heads=2, seq_q=5, seq_k=7, head_dim=16):
    return (
        torch.randn(batch, heads, seq_q, head_dim),
        torch.randn(batch, kv_heads, seq_k, head_dim),
        torch.randn(batch, kv_heads, seq_k, head_dim),
    )


def test_wrong_rank():
    q, k, v = qkv()
    with pytest.raises(
        RuntimeError, match=r"q must be a 4-D tensor .* got 3-D with shape \[2, 5, 16\]"
    ):
        mha_ext.attention(q[:, 0], k, v)
    # The drop-in takes any rank >= 2 whose leading dims broadcast, as torch does.
    with pytest.raises(
        RuntimeError,
        match=r"must be at least 2-D .* got shapes \(16,\), \(2, 2, 7, 16\), \(2, 2, 7, 16\)",
    ):
        mha_ext.scaled_dot_product_attention(q[0, 0, 0], k, v)
    with pytest.raises(
        RuntimeError,
        match=r"leading \(batch\) dims do not broadcast: query \(2, 8\), key \(2,\)",
    ):
        mha_ext.scaled_dot_product_attention(q, k[:, 0], v[:, 0])


def test_mismatched_batch():
    q, k, v = qkv()
    with pytest.raises(RuntimeError, match=r"share the batch size, got q 2, k 1, v 1"):
        mha_ext.attention(q, k[:1], v[:1])


def test_mismatched_kv_heads_and_lengths():
    q, k, v = qkv()
    with pytest.raises(RuntimeError, match=r"k has 2 heads but v has 1"):
        mha_ext.attention(q, k, v[:, :1])
    with pytest.raises(RuntimeError, match=r"k has 7 keys but v has 6 values"):
        mha_ext.attention(q, k, v[:, :, :6])


def test_heads_not_divisible():
    q, k, v = qkv(heads=8, kv_heads=3)
    with pytest.raises(RuntimeError, match=r"k has 3 heads, which does not divide q's 8 heads"):
        mha_ext.attention(q, k, v)


def test_sdpa_needs_enable_gqa_for_grouped_heads():
    q, k, v = qkv()
    with pytest.raises(RuntimeError, match=r"dims do not broadcast: query \(2, 8\), key \(2, 2\)"):
        mha_ext.scaled_dot_product_attention(q, k, v)


def test_head_dim_mismatch_and_limit():
    q, k, v = qkv()
    with pytest.raises(RuntimeError, match=r"q has head_dim 16 but k has 8"):
        mha_ext.attention(q, k[..., :8], v)
    big = torch.randn(1, 1, 3, 300)
    with pytest.raises(
        RuntimeError, match=r"head_dim 300 \(q, k\) and 300 \(v\) must not exceed 256"
    ):
        mha_ext.attention(big, big, big)


def test_mixed_dtypes():
    q, k, v = qkv()
    with pytest.raises(
        RuntimeError,
        match=r"share one dtype, got q torch.float32, k torch.bfloat16, v torch.float32",
    ):
        mha_ext.attention(q, k.bfloat16(), v)


def test_unsupported_dtype():
    q, k, v = (t.to(torch.int32) for t in qkv())
    with pytest.raises(
        RuntimeError, match=r"q has dtype torch.int32; supported dtypes are torch.float32"
    ):
        mha_ext.attention(q, k, v, scale=1.0)


@pytest.mark.cpu_only  # redispatches to the CPU kernel with a meta tensor
def test_mixed_devices():
    q, k, v = qkv()
    # The dispatcher would route a call with a meta tensor to the fake kernel; send it to
    # the CPU kernel, as it routes a CPU + CUDA mix to the CUDA kernel, which validates alike.
    cpu_only = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
    with pytest.raises(RuntimeError, match=r"one device, got q on cpu, k on meta, v on cpu"):
        torch.ops.mha_ext.attention_forward.default.redispatch(
            cpu_only, q, k.to("meta"), v, None, None, 0.0, 1.0, -1, -1, False
        )


def test_non_contiguous_last_dim():
    q, k, v = qkv()
    q_strided = torch.randn(2, 8, 5, 32)[..., ::2]
    with pytest.raises(
        RuntimeError,
        match=r"q must have a contiguous last dimension \(stride 1\), got strides \[1280, 160, "
        r"32, 2\]",
    ):
        mha_ext.attention(q_strided, k, v)


def test_mask_wrong_shape_and_dtype():
    q, k, v = qkv()
    with pytest.raises(
        RuntimeError,
        match=r"attn_mask of shape \[3, 7\] does not broadcast to \(batch, heads, seq_q, "
        r"seq_k\) = \[2, 8, 5, 7\]",
    ):
        mha_ext.attention(q, k, v, attn_mask=torch.ones(3, 7, dtype=torch.bool))
    with pytest.raises(
        RuntimeError,
        match=r"attn_mask must be torch.bool or q's dtype torch.float32, got torch.int64",
    ):
        mha_ext.attention(q, k, v, attn_mask=torch.ones(5, 7, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"attn_mask requires grad"):
        mha_ext.attention(q, k, v, attn_mask=torch.zeros(5, 7, requires_grad=True))
    with pytest.raises(
        ValueError, match=r"mha_ext.scaled_dot_product_attention: attn_mask requires grad"
    ):
        mha_ext.scaled_dot_product_attention(
            q, k, v, attn_mask=torch.zeros(5, 7, requires_grad=True), enable_gqa=True
        )


@pytest.mark.parametrize("dropout_p", [-0.1, 1.0, 1.5])
def test_dropout_out_of_range(dropout_p):
    q, k, v = qkv()
    with pytest.raises(RuntimeError, match=rf"dropout_p must be in \[0, 1\), got {dropout_p:g}"):
        mha_ext.attention(q, k, v, dropout_p=dropout_p)
    with pytest.raises(
        RuntimeError,
        match=rf"mha_ext.dropout_mask: dropout_p must be in \[0, 1\), got {dropout_p:g}",
    ):
        mha_ext.dropout_mask(torch.tensor([1]), 1, 1, 2, 2, dropout_p)


def test_dropout_seed_checks():
    q, k, v = qkv()
    with pytest.raises(RuntimeError, match=r"dropout_p is 0.5 but no dropout_seed was given"):
        ops.attention_forward(q, k, v, None, None, 0.5, 1.0, -1, -1, False)
    with pytest.raises(
        RuntimeError,
        match=r"dropout_seed must be a one-element torch.int64 tensor, got torch.float32 with "
        r"shape \[2\]",
    ):
        ops.attention_forward(q, k, v, None, torch.zeros(2), 0.5, 1.0, -1, -1, False)


def test_causal_and_window_arguments():
    q, k, v = qkv()
    with pytest.raises(
        ValueError, match=r"causal must be None, 'top_left' or 'bottom_right', got True"
    ):
        mha_ext.attention(q, k, v, causal=True)
    with pytest.raises(ValueError, match=r"window must be a pair \(left, right\) .* got \(3,\)"):
        mha_ext.attention(q, k, v, window=(3,))
    with pytest.raises(ValueError, match=r"window must be a pair .* got \(-5, 0\)"):
        mha_ext.attention(q, k, v, window=(-5, 0))
    with pytest.raises(
        RuntimeError,
        match=r"window sides must be -1 \(unbounded\) or >= 0, got window_left -4, window_right 0",
    ):
        ops.attention_forward(q, k, v, None, None, 0.0, 1.0, -4, 0, False)


def test_backward_argument_checks():
    q, k, v = qkv()
    out, lse = ops.attention_forward(q, k, v, None, None, 0.0, 0.25, -1, -1, False)
    with pytest.raises(
        RuntimeError, match=r"grad_out must have shape \[2, 8, 5, 16\], got \[2, 8, 4, 16\]"
    ):
        ops.attention_backward(
            out[:, :, :4], None, q, k, v, out, lse, None, None, 0.0, 0.25, -1, -1, False
        )
    with pytest.raises(
        RuntimeError,
        match=r"lse must be a torch.float32 tensor of shape \[2, 8, 5\] on \S+, got "
        r"torch.float64 of shape \[2, 8, 5\]",
    ):
        ops.attention_backward(
            out, None, q, k, v, out, lse.double(), None, None, 0.0, 0.25, -1, -1, False
        )


def test_dropout_mask_sizes():
    with pytest.raises(
        RuntimeError,
        match=r"mha_ext.dropout_mask: sizes must be >= 0, got batch 1, num_heads -2, seq_q 3, "
        r"seq_k 4",
    ):
        mha_ext.dropout_mask(torch.tensor([1]), 1, -2, 3, 4, 0.1)


def test_module_arguments():
    with pytest.raises(ValueError, match=r"d_model 100 must be a positive multiple of num_heads 8"):
        mha_ext.MultiHeadAttention(100, 8)
    with pytest.raises(ValueError, match=r"num_kv_heads 3 must divide num_heads 8"):
        mha_ext.MultiHeadAttention(64, 8, num_kv_heads=3)
    with pytest.raises(ValueError, match=r"unknown preset 'gpt5'; known: bert-base"):
        mha_ext.MultiHeadAttention.from_preset("gpt5")
    layer = mha_ext.MultiHeadAttention(64, 8, dropout=0.0)
    x = torch.randn(2, 5, 64)
    with pytest.raises(
        ValueError, match=r"head_mask must have shape \(8,\) or \(2, 8\), got \(4,\)"
    ):
        layer(x, x, x, head_mask=torch.ones(4))


@pytest.mark.cpu_only  # a build-time check: runs setup.py, nothing device-specific
@pytest.mark.parametrize("setting", ["64,72", "0", "64,fast"])
def test_bad_tensor_core_head_dims_stop_the_build(setting):
    import os
    import subprocess
    import sys
    from pathlib import Path

    if not Path("/usr/local/cuda/bin/nvcc").exists() or torch.version.cuda is None:
        pytest.skip("the head-dim list is read only for a CUDA build")
    root = Path(__file__).resolve().parent.parent
    env = {
        **os.environ,
        "MHA_EXT_CUDA": "1",
        "CUDA_HOME": "/usr/local/cuda",
        "MHA_EXT_HEAD_DIMS": setting,
    }
    result = subprocess.run(
        [sys.executable, "setup.py", "--name"], cwd=root, env=env, capture_output=True, text=True
    )
    assert result.returncode != 0
    assert (
        f"MHA_EXT_HEAD_DIMS must list multiples of 16 in [16, 256], got '{setting}'"
        in result.stderr
    )
