"""Tensor-parallel MultiHeadAttention (mha_ext.distributed.parallelize_attention) equals the
unsharded module, outputs and gradients, on gloo with spawned CPU processes.

One spawn per world size runs every configuration (spawning and joining a process group costs
2-4 s per rank here); each rank uses one thread, and the process group times out after 60 s so
a rank that fails ends the run with an error instead of a hang.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from distributed_harness import run_ranks
from torch.distributed.device_mesh import init_device_mesh

from mha_ext import MultiHeadAttention
from mha_ext.distributed import (
    context_parallel_attention_function,
    gather_sequence,
    parallelize_attention,
    shard_sequence,
)

from conftest import GRAD_FACTOR, OUTPUT_FACTOR, assert_within_rule

# (num_heads, num_kv_heads, module options): MHA, GQA with both of its kv heads per rank at
# world 2 (one at world 4), and the per-head features that parallelize_attention must split.
CONFIGS = [
    (4, 4, {}),
    (8, 4, {}),
    (8, 4, {"bias": True, "sinks": True, "alibi": True, "window": (5, 3)}),
]
D_K = 8
BATCH, SEQ = 2, 11  # an odd sequence length: nothing lines up by accident
CP_SEQ = 12  # TP x CP: zigzag splits the sequence into 2 x 2 chunks of 3


def gathered(tensor):
    """The full tensor of a DTensor (a collective: every rank calls it), else the tensor."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def run_module(module, inputs, is_causal, cp_group=None):
    """Output and the gradients of the inputs and parameters for a fixed random upstream
    gradient; parameters by name, full tensors. With cp_group the module takes sequence
    shards: the inputs are sharded, the output and input gradients gathered, and the
    parameter gradients summed over the sequence shards."""
    full = [x.detach().clone() for x in inputs]
    upstream = torch.randn(full[0].shape, generator=torch.Generator().manual_seed(1))
    upstream = upstream.to(full[0].dtype)  # (B, S, d_model)
    if cp_group is not None:
        full = [shard_sequence(x, 1, cp_group) for x in full]
        upstream = shard_sequence(upstream, 1, cp_group)
    leaves = [x.requires_grad_() for x in full]
    out = module(*leaves, is_causal=is_causal)  # (B, S, d_model) or its sequence shard
    out.backward(upstream)
    grads = {f"input {i}": x.grad for i, x in enumerate(leaves)}
    params = {name: gathered(p.grad) for name, p in module.named_parameters()}
    if cp_group is not None:
        out = gather_sequence(out.detach(), 1, cp_group)
        grads = {name: gather_sequence(g, 1, cp_group) for name, g in grads.items()}
        for grad in params.values():
            dist.all_reduce(grad, group=cp_group)
    grads.update(params)
    return out.detach(), grads


def modules_and_inputs(heads, kv_heads, options, seq):
    """The float64 reference module, an fp32 copy, and float64 inputs x, memory, memory."""
    torch.manual_seed(0)
    reference64 = MultiHeadAttention(
        heads * D_K, heads, dropout=0.0, num_kv_heads=kv_heads, **options
    ).double()
    if reference64.sinks is not None:
        torch.nn.init.normal_(reference64.sinks)  # zero sinks would test nothing
    generator = torch.Generator().manual_seed(2)
    x, memory = (
        torch.randn(BATCH, seq, heads * D_K, generator=generator, dtype=torch.float64)
        for _ in range(2)
    )
    return reference64, copy.deepcopy(reference64).float(), (x, memory, memory)


def check_equal_to_unsharded(what, reference64, plain, sharded, inputs64, is_causal, cp_group):
    out64, grads64 = run_module(reference64, inputs64, is_causal)
    inputs = tuple(t.float() for t in inputs64)
    plain_out, plain_grads = run_module(plain, inputs, is_causal)
    out, grads = run_module(sharded, inputs, is_causal, cp_group)
    assert_within_rule(out, out64, plain_out, OUTPUT_FACTOR, f"{what}: output")
    assert grads.keys() == grads64.keys(), what
    for name, grad in grads.items():
        assert_within_rule(grad, grads64[name], plain_grads[name], GRAD_FACTOR, f"{what}: d {name}")


def check_matches_unsharded(world):
    mesh = init_device_mesh("cpu", (world,))
    for heads, kv_heads, options in CONFIGS:
        for is_causal in (False, True):
            what = f"world {world} heads {heads}/{kv_heads} {options} causal {is_causal}"
            reference64, plain, inputs64 = modules_and_inputs(heads, kv_heads, options, SEQ)
            sharded = parallelize_attention(copy.deepcopy(plain), mesh)
            assert (sharded.num_heads, sharded.num_kv_heads) == (heads // world, kv_heads // world)
            check_equal_to_unsharded(what, reference64, plain, sharded, inputs64, is_causal, None)


def check_composed_with_context_parallel():
    """World 4 as a 2 x 2 mesh: heads split over "tp", the sequence over "cp"."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    for strategy, (heads, kv_heads) in (("ring", (8, 4)), ("ring", (4, 2)), ("ulysses", (8, 4))):
        for is_causal in (False, True):
            what = f"TP x CP {strategy} heads {heads}/{kv_heads} causal {is_causal}"
            reference64, plain, inputs64 = modules_and_inputs(
                heads, kv_heads, {"window": (4, None)}, CP_SEQ
            )
            cp_group = mesh["cp"].get_group()
            sharded = parallelize_attention(copy.deepcopy(plain), mesh["tp"])
            sharded.attention_function = context_parallel_attention_function(
                group=cp_group, strategy=strategy
            )
            check_equal_to_unsharded(
                what, reference64, plain, sharded, inputs64, is_causal, cp_group
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
    if world == 4:
        check_composed_with_context_parallel()


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_attention_equals_the_unsharded_module(world):
    run_ranks(world_checks, world)
