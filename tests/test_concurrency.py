"""Concurrent callers: Python threads, thread-count changes, short-lived threads and forked
processes. Nested parallel regions are checked from C++ (tests/cpp/nested_parallel_test.cpp,
run by ctest), as Python cannot call an op from inside one."""

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

import mha_ext

from memory_probe import resident_anonymous_bytes

# Threads, processes and resident memory of the CPU backend.
pytestmark = pytest.mark.cpu_only

THREADS = 4


def make_workloads():
    """Named calls of every op kind, each returning a tuple of tensors computed afresh from
    inputs made here once: forward and backward (fp32 and bf16: the bf16 kernels take kept
    workspaces), paged append into a cache of the call's own, paged attention.

    Every tensor a call makes besides the ops' own holds at most 32768 elements, below which
    torch's ops run on the calling thread (at::internal::GRAIN_SIZE): a forked child can then
    make the calls although torch's parallel ops would hang there."""
    generator = torch.Generator().manual_seed(7)

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=generator).to(dtype)

    workloads = {}
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        # (B, H, S, D) with GQA and a length that is not a multiple of any tile.
        q = randn(2, 4, 97, 32, dtype=dtype)
        k, v = randn(2, 2, 97, 32, dtype=dtype), randn(2, 2, 97, 32, dtype=dtype)
        grad_out = randn(2, 4, 97, 32, dtype=dtype)

        def forward(q=q, k=k, v=v):
            return (mha_ext.attention(q, k, v, causal="top_left"),)

        def backward(q=q, k=k, v=v, grad_out=grad_out):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out = mha_ext.attention(*leaves, causal="bottom_right")
            return (out.detach(), *torch.autograd.grad(out, leaves, grad_out))

        workloads[f"forward_{name}"] = forward
        workloads[f"backward_{name}"] = backward

    num_blocks, kv_heads, block_size, head_dim = 24, 2, 16, 32
    empty_cache = randn(num_blocks, kv_heads, block_size, head_dim)
    new_keys, new_values = randn(100, kv_heads, head_dim), randn(100, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:100]

    def append():
        k_cache, v_cache = empty_cache.clone(), empty_cache.clone()
        mha_ext.paged_kv_append(new_keys, new_values, k_cache, v_cache, slots)
        return k_cache, v_cache

    k_cache, v_cache = append()
    tables = torch.randperm(num_blocks, generator=generator).int().view(3, 8)
    seq_lens = torch.tensor([128, 77, 3], dtype=torch.int32)
    cu_seqlens_q = torch.tensor([0, 1, 6, 7], dtype=torch.int32)  # decode, prefill, decode
    queries = randn(7, 8, head_dim)

    def paged():
        return mha_ext.paged_attention(
            queries, k_cache, v_cache, tables, seq_lens, cu_seqlens_q, return_lse=True
        )

    workloads["append"] = append
    workloads["paged_attention"] = paged
    return workloads


def run_in_threads(count, body):
    """Runs body(index) in `count` threads started together; re-raises the first error."""
    start = threading.Barrier(count)
    errors = []

    def run(index):
        try:
            start.wait()
            body(index)
        except BaseException as error:  # noqa: BLE001 - handed to the test thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def assert_bitwise(results, expected, what):
    for index, (got, want) in enumerate(zip(results, expected)):
        assert torch.equal(got, want), f"{what}: result {index} differs from the serial call"


def test_threads_calling_every_op_at_once_match_serial_calls_bitwise():
    workloads = make_workloads()
    expected = {name: call() for name, call in workloads.items()}
    names = list(workloads)

    def body(index):
        for repeat in range(3):
            # Each thread its own order, so different ops overlap in each round.
            for name in names[index + repeat :] + names[: index + repeat]:
                assert_bitwise(workloads[name](), expected[name], f"thread {index}: {name}")

    run_in_threads(THREADS, body)


def test_thread_count_changes_between_calls():
    # Task splits follow the calling thread's torch.get_num_threads(): each thread sets its
    # own count between calls and must get what a serial call at that count gives.
    workloads = make_workloads()
    previous = torch.get_num_threads()
    counts = (1, 2, 3)
    try:
        expected = {}
        for count in counts:
            torch.set_num_threads(count)
            expected[count] = {name: call() for name, call in workloads.items()}

        def body(index):
            for step in range(4):
                count = counts[(index + step) % len(counts)]
                torch.set_num_threads(count)
                for name, call in workloads.items():
                    assert_bitwise(call(), expected[count][name], f"{count} threads: {name}")

        run_in_threads(len(counts), body)
    finally:
        torch.set_num_threads(previous)


