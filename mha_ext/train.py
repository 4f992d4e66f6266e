"""Trains the demo's small language model with its sequence split across processes.

    torchrun --nproc-per-node 2 -m mha_ext.train --context-parallel ring     # or ulysses
    python -m mha_ext.train                                                  # one process

Every rank builds the same model and draws the same batch of text windows (same seed), then
keeps only its shard of each window's positions (shard_sequence; zigzag by default): the
embeddings, MLPs and logits run on the shard, and attention runs over the whole sequence
through mha_ext.distributed.context_parallel_attention. The loss of a step is the sum over
the ranks' tokens; the ranks sum their gradients (one all_reduce) before the optimizer
step, so every rank keeps the same weights and the printed loss is the one-process run's,
up to the order of floating-point sums: over the default 20 steps, ring and ulysses on 2 and
4 ranks printed the one-process losses to 6 decimals, at most 1e-6 apart (Xeon, gloo).
"""

import argparse
import os
import time
from typing import List, Optional

import torch
import torch.distributed as dist
from torch import nn

from .__main__ import load_text
from .distributed import context_parallel_attention_function, shard_sequence
from .models import CausalLM

STRATEGIES = ("ring", "ulysses")


def draw_windows(data, starts, batch: int, context: int):
    """(batch, context + 1) spans of the text, each starting at a word: inputs and their
    next-token targets."""
    picks = starts[torch.randint(len(starts), (batch,))]  # (batch,)
    return torch.stack([data[start : start + context + 1] for start in picks.tolist()])


def _sum_across_ranks(tensors: List[torch.Tensor]) -> None:
    """Sums each tensor over the ranks in place, in one all_reduce."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat)
    for tensor, summed in zip(tensors, flat.split([t.numel() for t in tensors])):
        tensor.copy_(summed.view_as(tensor))


def train(
    steps: int,
    batch: int,
    context: int,
    seed: int = 0,
    context_parallel: Optional[str] = None,
    load_balance: Optional[str] = "zigzag",
    log: bool = True,
) -> List[float]:
    """Trains CausalLM (2 layers, 4 query heads on 2 kv heads, no dropout) for `steps` steps
    of `batch` windows of `context` tokens; returns the loss of each step.

    context_parallel: None trains on the whole windows in this process; "ring" or "ulysses"
    splits them across the ranks of the initialised default process group. Runs on the
    GPU of LOCAL_RANK where CUDA is available (NCCL), else on the CPU (gloo).
    """
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    torch.manual_seed(seed)
    _, alphabet, data, starts = load_text(context)
    # No dropout: its masks would differ between a shard and the whole sequence.
    model = CausalLM(len(alphabet), context, dropout=0.0).to(device)
    positions = torch.arange(context, device=device)  # (T,)
    if context_parallel is not None:
        attend = context_parallel_attention_function(
            strategy=context_parallel, load_balance=load_balance
        )
        for block in model.blocks:
            block.attn.attention_function = attend
        positions = shard_sequence(positions, 0, load_balance=load_balance)  # (T / W,)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = batch * context
    losses = []
    start = time.perf_counter()
    for step in range(1, steps + 1):
        windows = draw_windows(data, starts, batch, context).to(device)  # (B, T + 1)
        inputs, targets = windows[:, :-1], windows[:, 1:]  # (B, T) each
        if context_parallel is not None:
            inputs = shard_sequence(inputs, 1, load_balance=load_balance)  # (B, T / W)
            targets = shard_sequence(targets, 1, load_balance=load_balance)
        logits = model(inputs, positions)  # (B, T or T / W, vocab)
        loss_sum = nn.functional.cross_entropy(
            logits.flatten(0, 1), targets.flatten(), reduction="sum"
        )
        optimizer.zero_grad()
        (loss_sum / tokens).backward()
        loss_sum = loss_sum.detach()
        if context_parallel is not None:
            _sum_across_ranks([p.grad for p in model.parameters()] + [loss_sum])
        optimizer.step()
        losses.append(loss_sum.item() / tokens)
        if log:
            print(f"step {step:4d}  loss {losses[-1]:.6f}", flush=True)
    if log:
        print(f"{steps * tokens / (time.perf_counter() - start):.0f} tokens/s", flush=True)
    return losses


def main():
    parser = argparse.ArgumentParser(
        description="train the demo model, its sequence split across torchrun's processes"
    )
    parser.add_argument("--context-parallel", choices=STRATEGIES, default=None)
    parser.add_argument("--load-balance", choices=("zigzag", "none"), default="zigzag")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1 and args.context_parallel is None:
        parser.error(f"{world_size} processes: pass --context-parallel ring or ulysses")
    if args.context_parallel is not None:
        if "RANK" in os.environ:  # torchrun's environment
            if torch.cuda.is_available():
                torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        else:  # one process: a group of one, running the same code path
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    rank = dist.get_rank() if dist.is_initialized() else 0
    try:
        train(
            args.steps,
            args.batch,
            args.context,
            args.seed,
            args.context_parallel,
            None if args.load_balance == "none" else args.load_balance,
            log=rank == 0,
        )
        if dist.is_initialized():
            # Gloo's worker threads free a finished collective's tensors after its wait()
            # returns, taking the GIL to do so; one still waiting for it when the interpreter
            # shuts down aborts the process (pytorch/pytorch#117762). The barrier's wait
            # releases the GIL until every rank got here, by which time they have.
            dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
