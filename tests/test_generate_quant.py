"""8-bit KV caches above the kernels: the kernels add no error beyond their format's (against
the float64 simulation of benchmarks/kv_cache_accuracy.py on the same data), and greedy
generation of the demo's trained model through an int8 cache agrees with a bf16 cache's."""

import importlib.util
from pathlib import Path

import pytest
import torch

from mha_ext.__main__ import train

# The format simulation and the kernel path are the accuracy script's own functions.
SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "kv_cache_accuracy.py"
_spec = importlib.util.spec_from_file_location("kv_cache_accuracy", SCRIPT)
accuracy = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(accuracy)

# The kernels must stay within 1.2x of the simulated format error (issue 33); they round the
# same values the same way, so the ratio is 1.00 but for fp32 accumulation and the odd code
# that a float32 scale rounds differently from the float64 one ("int8-bf16-q" adds its bf16
# rows and output, and on AVX-512 and AVX2 the 16-bit integer q and P of kInt16Dots;
# "fp8-bf16-q" its bf16 rows and output, and with AVX512-BF16 P in bf16).
KERNEL_ERROR_FACTOR = 1.2
QUANTIZED_FORMATS = ("int8", "int8-bf16-q", "fp8", "fp8-calibrated", "fp8-bf16-q")


@pytest.mark.parametrize("outliers", [False, True], ids=["normal", "outlier_channels"])
@pytest.mark.parametrize("kv_heads", [4, 1])
def test_kernel_error_is_the_formats_error(kv_heads, outliers, device):
    data = accuracy.make_data(4, kv_heads, 300, 64, outliers, seed=3, device=device)
    calibration = accuracy.make_data(4, kv_heads, 64, 64, outliers, seed=4, device=device).k
    errors = accuracy.format_errors(data, calibration, kernels=True)
    for fmt in QUANTIZED_FORMATS:
        for name in (fmt, f"{fmt} smoothed"):
            simulated, measured = errors[name]["simulation"], errors[name]["kernel"]
            assert 0 < measured <= KERNEL_ERROR_FACTOR * simulated, (name, errors[name])


def test_simulated_int8_rounds_half_to_even_per_token_and_head():
    # One (token, head) row with absmax 127: its scale is 1 and the codes are the rounded
    # values; 0.5 and 2.5 round to even. An all-zero row stays zero.
    row = torch.tensor([0.5, 2.5, -1.5, 127.0])
    x = torch.stack([row, torch.zeros(4)])[:, None, :]  # (2 tokens, 1 head, 4)
    expected = torch.tensor([0.0, 2.0, -2.0, 127.0])
    torch.testing.assert_close(accuracy.int8_round_trip(x)[0, 0], expected.double())
    assert accuracy.int8_round_trip(x)[1].abs().max() == 0


def test_simulated_fp8_saturates_instead_of_overflowing():
    x = torch.tensor([1000.0, -1000.0, 0.3])
    out = accuracy.fp8_round_trip(x, 1.0)
    assert out[:2].tolist() == [448.0, -448.0]  # the cast alone gives NaN
    assert abs(out[2].item() - 0.3) <= 0.3 / 16  # e4m3: 3 mantissa bits
    torch.testing.assert_close(
        accuracy.fp8_round_trip(x, 1000 / 448), x.double(), rtol=0.07, atol=0
    )


def test_channel_smoothing_leaves_the_scores_unchanged():
    data = accuracy.make_data(4, 2, 50, 16, outliers=True, seed=0)
    factors = accuracy.channel_smoothing(data.k)  # (kv_heads, D)
    smooth = accuracy.smoothed(data, factors)
    # Equal but for the fp32 rounding of the divided keys and multiplied queries.
    torch.testing.assert_close(
        accuracy.attention64(smooth.q, smooth.k, smooth.v),
        accuracy.attention64(data.q, data.k, data.v),
        rtol=1e-4,
        atol=1e-5,
    )
    assert smooth.k.abs().amax((0, 1)).max() < data.k.abs().amax((0, 1)).max() / 5


@pytest.fixture(scope="module")
def demo_model():
    """The demo's model and alphabet, trained briefly at a fixed seed: 30 steps of 4 x 64
    tokens (seconds) bring the loss to about 2.3, where greedy continuations are words of the
    text and vary with the prompt."""
    torch.manual_seed(0)
    return train(30, batch=4, context=64)


DEMO_PROMPTS = [
    "Attention ",
    "The cache ",
    "A fused kernel ",
    "A query ",
    "The softmax ",
    "Decode ",
    "In the ",
    "We ",
]


def agreement(tokens, reference) -> float:
    """The fraction of positions where two batches of generated tokens agree."""
    pairs = [(a, b) for row, ref in zip(tokens, reference) for a, b in zip(row, ref)]
    return sum(a == b for a, b in pairs) / len(pairs)


def key_value_absmax(model, prompts):
    """The largest |key| and |value| any layer computes over the prompts: fp8's calibration."""
    absmax = {"key": 0.0, "value": 0.0}
    hooks = []
    for block in model.blocks:
        for name, projection in (("key", block.attn.w_k), ("value", block.attn.w_v)):

            def record(module, inputs, output, name=name):
                absmax[name] = max(absmax[name], output.abs().max().item())

            hooks.append(projection.register_forward_hook(record))
    with torch.inference_mode():
        for prompt in prompts:
            model(torch.tensor([prompt]))
    for hook in hooks:
        hook.remove()
    return absmax["key"], absmax["value"]


@pytest.mark.cpu_only  # the demo trains on the CPU
def test_greedy_generation_through_an_int8_cache_agrees_with_bf16(demo_model):
    model, alphabet = demo_model
    prompts = [[alphabet.index(c) for c in prompt] for prompt in DEMO_PROMPTS]
    new_tokens = 32
    bf16 = model.generate(prompts, new_tokens, kv_cache_dtype=torch.bfloat16)
    int8 = model.generate(prompts, new_tokens, kv_cache_dtype=torch.int8)
    fp8 = model.generate(prompts, new_tokens, kv_cache_dtype=torch.float8_e4m3fn)
    key_absmax, value_absmax = key_value_absmax(model, prompts)
    fp8_calibrated = model.generate(
        prompts,
        new_tokens,
        kv_cache_dtype=torch.float8_e4m3fn,
        k_scale=key_absmax / accuracy.E4M3_MAX,
        v_scale=value_absmax / accuracy.E4M3_MAX,
    )
    print(
        f"greedy tokens agreeing with the bf16 cache's: int8 {agreement(int8, bf16):.3f}, "
        f"fp8 unit scale {agreement(fp8, bf16):.3f}, fp8 calibrated "
        f"{agreement(fp8_calibrated, bf16):.3f} (|k| <= {key_absmax:.1f}, "
        f"|v| <= {value_absmax:.1f} over the prompts)"
    )
    assert all(len(row) == new_tokens for row in int8 + fp8 + fp8_calibrated)
    assert agreement(int8, bf16) >= 0.95


@pytest.mark.cpu_only
def test_generate_refuses_fp8_scales_for_other_caches(demo_model):
    model, _ = demo_model
    with pytest.raises(ValueError, match="must stay 1.0 for a torch.int8 cache, got 2.0 and 1.0"):
        model.generate([[1, 2]], 2, kv_cache_dtype=torch.int8, k_scale=2.0)
