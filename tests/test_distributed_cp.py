"""Context-parallel attention (mha_ext.distributed) on gloo process groups of spawned ranks.

Each spawned test runs many cases in one group (a group costs seconds to start); every rank
checks its own shard of the output, lse and gradients against the float64 reference of the
whole sequence, within the tolerance rule of conftest.py.
"""

import itertools
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from distributed_harness import run_ranks

from mha_ext.distributed import context_parallel_attention, gather_sequence, shard_sequence
from mha_ext.distributed.context_parallel import global_band, plan_ring_step
from mha_ext.distributed.sequence import chunk_count, shard_chunks
from mha_ext.reference import attention_reference
from mha_ext.train import train

from conftest import GRAD_FACTOR, OUTPUT_FACTOR, assert_within_rule

# Spawned gloo ranks on CPU tensors; the NCCL path shares the code.
pytestmark = pytest.mark.cpu_only


def _case(strategy, heads, kv_heads, q_local, k_local, dtype=torch.float32, **options):
    """One check: local sequence lengths (the whole sequence is W times longer) and the
    options of context_parallel_attention (causal, window, scale, load_balance,
    return_lse), plus layout "bshd" for (B, S, H, D) storage."""
    return dict(
        strategy=strategy,
        heads=heads,
        kv_heads=kv_heads,
        q_local=q_local,
        k_local=k_local,
        dtype=dtype,
        **options,
    )


# return_lse only where every query sees a key: a row that sees none has lse -inf, whose
# reference gradient is NaN.
CASES_2 = [
    _case("ring", 4, 4, 6, 6, return_lse=True),
    _case("ring", 4, 2, 8, 8, causal="top_left", return_lse=True, scale=0.3),
    _case("ring", 4, 1, 6, 10, causal="bottom_right", return_lse=True),
    _case("ring", 4, 2, 10, 6, causal="bottom_right"),  # the first rows see no key
    _case("ring", 4, 2, 6, 10, causal="top_left"),
    _case("ring", 4, 2, 8, 8, causal="top_left", window=(3, 0), return_lse=True),
    _case("ring", 4, 2, 7, 7, window=(2, 5), load_balance=None, layout="bshd"),
    _case("ring", 4, 2, 6, 10, window=(4, 1)),
    _case("ring", 4, 2, 8, 8, torch.bfloat16, causal="top_left", return_lse=True),
    _case("ring", 4, 2, 5, 5, torch.bfloat16, window=(5, 2), load_balance=None),
    _case("ring", 2, 1, 1, 1, causal="top_left", load_balance=None),
    _case("ulysses", 4, 2, 8, 8, causal="top_left", return_lse=True),
    _case(
        "ulysses", 4, 4, 7, 7, torch.bfloat16, causal="top_left", window=(3, 0), load_balance=None
    ),
    _case("ulysses", 4, 1, 1, 1, load_balance=None),  # 1 kv head, replicated to 2 ranks
    _case("ulysses", 4, 2, 6, 10, causal="bottom_right", layout="bshd"),
]
CASES_4 = [
    _case("ring", 4, 2, 8, 8, causal="top_left", return_lse=True),
    _case("ring", 4, 1, 6, 10, causal="bottom_right", return_lse=True),
    _case("ring", 4, 2, 8, 8, causal="top_left", window=(5, 0)),
    _case("ring", 4, 2, 7, 7, window=(2, 6), load_balance=None),
    _case("ring", 4, 2, 8, 8, torch.bfloat16, causal="top_left"),
    _case("ring", 2, 2, 1, 1, causal="top_left", load_balance=None, return_lse=True),
    _case("ulysses", 4, 2, 8, 8, causal="top_left", return_lse=True),  # 2 kv heads, 4 ranks
    _case("ulysses", 8, 8, 3, 3, torch.bfloat16, window=(4, 4), load_balance=None),
]
SUBGROUP_CASES = [
    _case("ring", 4, 2, 8, 8, causal="top_left", return_lse=True),
    _case("ulysses", 4, 2, 6, 6, causal="top_left", window=(3, 0)),
]


