"""Decode and append speed of bf16, int8 and float8_e4m3fn paged caches, measured side by side
(issue 33's performance targets).

Decode: one query per sequence, paged_attention over a cache of `context` tokens per sequence;
each step reads the next layer's cache, the layers together at least twice the CPU's largest
cache (so each step reads from memory; --context 256 --in-cache keeps one layer, read from
cache). Append: new key and value rows (bf16) into the cache, quantized for the 8-bit ones,
--append-tokens per sequence per call (1, the default: a decode step, whose call overhead
counts; 16 shows the quantizers' own cost). On a shared machine rates drift between runs, so the
formats run in alternating rounds, with the streaming read, and the report gives medians of
the rounds and the ratios to bf16 within each round (their median, and the lowest and highest
round in brackets). Each format's cache exists only while
that format is timed (allocated, written and warmed up first): caches held side by side
evicted each other from the CPU's caches and TLB between the formats' turns.

Append flatness (--flat-contexts, issue 33 and 34's "append stays flat in context"): the
append per token into caches already holding 512 and 32768 tokens per sequence (every page
touched before the timing), each format's ratio of the two.

    OMP_NUM_THREADS=1 python benchmarks/kv_cache_speed.py [--rounds 9] [--context 4096]
"""

import argparse
import itertools
import statistics
import time

import torch

from mha_ext import functional
from mha_ext.bench.roofline import cpu_cache_bytes, stream_probe
from mha_ext.kv_cache import PagedKVCache

FORMATS = {"bf16": torch.bfloat16, "int8": torch.int8, "fp8": torch.float8_e4m3fn}


