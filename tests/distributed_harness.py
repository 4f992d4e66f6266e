"""Running a test function on W spawned processes that form a gloo process group.

Spawning a group costs a few seconds (each process imports torch and mha_ext), so a test
runs many checks inside one worker. Each process uses one thread (the machine has 2 cores
for up to 4 ranks). A rank that raises ends the run: the others are terminated and the
error is raised in the test; the group's timeout and run_ranks' deadline bound a hang.
"""

import datetime
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Long enough for a loaded 2-core machine to run every rank's checks between two
# collectives; short enough that a lost rank fails the test within a minute.
GROUP_TIMEOUT_S = 60


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _run_rank(rank: int, world_size: int, port: int, worker, args) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S),
    )
    try:
        worker(rank, world_size, *args)
        # Gloo's worker threads may still be freeing the last collective's tensors, which
        # takes the GIL, and abort the process if the interpreter shuts down meanwhile
        # (pytorch/pytorch#117762): the barrier's wait gives them the GIL. Only when every
        # rank got here; after an error the others may be inside a collective.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(worker, world_size: int, *args, timeout_s: float = 3 * GROUP_TIMEOUT_S) -> None:
    """Runs worker(rank, world_size, *args) on world_size spawned processes of one gloo
    group. worker must be a module-level function (spawn imports it by name). Raises
    torch.multiprocessing's ProcessRaisedException (carrying the rank's traceback) when a
    rank raises, TimeoutError when the ranks are not done within timeout_s."""
    context = mp.start_processes(
        _run_rank,
        args=(world_size, free_port(), worker, args),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=max(deadline - time.monotonic(), 0.0)):
        if time.monotonic() >= deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            raise TimeoutError(
                f"run_ranks: {worker.__name__} on {world_size} ranks did not finish in "
                f"{timeout_s} s"
            )