def _inputs(case, world_size):
    """The whole q, k, v, grad_out, grad_lse in float32, the same on every rank."""
    generator = torch.Generator().manual_seed(0)
    batch, head_dim = 2, 16
    seq_q, seq_k = world_size * case["q_local"], world_size * case["k_local"]

    def draw(heads, seq, last):
        if case.get("layout") == "bshd":
            return torch.randn(batch, seq, heads, last, generator=generator).transpose(1, 2)
        return torch.randn(batch, heads, seq, last, generator=generator)

    return (
        draw(case["heads"], seq_q, head_dim),
        draw(case["kv_heads"], seq_k, head_dim),
        draw(case["kv_heads"], seq_k, head_dim),
        draw(case["heads"], seq_q, head_dim),
        torch.randn(batch, case["heads"], seq_q, generator=generator),
    )


def _reference(q, k, v, grad_out, grad_lse, dtype, options, with_lse):
    """(out, lse, grads) of attention_reference computed in dtype."""
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    out, lse = attention_reference(*leaves, **options)
    loss = (out * grad_out.to(dtype)).sum()
    if with_lse:
        loss = loss + (lse * grad_lse.to(lse.dtype)).sum()
    loss.backward()
    return out.detach(), lse.detach(), [leaf.grad for leaf in leaves]


def _check_case(case, world_size, group=None):
    dtype, with_lse = case["dtype"], case.get("return_lse", False)
    load_balance = case.get("load_balance", "zigzag")
    options = {name: case[name] for name in ("causal", "window", "scale") if name in case}
    q, k, v, grad_out, grad_lse = _inputs(case, world_size)
    ref = _reference(q, k, v, grad_out, grad_lse, torch.float64, options, with_lse)
    plain = _reference(q, k, v, grad_out, grad_lse, dtype, options, with_lse)

    def shard(x):
        return shard_sequence(x, 2, group, load_balance)

    leaves = [shard(t.to(dtype)).detach().requires_grad_() for t in (q, k, v)]
    result = context_parallel_attention(
        *leaves,
        group=group,
        strategy=case["strategy"],
        load_balance=load_balance,
        return_lse=with_lse,
        **options,
    )
    out, lse = result if with_lse else (result, None)
    loss = (out * shard(grad_out).to(dtype)).sum()
    if with_lse:
        loss = loss + (lse * shard(grad_lse)).sum()
    loss.backward()

    what = f"{case} on {world_size} ranks"
    assert out.dtype == dtype and out.shape == shard(ref[0]).shape, what
    assert_within_rule(out, shard(ref[0]), shard(plain[0]), OUTPUT_FACTOR, f"out of {what}")
    if with_lse:
        assert lse.dtype == torch.float32, what
        assert_within_rule(lse, shard(ref[1]), shard(plain[1]), OUTPUT_FACTOR, f"lse of {what}")
    for name, leaf, ref_grad, plain_grad in zip("qkv", leaves, ref[2], plain[2]):
        assert leaf.grad.dtype == dtype, what
        assert_within_rule(
            leaf.grad, shard(ref_grad), shard(plain_grad), GRAD_FACTOR, f"grad_{name} of {what}"
        )
    whole = gather_sequence(out.detach(), 2, group, load_balance)
    assert torch.equal(shard(whole), out.detach()), f"gather_sequence of {what}"


def _check_cases(rank, world_size, cases):
    for case in cases:
        _check_case(case, world_size)
    if world_size == 4:
        # Groups of ranks {0, 2} and {1, 3}, as one dimension of a 2 x 2 device mesh: group
        # ranks and neighbours differ from the global ones.
        groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        for case in SUBGROUP_CASES:
            _check_case(case, 2, groups[rank % 2])
    x = torch.arange(24 * world_size**2).reshape(4 * world_size, 6 * world_size)
    for load_balance, dim in itertools.product(("zigzag", None), (0, 1)):
        part = shard_sequence(x, dim, load_balance=load_balance)
        assert torch.equal(gather_sequence(part, dim, load_balance=load_balance), x)
    first, second = shard_sequence(torch.arange(4 * world_size), 0).tensor_split(2)
    assert first.tolist() == list(range(2 * rank, 2 * rank + 2))
    last = 4 * world_size - 2 * rank
    assert second.tolist() == list(range(last - 2, last)), "zigzag: chunks r and 2W-1-r"