class DecodeCase:
    """Decode steps over caches of one format, each call on the next layer. The caches exist
    between allocate() and release()."""

    def __init__(self, dtype, args, seed):
        self.dtype, self.args, self.seed = dtype, args, seed
        self.batch, self.heads, self.kv_heads = args.batch, args.heads, args.kv_heads
        per_row_scales = 2 * 4 if dtype == torch.int8 else 0  # fp32 K and V scale per row
        row_bytes = 2 * args.head_dim * dtype.itemsize + per_row_scales
        # bytes a step reads: every cached K and V row of every sequence, with its scales
        self.bytes_read = self.batch * self.kv_heads * args.context * row_bytes
        self.layers = 1 if args.in_cache else max(1, -(-2 * cpu_cache_bytes() // self.bytes_read))
        self.appended = self.batch * args.append_tokens
        self.cache = None

    def allocate(self):
        """Builds the caches (the same contents every time), appends the context, and warms
        up: every layer's decode once, and the appends."""
        args, generator = self.args, torch.Generator().manual_seed(self.seed)
        head_dim, context, block_size = args.head_dim, args.context, args.block_size
        spare_blocks = self.batch * -(-args.append_tokens // block_size)  # room for appends
        blocks = self.batch * -(-context // block_size) + spare_blocks
        self.cache = PagedKVCache(
            self.layers, blocks, block_size, self.kv_heads, head_dim, dtype=self.dtype
        )
        seqs = [self.cache.allocate() for _ in range(self.batch)]
        prefill = self.cache.prepare(seqs, [context] * self.batch)
        for layer in range(self.layers):
            # (B * S, Hkv, D) in the slot mapping's token order, bf16 as a model gives them
            k, v = (
                torch.randn(self.batch * context, self.kv_heads, head_dim, generator=generator).to(
                    torch.bfloat16
                )
                for _ in range(2)
            )
            functional.paged_kv_append(
                k,
                v,
                self.cache.key_caches[layer],
                self.cache.value_caches[layer],
                prefill.slot_mapping,
                **self.cache.scale_arguments(layer),
            )
        self.block_tables, self.seq_lens = prefill.block_tables, prefill.seq_lens
        self.q = torch.randn(self.batch, self.heads, head_dim, generator=generator).to(
            torch.bfloat16
        )  # (B, H, D)
        self.cu_seqlens_q = torch.arange(self.batch + 1, dtype=torch.int32)
        # the scale keyword arguments of each layer, built once: not part of a call's cost
        self.scales = [self.cache.scale_arguments(layer) for layer in range(self.layers)]
        self.next_layer = itertools.cycle(range(self.layers))
        # append_tokens new rows per sequence, (B * append_tokens, Hkv, D) bf16, into the
        # blocks held in reserve, rewritten by every append call.
        self.new_k, self.new_v = (
            torch.randn(self.appended, self.kv_heads, head_dim, generator=generator).to(
                torch.bfloat16
            )
            for _ in range(2)
        )
        first_spare_slot = (blocks - spare_blocks) * block_size
        self.new_slots = torch.arange(self.appended, dtype=torch.int64) + first_spare_slot
        seconds_per_call(self.decode, self.layers)
        seconds_per_call(self.append, 100)

    def release(self):
        self.cache = self.scales = self.q = self.new_k = self.new_v = None

    def decode(self):
        layer = next(self.next_layer)
        functional.paged_attention(
            self.q,
            self.cache.key_caches[layer],
            self.cache.value_caches[layer],
            self.block_tables,
            self.seq_lens,
            self.cu_seqlens_q,
            **self.scales[layer],
        )

    def append(self):
        functional.paged_kv_append(
            self.new_k,
            self.new_v,
            self.cache.key_caches[0],
            self.cache.value_caches[0],
            self.new_slots,
            **self.scales[0],
        )


class AppendCase:
    """Appends of one format into a cache already holding `context` tokens of each sequence
    (append_tokens per sequence per call, at the same slots every call)."""

    def __init__(self, dtype, context, args, seed):
        generator = torch.Generator().manual_seed(seed)
        batch, block_size = args.batch, args.block_size
        tokens = context + args.append_tokens
        self.cache = PagedKVCache(
            1,
            batch * -(-tokens // block_size),
            block_size,
            args.kv_heads,
            args.head_dim,
            dtype=dtype,
        )
        # Touch every page: the first write to a page of a fresh mapping faults (slowly on
        # these VMs), which would be timed as the first append's cost.
        for tensor in self.cache.key_caches + self.cache.value_caches:
            tensor.view(torch.uint8).fill_(0)
        seqs = [self.cache.allocate() for _ in range(batch)]
        self.cache.prepare(seqs, [context] * batch)
        self.slots = self.cache.prepare(seqs, [args.append_tokens] * batch).slot_mapping
        self.scales = self.cache.scale_arguments(0)
        for scales in self.scales.values():
            if isinstance(scales, torch.Tensor):
                scales.fill_(0)
        self.appended = batch * args.append_tokens
        self.new_k, self.new_v = (
            torch.randn(self.appended, args.kv_heads, args.head_dim, generator=generator).to(
                torch.bfloat16
            )
            for _ in range(2)
        )  # (B * append_tokens, Hkv, D)
        seconds_per_call(self.append, 100)

    def append(self):
        functional.paged_kv_append(
            self.new_k,
            self.new_v,
            self.cache.key_caches[0],
            self.cache.value_caches[0],
            self.slots,
            **self.scales,
        )


def seconds_per_call(step, calls, clock=time.perf_counter):
    start = clock()
    for _ in range(calls):
        step()
    return (clock() - start) / calls


def round_ratios(ratios):
    """Ratios of one round each (same conditions): their median and, in brackets, the lowest
    and highest, how far they moved within the run."""
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--in-cache", action="store_true", help="one layer, read from cache")
    parser.add_argument(
        "--append-tokens", type=int, default=1, help="new tokens per sequence in one append"
    )
    parser.add_argument("--append-calls", type=int, default=1000)
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    parser.add_argument(
        "--flat-contexts",
        nargs=2,
        type=int,
        default=[512, 32768],
        metavar=("SHORT", "LONG"),
        help="append flatness: per-token append at these contexts (0 0: skip)",
    )
    parser.add_argument("--flat-rounds", type=int, default=3)
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: the process's CPU time, which on a loaded machine leaves out the time the"
        " threads wait for a core (with one thread; with more, it counts OpenMP's spinning)",
    )
    args = parser.parse_args()
    clock = time.perf_counter if args.clock == "wall" else time.process_time

    cases = {name: DecodeCase(FORMATS[name], args, seed) for seed, name in enumerate(args.formats)}
    stream = stream_probe(torch.device("cpu"))

    decode = {name: [] for name in cases}  # seconds per step, one per round
    append = {name: [] for name in cases}  # seconds per call (append_tokens per sequence)
    streams = []  # GB/s
    for round_index in range(args.rounds):
        # rotate the order so that no format always follows the same one
        names = list(cases)
        names = names[round_index % len(names) :] + names[: round_index % len(names)]
        streams.append(stream.work / seconds_per_call(stream.step, 2, clock) / 1e9)
        for name in names:
            case = cases[name]
            case.allocate()
            decode[name].append(seconds_per_call(case.decode, max(case.layers, 4), clock))
            append[name].append(seconds_per_call(case.append, args.append_calls, clock))
            case.release()

    print(
        f"B{args.batch} {args.heads}q/{args.kv_heads}kv D{args.head_dim} context {args.context}"
        f" block {args.block_size}, bf16 q, {torch.get_num_threads()} threads,"
        f" {args.rounds} rounds, {args.clock} clock,"
        f" append {args.append_tokens} token(s) per sequence per call;"
        f" stream read median {statistics.median(streams):.1f} GB/s"
    )
    print(
        f"{'cache':6} {'tokens/s':>9} {'x bf16 (range)':>17} {'GB/s':>6} {'% stream':>9}"
        f" {'append us/token':>16} {'x bf16 (range)':>17}"
    )
    base = args.formats[0]
    for name, case in cases.items():
        step = statistics.median(decode[name])
        percent = statistics.median(
            100 * case.bytes_read / s / 1e9 / g for s, g in zip(decode[name], streams)
        )
        token_us = statistics.median(append[name]) / case.appended * 1e6
        speedup = round_ratios([b / s for b, s in zip(decode[base], decode[name])])
        append_ratio = round_ratios([a / b for a, b in zip(append[name], append[base])])
        print(
            f"{name:6} {args.batch / step:9.1f} {speedup:>17} {case.bytes_read / step / 1e9:6.1f}"
            f" {percent:9.1f} {token_us:16.3f} {append_ratio:>17}"
        )
    if min(args.flat_contexts) > 0:
        report_flatness(args, clock)


def report_flatness(args, clock):
    """Per-token append at the two --flat-contexts, one cache alive at a time, in rounds."""
    short, long = args.flat_contexts
    seconds = {(name, c): [] for name in args.formats for c in (short, long)}
    for _ in range(args.flat_rounds):
        for seed, name in enumerate(args.formats):
            for context in (short, long):
                case = AppendCase(FORMATS[name], context, args, seed)
                calls = seconds_per_call(case.append, args.append_calls, clock)
                seconds[name, context].append(calls / case.appended)
                del case
    print(
        f"append flatness, {args.flat_rounds} rounds: us/token at context {short} and {long},"
        f" ratio {long}/{short} (median of the rounds' ratios)"
    )
    for name in args.formats:
        at_short, at_long = seconds[name, short], seconds[name, long]
        ratio = statistics.median(b / a for a, b in zip(at_short, at_long))
        at_short_us, at_long_us = (statistics.median(t) * 1e6 for t in (at_short, at_long))
        print(f"{name:6} {at_short_us:8.3f} {at_long_us:8.3f} {ratio:6.2f}")


if __name__ == "__main__":
    main()
