"""Attention speed: mha_ext against torch SDPA and the textbook reference, in one run.

    python benchmarks/attention_speed.py                      # model shapes, fp32 and bf16
    python benchmarks/attention_speed.py --seq 512 1024 --dtype float32 --no-reference

Shapes come from the seed's model table (BERT-base / GPT-2 small 12 x 64, Llama-2 7B
32 x 128, Llama-2 70B GQA 64 q / 8 kv heads x 128); the forward and the forward+backward
are both timed. Prints a table and writes JSON (default benchmarks/results/attention_speed.json).
"""
import argparse
import json
from pathlib import Path

import torch

from mha_ext.benchmark import AttentionCase, format_table, time_case

MODELS = {
    "gpt2-small": (12, 12, 64),
    "llama2-7b": (32, 32, 128),
    "llama2-70b": (64, 8, 128),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--seq", nargs="+", type=int, default=[512, 2048])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-reference", action="store_true", help="skip the O(S^2)-memory reference")
    parser.add_argument("--json", default=str(Path(__file__).parent / "results" / "attention_speed.json"))
    args = parser.parse_args()

    contenders = ["mha_ext", "torch_sdpa"] + ([] if args.no_reference else ["reference"])
    results = []
    for model in args.models:
        heads, kv_heads, head_dim = MODELS[model]
        for dtype in args.dtype:
            for seq in args.seq:
                for causal in (False, True):
                    for backward in (False, True):
                        case = AttentionCase(model, args.batch, heads, kv_heads, seq, head_dim,
                                             getattr(torch, dtype), causal, backward)
                        results.append(time_case(case, contenders, repeats=args.repeats))
                        print(format_table(results[-1:]).splitlines()[-1], flush=True)
    print()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch {args.batch}, "
          f"median of {args.repeats}")
    print(format_table(results))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=2))
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