def test_short_lived_threads_free_their_workspaces():
    # Each thread's bf16 backward keeps ~16 MiB of workspaces (Q^T and dO^T in bf16 and the
    # fp32 dQ partial sums: 8 heads x 4096 rows x 64 dims), which its exit must free: 40
    # threads that leaked them would add 640 MiB. malloc keeps some freed memory in its
    # per-thread arenas, so the bound is loose (measured growth: a few MiB).
    q = torch.randn(1, 8, 4096, 64).bfloat16()
    k, v = torch.randn(1, 8, 32, 64).bfloat16(), torch.randn(1, 8, 32, 64).bfloat16()
    grad_out = torch.randn(1, 8, 4096, 64).bfloat16()

    def call():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        torch.autograd.grad(mha_ext.attention(*leaves), leaves, grad_out)

    def run_threads(count):
        for _ in range(count):
            thread = threading.Thread(target=call)
            thread.start()
            thread.join()

    run_threads(10)  # malloc's arenas and the threads' stacks settle
    before = resident_anonymous_bytes()
    run_threads(40)
    growth = resident_anonymous_bytes() - before
    assert growth < 128 << 20, f"40 short-lived threads grew resident memory by {growth >> 20} MiB"


# ---------------------------------------------------------------- fork


class AttentionRows(torch.utils.data.Dataset):
    """Item i: attention over fixed inputs of seed i, computed in the DataLoader worker."""

    def __len__(self):
        return 6

    def __getitem__(self, index):
        generator = torch.Generator().manual_seed(index)
        q, k, v = (torch.randn(1, 2, 70, 32, generator=generator) for _ in range(3))
        return mha_ext.attention(q, k, v, causal="top_left")[0]


def test_dataloader_fork_workers_compute_attention():
    dataset = AttentionRows()
    expected = torch.stack([dataset[i] for i in range(len(dataset))])  # threads started here
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=2, num_workers=2, multiprocessing_context="fork", timeout=60
    )
    got = torch.cat(list(loader))
    assert torch.equal(got, expected)


FORK_CHILD_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import torch
    import mha_ext
    sys.path.insert(0, sys.argv[2])
    from test_concurrency import make_workloads

    workloads = make_workloads()
    # The parent runs every op on its threads first: libgomp's pool exists when it forks.
    expected = {name: call() for name, call in workloads.items()}
    threads = torch.get_num_threads()
    child = os.fork()
    if child == 0:
        # Results are compared through numpy: torch.equal is a parallel op, which would hang.
        def host(tensor):
            tensor = tensor.detach()
            return (tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor).numpy()

        status = 0
        try:
            assert torch.get_num_threads() == threads
            for name, call in workloads.items():
                for got, want in zip(call(), expected[name]):
                    if not (host(got) == host(want)).all():
                        print(f"forked child: {name} differs from the parent", flush=True)
                        status = 1
        except BaseException as error:
            print(f"forked child: {error!r}", flush=True)
            status = 1
        os._exit(status)
    deadline = time.monotonic() + float(sys.argv[1])
    while time.monotonic() < deadline:
        done, status = os.waitpid(child, os.WNOHANG)
        if done:
            sys.exit(os.waitstatus_to_exitcode(status))
        time.sleep(0.05)
    os.kill(child, 9)
    os.waitpid(child, 0)
    print(f"forked child with {threads} threads hung in an op", flush=True)
    sys.exit(3)
    """
)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="a 1-core machine starts no thread pool")
def test_bare_fork_child_with_the_default_thread_count_does_not_hang():
    # torch's own ops hang in such a child (libgomp waits for the parent's pool threads,
    # which fork did not copy); ours run their loops on the child's one thread instead, with
    # the parent's task split, so the child's results equal the parent's bitwise.
    result = subprocess.run(
        [sys.executable, "-c", FORK_CHILD_SCRIPT, "60", str(Path(__file__).parent)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
