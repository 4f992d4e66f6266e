"""python -m mha_ext: the main demonstration.

Builds a small character-level transformer on mha_ext.MultiHeadAttention (grouped-query
attention, causal), trains it for a few steps on the text that ships with the package,
prints the loss, generates text from a batch of prompts through the paged KV cache, then
times mha_ext's fused attention against torch SDPA and the textbook reference on a
GPT-2-small-sized attention layer.
"""

import argparse
import time
from importlib import resources

import torch
from torch import nn

import mha_ext
from mha_ext.bench import attention_case, report, roofline, run_case
from mha_ext.models import CausalLM

PROMPTS = ["Attention ", "The cache ", "A fused kernel "]


def train(steps: int, batch: int, context: int):
    """Trains a CausalLM on the shipped text; returns (model, alphabet)."""
    text = resources.files("mha_ext").joinpath("data/attention.txt").read_text()
    alphabet = sorted(set(text))
    data = torch.tensor([alphabet.index(c) for c in text])
    model = CausalLM(len(alphabet), context)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    print(
        f"training a {sum(p.numel() for p in model.parameters()) / 1e3:.0f}k-parameter transformer "
        f"(2 layers, 4 query heads sharing 2 kv heads) on {len(text)} characters of shipped text"
    )
    start = time.perf_counter()
    for step in range(1, steps + 1):
        offsets = torch.randint(0, len(data) - context - 1, (batch,))
        window = torch.stack([data[o : o + context + 1] for o in offsets])  # (B, T + 1)
        logits = model(window[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step == 1 or step % 10 == 0 or step == steps:
            print(f"  step {step:4d}  loss {loss.item():.3f}")
    elapsed = time.perf_counter() - start
    print(f"  {steps * batch * context / elapsed:.0f} tokens/s of training")
    return model.eval(), alphabet


def generate(model: CausalLM, alphabet, new_tokens: int):
    prompts = [[alphabet.index(c) for c in prompt] for prompt in PROMPTS]
    start = time.perf_counter()
    outputs = model.generate(prompts, new_tokens, block_size=16)
    elapsed = time.perf_counter() - start
    print(f"\ngreedy generation, {len(prompts)} prompts batched through the paged KV cache:")
    for prompt, tokens in zip(PROMPTS, outputs):
        print(f"  {prompt!r} -> {''.join(alphabet[t] for t in tokens)!r}")
    print(f"  {len(prompts) * new_tokens / elapsed:.0f} tokens/s generated")


def compare_speed(quick: bool):
    seq = 256 if quick else 1024
    device = torch.device("cpu")
    probes = roofline.probes([torch.float32], device, quick=True)
    ceilings = roofline.measure(probes, device, quick=True)
    print(
        f"\nattention speed, GPT-2 small layer (12 heads x 64), batch 1, "
        f"{torch.get_num_threads()} threads "
        f"(more: python -m mha_ext.bench):"
    )
    for suite, backward in (("forward", False), ("forward_backward", True)):
        case = attention_case(
            suite, "gpt2-small", 12, 12, 64, seq, torch.float32, True, backward, device
        )
        result = run_case(case, ceilings, device, repeats=3 if quick else 5, probes=probes)
        print(report.format_suite(suite, [result], ceilings))


def main():
    parser = argparse.ArgumentParser(description="mha_ext demonstration")
    parser.add_argument("--steps", type=int, default=250, help="training steps")
    parser.add_argument("--quick", action="store_true", help="smaller speed comparison")
    args = parser.parse_args()
    torch.manual_seed(0)
    info = mha_ext.build_info()
    print(
        f"mha_ext {info['version']} (torch {info['torch_version']}, CPU kernels: "
        f"{info['cpu_isa']}, "
        f"CUDA archs: {', '.join(info['cuda_archs']) or 'none'})"
    )
    model, alphabet = train(args.steps, batch=16, context=64)
    generate(model, alphabet, new_tokens=24 if args.quick else 48)
    compare_speed(args.quick)


if __name__ == "__main__":
    main()