@pytest.mark.parametrize("world_size, cases", [(2, CASES_2), (4, CASES_4)], ids=["2", "4"])
def test_context_parallel_matches_whole_sequence(world_size, cases):
    run_ranks(_check_cases, world_size, cases)


def _raises(error, match, call):
    with pytest.raises(error, match=match):
        call()


def _check_errors(rank, world_size):
    q = torch.randn(1, 4, 4, 8)
    cp = context_parallel_attention
    _raises(ValueError, "dropout_p must be 0", lambda: cp(q, q, q, dropout_p=0.1))
    _raises(ValueError, "strategy must be", lambda: cp(q, q, q, strategy="tree"))
    _raises(ValueError, "load_balance must be", lambda: cp(q, q, q, load_balance="random"))
    odd = torch.randn(1, 4, 5, 8)
    _raises(ValueError, "q's seq_local 5 must be even and positive", lambda: cp(odd, q, q))
    three_heads = torch.randn(1, 3, 4, 8)
    _raises(
        ValueError,
        "q has 3 heads, which the world size 2 does not divide",
        lambda: cp(three_heads, three_heads, three_heads, strategy="ulysses"),
    )
    _raises(ValueError, "must agree", lambda: cp(q, torch.randn(1, 3, 4, 8), q))
    _raises(ValueError, "window must be a pair", lambda: cp(q, q, q, window=(2,)))
    # Options or shapes that differ across ranks raise on every rank, not hang.
    mine = torch.randn(1, 4, 4 + 2 * rank, 8)
    _raises(
        ValueError,
        r"disagree on q seq_local, k seq_local \(by group rank: \{0: \{'q seq_local': 4",
        lambda: cp(mine, mine, mine),
    )
    window = (1, 0) if rank == 0 else (2, 0)
    _raises(ValueError, "disagree on window_left", lambda: cp(q, q, q, window=window))
    _raises(
        ValueError,
        "has size 6, which does not split into 4 equal chunks",
        lambda: shard_sequence(torch.zeros(2, 6), 1),
    )
    # The group still works after the errors.
    assert torch.isfinite(cp(q, q, q, causal="top_left")).all()


def test_errors_name_the_argument():
    run_ranks(_check_errors, 2)


def test_needs_an_initialised_process_group():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        context_parallel_attention(q, q, q)
    with pytest.raises(RuntimeError, match="not initialised"):
        shard_sequence(q, 2)


def _fail_on_one_rank(rank, world_size):
    if rank == 1:
        raise RuntimeError("rank 1 fails on purpose")
    q = torch.randn(1, 2, 4, 8)
    context_parallel_attention(q, q, q)  # waits for rank 1 in its first collective


def test_a_failed_rank_ends_the_run():
    # The error reported is rank 1's, or rank 0's from its collective when rank 1's exit
    # reaches it first; either way the run ends instead of waiting for the dead rank.
    with pytest.raises(
        mp.ProcessRaisedException, match="rank 1 fails on purpose|in context_parallel_attention"
    ):
        run_ranks(_fail_on_one_rank, 2, timeout_s=90)


def _covered_pairs(calls, q_len, k_len):
    """How often each (query row, key row) of a ring step is computed by calls (the
    kernels' top-left window within each call's rows)."""
    count = torch.zeros(q_len, k_len, dtype=torch.int64)
    for call in calls:
        rows = torch.arange(call.q_stop - call.q_start)[:, None]
        keys = torch.arange(call.k_stop - call.k_start)[None, :]
        seen = torch.ones(rows.shape[0], keys.shape[1], dtype=torch.bool)
        if call.window_left >= 0:
            seen &= keys - rows >= -call.window_left
        if call.window_right >= 0:
            seen &= keys - rows <= call.window_right
        count[call.q_start : call.q_stop, call.k_start : call.k_stop] += seen.long()
    return count


