"""Paged KV cache: per-token append cost as the context grows, and decode attention speed.

    python benchmarks/kv_cache.py            # full run
    python benchmarks/kv_cache.py --quick    # shorter contexts and fewer repeats

Append: one new token of a Llama-2 7B layer (32 kv heads x 128, fp32) written into the
cache at context lengths 512 .. 32k, mha_ext.paged_kv_append against the seed tutorial's
update_kv_cache (torch.cat onto a contiguous cache, which copies the whole cache per token).
Decode: one query per sequence, batch 8, context 4096, Llama-2 7B (32 x 128) and Llama-2 70B
GQA (64 q / 8 kv heads x 128) shapes, mha_ext.paged_attention (16-token blocks) against
torch SDPA on a contiguous cache with enable_gqa=True, in GB/s of K/V read.
Writes JSON next to the printed tables (default benchmarks/results/kv_cache.json).
"""
import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

import mha_ext
from mha_ext.benchmark import median_seconds

KV_HEADS, HEAD_DIM = 32, 128


def seed_update_kv_cache(kv_cache, new_k, new_v, layer_idx):
    """The seed tutorial's cache update: concatenation, a full copy per token."""
    k_cache, v_cache = kv_cache[layer_idx]
    kv_cache[layer_idx] = (torch.cat([k_cache, new_k], dim=2), torch.cat([v_cache, new_v], dim=2))
    return kv_cache


# A paged append takes microseconds: time a run of tokens and report the cost per token.
TOKENS_PER_RUN = 64


