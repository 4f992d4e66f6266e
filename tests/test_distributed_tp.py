"""Tensor-parallel MultiHeadAttention (mha_ext.distributed.parallelize_attention) equals the
unsharded module, outputs and gradients, on gloo with spawned CPU processes.

One spawn per world size runs every configuration (spawning and joining a process group costs
2-4 s per rank here); each rank uses one thread, and the process group times out after 60 s so
a rank that fails ends the run with an error instead of a hang.
"""

import copy
import datetime
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

from mha_ext import MultiHeadAttention
from mha_ext.distributed.tensor_parallel import parallelize_attention

from conftest import GRAD_FACTOR, OUTPUT_FACTOR, assert_within_rule

TIMEOUT = datetime.timedelta(seconds=60)
# (num_heads, num_kv_heads, module options): MHA, GQA with both of its kv heads per rank at
# world 2 (one at world 4), and the per-head features that parallelize_attention must split.
CONFIGS = [
    (4, 4, {}),
    (8, 4, {}),
    (8, 4, {"bias": True, "sinks": True, "alibi": True, "window": (5, 3)}),
]
D_K = 8
BATCH, SEQ = 2, 11  # an odd sequence length: nothing lines up by accident


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_ranks(world: int, worker, *args):
    """worker(rank, world, *args) on `world` spawned processes in one gloo process group."""
    port = free_port()
    mp.spawn(_rank_entry, args=(world, port, worker, args), nprocs=world, join=True)


def _rank_entry(rank, world, port, worker, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=TIMEOUT)
    try:
        worker(rank, world, *args)
    finally:
        dist.destroy_process_group()


def gathered(tensor):
    """The full tensor of a DTensor (a collective: every rank calls it), else the tensor."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def run_module(module, inputs, is_causal):
    """Output and the gradients of the inputs and parameters for a fixed random upstream
    gradient; parameters by name, full tensors."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out = module(*leaves, is_causal=is_causal)  # (B, S, d_model)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    out.backward(upstream)
    grads = {f"input {i}": x.grad for i, x in enumerate(leaves)}
    grads.update({name: gathered(p.grad) for name, p in module.named_parameters()})
    return out.detach(), grads


def check_matches_unsharded(world):
    mesh = init_device_mesh("cpu", (world,))
    for heads, kv_heads, options in CONFIGS:
        for is_causal in (False, True):
            what = f"world {world} heads {heads}/{kv_heads} {options} causal {is_causal}"
            torch.manual_seed(0)
            reference64 = MultiHeadAttention(
                heads * D_K, heads, dropout=0.0, num_kv_heads=kv_heads, **options
            ).double()
            if reference64.sinks is not None:
                torch.nn.init.normal_(reference64.sinks)  # zero sinks would test nothing
            plain = copy.deepcopy(reference64).float()
            sharded = parallelize_attention(copy.deepcopy(plain), mesh)
            assert (sharded.num_heads, sharded.num_kv_heads) == (heads // world, kv_heads // world)
            generator = torch.Generator().manual_seed(2)
            x = torch.randn(BATCH, SEQ, heads * D_K, generator=generator, dtype=torch.float64)
            memory = torch.randn(BATCH, SEQ, heads * D_K, generator=generator, dtype=torch.float64)
            inputs64 = (x, memory, memory)
            out64, grads64 = run_module(reference64, inputs64, is_causal)
            inputs = tuple(t.float() for t in inputs64)
            plain_out, plain_grads = run_module(plain, inputs, is_causal)
            out, grads = run_module(sharded, inputs, is_causal)
            assert_within_rule(out, out64, plain_out, OUTPUT_FACTOR, f"{what}: output")
            assert grads.keys() == grads64.keys(), what
            for name, grad in grads.items():
                assert_within_rule(
                    grad, grads64[name], plain_grads[name], GRAD_FACTOR, f"{what}: d {name}"
                )


def check_errors(world):
    mesh = init_device_mesh("cpu", (world,))
    uneven = MultiHeadAttention(4 * D_K, 4, num_kv_heads=1)
    with pytest.raises(ValueError, match=f"mesh size {world} must divide num_heads 4 and "):
        parallelize_attention(uneven, mesh)
    with pytest.raises(ValueError, match="must be a 1-D DeviceMesh"):
        parallelize_attention(MultiHeadAttention(4 * D_K, 4), init_device_mesh("cpu", (1, world)))
    with pytest.raises(TypeError, match="got Linear"):
        parallelize_attention(torch.nn.Linear(4, 4), mesh)
    twice = parallelize_attention(MultiHeadAttention(4 * D_K, 4), mesh)
    with pytest.raises(ValueError, match=f"already split across {world} ranks"):
        parallelize_attention(twice, mesh)


def world_checks(rank, world):
    check_matches_unsharded(world)
    check_errors(world)


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_attention_equals_the_unsharded_module(world):
    run_ranks(world, world_checks)