@pytest.mark.parametrize("load_balance", ["zigzag", None])
def test_ring_plan_computes_each_visible_pair_once(load_balance):
    """Every step's calls cover the (query, key) pairs the whole sequence's mask shows,
    each once, for causal alignments, windows and q / k chunks of different lengths."""
    options = [
        (None, None),
        ("top_left", None),
        ("bottom_right", None),
        ("top_left", (3, 0)),
        (None, (2, 5)),
        (None, (0, 0)),
        ("bottom_right", (7, 2)),
        (None, (1, None)),
    ]
    for world_size, (q_chunk, k_chunk), (causal, window) in itertools.product(
        (1, 2, 3, 4), ((3, 3), (2, 5), (5, 2), (1, 1)), options
    ):
        chunks = chunk_count(world_size, load_balance)
        seq_q, seq_k = chunks * q_chunk, chunks * k_chunk
        query = torch.arange(seq_q)[:, None]
        key = torch.arange(seq_k)[None, :]
        lo, hi = global_band(causal, window, seq_q, seq_k)
        mask = torch.ones(seq_q, seq_k, dtype=torch.bool)
        if lo is not None:
            mask &= key - query >= lo
        if hi is not None:
            mask &= key - query <= hi
        for rank, step in itertools.product(range(world_size), range(world_size)):
            source = (rank - step) % world_size
            q_chunks = shard_chunks(rank, world_size, load_balance)
            kv_chunks = shard_chunks(source, world_size, load_balance)
            calls = plan_ring_step(q_chunks, kv_chunks, q_chunk, k_chunk, (lo, hi))
            rows = torch.cat([torch.arange(c * q_chunk, (c + 1) * q_chunk) for c in q_chunks])
            keys = torch.cat([torch.arange(c * k_chunk, (c + 1) * k_chunk) for c in kv_chunks])
            expected = mask[rows][:, keys].long()
            covered = _covered_pairs(calls, len(rows), len(keys))
            assert torch.equal(covered, expected), (
                f"W={world_size} rank {rank} step {step} {causal} {window} "
                f"chunks {q_chunk}/{k_chunk}: {calls}"
            )


def test_causal_zigzag_skips_masked_blocks():
    """Causal zigzag: off the diagonal every step is one call over half the block (one
    query chunk against both key chunks or both against one), and the diagonal is one
    causal call over the whole block."""
    chunk = 4
    for world_size in (2, 4):
        band = global_band("top_left", None, 2 * world_size * chunk, 2 * world_size * chunk)
        for rank in range(world_size):
            for step in range(world_size):
                source = (rank - step) % world_size
                calls = plan_ring_step(
                    shard_chunks(rank, world_size, "zigzag"),
                    shard_chunks(source, world_size, "zigzag"),
                    chunk,
                    chunk,
                    band,
                )
                assert len(calls) == 1, calls
                call = calls[0]
                area = (call.q_stop - call.q_start) * (call.k_stop - call.k_start)
                assert area == (4 if step == 0 else 2) * chunk * chunk
                assert (call.window_left, call.window_right) == ((-1, 0) if step == 0 else (-1, -1))


# The training example's losses on 2 ranks against one process: the sums run in another
# order (per shard, then across ranks): within 1e-6 of each other at a loss of ~3.5 over
# 20 steps (the printed 6 decimals), so 1e-5 leaves room without hiding a real error.
TRAIN_ARGS = dict(steps=3, batch=2, context=32)
LOSS_TOLERANCE = 1e-5


def test_training_example_matches_one_process():
    expected = train(**TRAIN_ARGS, log=False)
    # torchrun (torch.distributed.run) with the command line of the README, importing
    # mha_ext as this process does (the installed package in CI, not the source tree).
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", "-m", "mha_ext.train", "--context-parallel", "ring"]
    command += [f"--{name}={value}" for name, value in TRAIN_ARGS.items()]
    result = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    printed = [float(loss) for loss in re.findall(r"step +\d+  loss ([0-9.]+)", result.stdout)]
    assert printed == pytest.approx(expected, rel=0, abs=LOSS_TOLERANCE), result.stdout
