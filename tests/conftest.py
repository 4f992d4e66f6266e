"""Shared helpers: the accuracy rule and input builders."""
import pytest
import torch

# FlashAttention's accuracy rule: the kernel's max error against the float64 reference may
# be at most FACTOR x the error of plain PyTorch in the same dtype (3x for gradients), plus
# a few units of rounding in the kernels' fp32 accumulation (fp64 for fp64). The floor
# matters where plain PyTorch is exact, e.g. softmax over one key, whose gradient the fused
# backward gets as the difference of two equal fp32 dot products.
OUTPUT_FACTOR = 2.0
GRAD_FACTOR = 3.0
ROUNDING_UNITS = 16


def max_error(actual: torch.Tensor, reference: torch.Tensor) -> float:
    return (actual.double() - reference.double()).abs().max().item() if actual.numel() else 0.0


def assert_within_rule(actual, reference64, plain, factor, what):
    """actual: kernel result; reference64: float64 reference; plain: reference computed in
    the kernel's dtype."""
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    error = max_error(actual, reference64)
    plain_error = max_error(plain, reference64)
    magnitude = reference64.abs().max().item() if reference64.numel() else 0.0
    accumulate_eps = torch.finfo(torch.float64 if actual.dtype == torch.float64 else torch.float32).eps
    allowed = factor * plain_error + ROUNDING_UNITS * accumulate_eps * max(magnitude, 1.0)
    assert error <= allowed, (
        f"{what}: max error {error:.3e} exceeds {allowed:.3e} "
        f"({factor}x plain PyTorch's {plain_error:.3e} + rounding)"
    )


def random_qkv(batch, heads, kv_heads, seq_q, seq_k, head_dim, head_dim_v=None, dtype=torch.float32,
               layout="bhsd", seed=0):
    """q, k, v as (B, H, S, D) tensors; layout "bshd" gives transposed views of
    (B, S, H, D) storage, as a model's projections produce."""
    generator = torch.Generator().manual_seed(seed)
    head_dim_v = head_dim if head_dim_v is None else head_dim_v

    def make(h, s, d):
        if layout == "bshd":
            return torch.randn(batch, s, h, d, generator=generator).to(dtype).transpose(1, 2)
        return torch.randn(batch, h, s, d, generator=generator).to(dtype)

    return make(heads, seq_q, head_dim), make(kv_heads, seq_k, head_dim), make(kv_heads, seq_k, head_dim_v)


@pytest.fixture(autouse=True)
def _fixed_seed():
    torch.manual_seed(1234)
