"""python -m mha_ext: the main demonstration.

Builds a small character-level transformer on mha_ext.MultiHeadAttention (grouped-query
attention, causal), trains it for a few steps on packed batches of documents of different
lengths drawn from the text that ships with the package (no padding), prints the loss,
generates text from a batch of prompts through the paged KV cache, then times mha_ext's
fused attention against torch SDPA and the textbook reference on a GPT-2-small-sized
attention layer.
"""

import argparse
import time
from importlib import resources

import torch
from torch import nn

import mha_ext
from mha_ext.bench import attention_case, report, roofline, run_case
from mha_ext.models import CausalLM, pack_documents

PROMPTS = ["Attention ", "The cache ", "A fused kernel "]
# --kv-cache-dtype: the generation cache's element type; the 8-bit ones halve bf16's bytes
# (int8 with a scale per token and kv head, fp8 e4m3 at unit scale).
KV_CACHE_DTYPES = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "int8": torch.int8,
    "fp8": torch.float8_e4m3fn,
}
# Document lengths are drawn uniformly from [MIN_DOCUMENT, context]: a spread of 8x at the
# demo's context of 64, where a document of 8 characters still holds a word or two.
MIN_DOCUMENT = 8


def draw_documents(data, starts, tokens: int, context: int):
    """Spans of the text, each starting at a word, of input lengths drawn from
    [MIN_DOCUMENT, context] and `tokens` input tokens in all (the last one cut to fit). Each
    span holds one token more than its input: the last input's next-token target."""
    documents = []
    while tokens > 0:
        length = min(int(torch.randint(MIN_DOCUMENT, context + 1, ())), tokens)
        start = int(starts[torch.randint(len(starts), ())])
        documents.append(data[start : start + length + 1])
        tokens -= length
    return documents


def load_text(context: int):
    """(text, alphabet, data, starts) of the shipped text: its sorted characters, the text as
    (len,) indices into them, and the word starts with room for `context` tokens and a
    target after them."""
    text = resources.files("mha_ext").joinpath("data/attention.txt").read_text()
    alphabet = sorted(set(text))
    data = torch.tensor([alphabet.index(c) for c in text])
    starts = torch.tensor([i for i in range(len(text) - context) if i == 0 or text[i - 1] in " \n"])
    return text, alphabet, data, starts


def train(steps: int, batch: int, context: int):
    """Trains a CausalLM on packed documents of the shipped text, batch * context tokens a
    step (as many as a (batch, context) window batch); returns (model, alphabet)."""
    text, alphabet, data, starts = load_text(context)
    model = CausalLM(len(alphabet), context)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    print(
        f"training a {sum(p.numel() for p in model.parameters()) / 1e3:.0f}k-parameter transformer "
        f"(2 layers, 4 query heads sharing 2 kv heads) on {len(text)} characters of shipped text"
    )
    start = time.perf_counter()
    documents_seen = 0
    for step in range(1, steps + 1):
        documents = draw_documents(data, starts, batch * context, context)
        documents_seen += len(documents)
        tokens, cu_seqlens = pack_documents([d[:-1] for d in documents])  # (total,), (docs + 1,)
        targets, _ = pack_documents([d[1:] for d in documents])  # (total,)
        longest = max(len(d) for d in documents) - 1
        logits = model.forward_packed(tokens, cu_seqlens, longest)  # (total, vocab)
        loss = nn.functional.cross_entropy(logits, targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step == 1 or step % 10 == 0 or step == steps:
            print(f"  step {step:4d}  loss {loss.item():.3f}")
    elapsed = time.perf_counter() - start
    print(
        f"  {steps * batch * context / elapsed:.0f} tokens/s of training, packed: "
        f"{documents_seen / steps:.1f} documents of {MIN_DOCUMENT} to {context} tokens a step"
    )
    return model.eval(), alphabet


def generate(model: CausalLM, alphabet, new_tokens: int, kv_cache_dtype: str = "fp32"):
    prompts = [[alphabet.index(c) for c in prompt] for prompt in PROMPTS]
    start = time.perf_counter()
    outputs = model.generate(
        prompts, new_tokens, block_size=16, kv_cache_dtype=KV_CACHE_DTYPES[kv_cache_dtype]
    )
    elapsed = time.perf_counter() - start
    print(
        f"\ngreedy generation, {len(prompts)} prompts batched through the paged KV cache "
        f"({kv_cache_dtype}):"
    )
    for prompt, tokens in zip(PROMPTS, outputs):
        print(f"  {prompt!r} -> {''.join(alphabet[t] for t in tokens)!r}")
    print(f"  {len(prompts) * new_tokens / elapsed:.0f} tokens/s generated")


def compare_speed(quick: bool):
    seq = 256 if quick else 1024
    device = torch.device("cpu")
    measured = roofline.measure_roofline([torch.float32], device, quick=True)
    print(
        f"\nattention speed, GPT-2 small layer (12 heads x 64), batch 1, "
        f"{torch.get_num_threads()} threads "
        f"(more: python -m mha_ext.bench):"
    )
    for suite, backward in (("forward", False), ("forward_backward", True)):
        case = attention_case(
            suite, "gpt2-small", 12, 12, 64, seq, torch.float32, True, backward, device
        )
        result = run_case(
            case, measured.ceilings, device, repeats=3 if quick else 5, probes=measured.probes
        )
        print(report.format_suite(suite, [result], measured.ceilings, measured.peak_kinds))


def main():
    parser = argparse.ArgumentParser(description="mha_ext demonstration")
    parser.add_argument("--steps", type=int, default=250, help="training steps")
    parser.add_argument("--quick", action="store_true", help="smaller speed comparison")
    parser.add_argument(
        "--kv-cache-dtype",
        default="fp32",
        choices=list(KV_CACHE_DTYPES),
        help="element type of the generation's paged KV cache",
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    info = mha_ext.build_info()
    print(
        f"mha_ext {info['version']} (torch {info['torch_version']}, CPU kernels: "
        f"{info['cpu_isa']}, "
        f"CUDA archs: {', '.join(info['cuda_archs']) or 'none'})"
    )
    model, alphabet = train(args.steps, batch=16, context=64)
    generate(model, alphabet, 24 if args.quick else 48, args.kv_cache_dtype)
    compare_speed(args.quick)


if __name__ == "__main__":
    main()