def append_costs(contexts, repeats):
    block_size = 16
    tokens = max(contexts) + TOKENS_PER_RUN
    cache = mha_ext.PagedKVCache(1, -(-tokens // block_size), block_size, KV_HEADS, HEAD_DIM)
    seq = cache.allocate()
    cache.prepare([seq], [tokens])
    table = torch.tensor(cache.block_table(seq))
    key, value = torch.randn(1, KV_HEADS, HEAD_DIM), torch.randn(1, KV_HEADS, HEAD_DIM)
    rows = []
    for context in contexts:
        # Tokens context, context + 1, ... each written in place by its own call, as in decoding.
        slots = mha_ext.slot_mapping_for(table, torch.arange(context, context + TOKENS_PER_RUN), block_size)
        contiguous = [(torch.randn(1, KV_HEADS, context, HEAD_DIM), torch.randn(1, KV_HEADS, context, HEAD_DIM))]
        new_k, new_v = key.view(1, KV_HEADS, 1, HEAD_DIM), value.view(1, KV_HEADS, 1, HEAD_DIM)

        def paged():
            for slot in slots.split(1):
                mha_ext.paged_kv_append(key, value, cache.key_caches[0], cache.value_caches[0], slot)

        def seed():  # one token onto a context-long contiguous cache
            seed_update_kv_cache(list(contiguous), new_k, new_v, 0)

        # Timed apart, not interleaved: each torch.cat maps and unmaps a context-sized buffer,
        # which would leave the next paged append with cold caches and TLB.
        seconds = {**median_seconds({"mha_ext": paged}, warmup=2, repeats=repeats),
                   **median_seconds({"seed_torch_cat": seed}, warmup=2, repeats=repeats)}
        seconds["mha_ext"] /= TOKENS_PER_RUN
        rows.append({"context": context, **{f"{k}_us": v * 1e6 for k, v in seconds.items()}})
        print(f"  context {context:6d}: mha_ext {rows[-1]['mha_ext_us']:9.2f} us   "
              f"torch.cat {rows[-1]['seed_torch_cat_us']:10.1f} us   "
              f"ratio {seconds['seed_torch_cat'] / seconds['mha_ext']:8.0f}x", flush=True)
    return rows


def decode_speed(models, dtypes, batch, context, repeats):
    block_size = 16
    rows = []
    for name, (heads, kv_heads) in models.items():
        for dtype in dtypes:
            generator = torch.Generator().manual_seed(0)
            k = torch.randn(batch, kv_heads, context, HEAD_DIM, generator=generator).to(dtype)
            v = torch.randn(batch, kv_heads, context, HEAD_DIM, generator=generator).to(dtype)
            q = torch.randn(batch, heads, 1, HEAD_DIM, generator=generator).to(dtype)
            cache = mha_ext.PagedKVCache(1, batch * context // block_size, block_size, kv_heads, HEAD_DIM, dtype=dtype)
            seqs = [cache.allocate() for _ in range(batch)]
            prefill = cache.prepare(seqs, [context] * batch)
            # (B, Hkv, S, D) -> (B * S, Hkv, D), the token order of the slot mapping
            mha_ext.paged_kv_append(k.transpose(1, 2).flatten(0, 1), v.transpose(1, 2).flatten(0, 1),
                                    cache.key_caches[0], cache.value_caches[0], prefill.slot_mapping)
            step = mha_ext.CacheBatch(seqs, prefill.block_tables, prefill.seq_lens,
                                      torch.arange(batch + 1, dtype=torch.int32), prefill.slot_mapping[:0],
                                      prefill.positions[:0])
            q_packed = q[:, :, 0]  # (B, H, D): one query per sequence

            def paged():
                mha_ext.paged_attention(q_packed, cache.key_caches[0], cache.value_caches[0],
                                        step.block_tables, step.seq_lens, step.cu_seqlens_q)

            def sdpa():
                F.scaled_dot_product_attention(q, k, v, enable_gqa=heads != kv_heads)

            torch.testing.assert_close(  # same answer before timing it
                mha_ext.paged_attention(q_packed, cache.key_caches[0], cache.value_caches[0],
                                        step.block_tables, step.seq_lens, step.cu_seqlens_q).float(),
                F.scaled_dot_product_attention(q, k, v, enable_gqa=heads != kv_heads)[:, :, 0].float(),
                rtol=2e-2, atol=2e-2)
            seconds = median_seconds({"mha_ext": paged, "torch_sdpa": sdpa}, warmup=2, repeats=repeats)
            kv_bytes = 2 * k.numel() * k.element_size()
            row = {"model": name, "dtype": str(dtype).replace("torch.", ""), "batch": batch, "context": context,
                   "kv_bytes": kv_bytes, **{f"{k_}_gbps": kv_bytes / s / 1e9 for k_, s in seconds.items()},
                   "speedup_vs_torch_sdpa": seconds["torch_sdpa"] / seconds["mha_ext"]}
            rows.append(row)
            print(f"  {name:11s} {row['dtype']:9s}: mha_ext {row['mha_ext_gbps']:6.1f} GB/s   torch SDPA "
                  f"{row['torch_sdpa_gbps']:6.1f} GB/s   ratio {row['speedup_vs_torch_sdpa']:.2f}x", flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default=str(Path(__file__).parent / "results" / "kv_cache.json"))
    args = parser.parse_args()
    contexts = [512, 2048, 8192] if args.quick else [512, 1024, 2048, 4096, 8192, 16384, 32768]
    repeats = 3 if args.quick else 7
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"\nappend one token, Llama-2 7B layer ({KV_HEADS} kv heads x {HEAD_DIM}, fp32), median of {repeats}:")
    appends = append_costs(contexts, repeats)
    first, last = appends[0], appends[-1]
    growth = {k: last[f"{k}_us"] / first[f"{k}_us"] for k in ("mha_ext", "seed_torch_cat")}
    print(f"  cost at {last['context']} / cost at {first['context']}: mha_ext {growth['mha_ext']:.2f}x, "
          f"torch.cat {growth['seed_torch_cat']:.1f}x")
    models = {"llama2-7b": (32, 32), "llama2-70b": (64, 8)}
    context = 1024 if args.quick else 4096
    print(f"\ndecode attention, batch 8, context {context}, K/V read per step (GB/s), median of {repeats}:")
    decode = decode_speed(models, [torch.float32, torch.bfloat16], 8, context, repeats)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"append": appends, "append_growth": growth, "decode": decode}, indent=2))
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
