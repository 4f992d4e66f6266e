"""The context_parallel suite: mha_ext.distributed.context_parallel_attention on spawned ranks.

For ring and ulysses, forward and forward + backward, causal, each sequence length: the step
time on `world` CPU ranks (one gloo process each; per repeat the slowest rank's time, median
over repeats) against one process attending the full sequence with the same thread count, and
per rank:

- bytes sent: counted in the implementation under test by wrapping the torch.distributed calls
  it makes (METERED_CALLS): the bytes batch_isend_irecv's sends carry, and for the collectives
  the bytes the call must deliver to other ranks (its own chunk stays home);
- compute-only time: the same step with those calls replaced by local stand-ins that move no
  data between ranks (a receive's buffer is zeroed, so the kernels see finite numbers);
- communication-only time: the calls of one step replayed in order on buffers of the same
  sizes, with no compute between them;
- share of communication hidden behind compute: 1 - (step - compute-only) / communication-only,
  clipped to [0, 1] (1: the step takes no longer than its compute alone; 0: none overlaps);
- peak memory: the step's peak anonymous resident memory above what the rank held before it,
  sampled every MEMORY_SAMPLE_SECONDS (the single process: the same on the full sequence).
"""

import contextlib
import datetime
import inspect
import os
import socket
import statistics
import threading
import time
from typing import Callable, Dict, List, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .. import functional

SUITE = "context_parallel"
STRATEGIES = ("ring", "ulysses")
# Batch 1, 8 heads (ulysses splits heads: 8 serves worlds 2, 4 and 8), head dims 64 and 128.
BATCH, HEADS = 1, 8
CAUSAL = "top_left"  # self-attention: both alignments are the same mask
TIMEOUT = datetime.timedelta(seconds=120)
MEMORY_SAMPLE_SECONDS = 5e-4
# The torch.distributed calls of a context-parallel step that the meter wraps.
METERED_CALLS = ("batch_isend_irecv", "all_to_all_single", "all_to_all", "all_gather")


class _Done:
    """The handle of an async call that the meter ran locally: nothing to wait for."""

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True


def _fresh(value):
    """value with each tensor (also inside lists and P2POps) replaced by an empty one alike,
    for replays that must not write into the step's tensors."""
    if isinstance(value, torch.Tensor):
        return torch.empty_like(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_fresh(item) for item in value)
    if isinstance(value, dist.P2POp):
        return dist.P2POp(
            value.op,
            torch.empty_like(value.tensor),
            group=value.group,
            tag=value.tag,
            group_peer=value.group_peer,
        )
    return value


def _wait(handle):
    for work in handle if isinstance(handle, list) else [handle]:
        if work is not None:
            work.wait()


class CommunicationMeter:
    """Wraps METERED_CALLS: counts the bytes each call sends from this rank, records the
    first step's calls for replay, and with skip=True runs them locally instead."""

    def __init__(self):
        self.bytes_sent = 0
        self.recording = False
        self.skip = False
        self.replays: List[Callable[[], None]] = []
        self._originals = {name: getattr(dist, name) for name in METERED_CALLS}

    @contextlib.contextmanager
    def installed(self, modules: Sequence):
        """The calls wrapped in torch.distributed and in each of `modules` that holds them
        under their own names (from torch.distributed import ...)."""
        patched = []
        for module in (dist, *modules):
            for name in METERED_CALLS:
                if getattr(module, name, None) is self._originals[name]:
                    patched.append((module, name))
                    setattr(module, name, self._wrapper(name))
        try:
            yield self
        finally:
            for module, name in patched:
                setattr(module, name, self._originals[name])

    def _wrapper(self, name):
        original = self._originals[name]
        signature = inspect.signature(original)

        def call(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            arguments = bound.arguments
            self.bytes_sent += _bytes_sent(name, arguments)
            if self.skip:
                _run_locally(name, arguments)
                if name == "batch_isend_irecv":
                    return [_Done() for _ in arguments["p2p_op_list"]]
                return _Done() if arguments.get("async_op") else None
            if self.recording:
                replay = {key: _fresh(value) for key, value in arguments.items()}
                self.replays.append(lambda: _wait(original(**replay)))
            return original(*args, **kwargs)

        return call


def _bytes_sent(name, arguments) -> int:
    if name == "batch_isend_irecv":
        ops = arguments["p2p_op_list"]
        return sum(_nbytes(op.tensor) for op in ops if op.op is dist.isend)
    ranks = dist.get_world_size(arguments.get("group"))
    rank = dist.get_rank(arguments.get("group"))
    if name == "all_to_all_single":
        source = arguments["input"]
        splits = arguments["input_split_sizes"] or [source.shape[0] // ranks] * ranks
        row_bytes = _nbytes(source) // max(source.shape[0], 1)
        return (source.shape[0] - splits[rank]) * row_bytes
    if name == "all_to_all":
        sources = arguments["input_tensor_list"]
        return sum(_nbytes(t) for index, t in enumerate(sources) if index != rank)
    return _nbytes(arguments["tensor"]) * (ranks - 1)  # all_gather


def _run_locally(name, arguments):
    """The call's effect on this rank's buffers, with no data from other ranks."""
    if name == "batch_isend_irecv":
        for op in arguments["p2p_op_list"]:
            if op.op is not dist.isend:
                op.tensor.zero_()
    elif name == "all_to_all_single":
        arguments["output"].copy_(arguments["input"].reshape(arguments["output"].shape))
    elif name == "all_to_all":
        for target, source in zip(arguments["output_tensor_list"], arguments["input_tensor_list"]):
            target.copy_(source.reshape(target.shape))
    else:
        for target in arguments["tensor_list"]:
            target.copy_(arguments["tensor"])


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _anonymous_resident_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def peak_memory_bytes(step: Callable[[], None]) -> int:
    """The peak anonymous resident memory during step() above the memory before it."""
    before = _anonymous_resident_bytes()
    peak = before
    done = threading.Event()

    def sample():
        nonlocal peak
        while not done.is_set():
            peak = max(peak, _anonymous_resident_bytes())
            time.sleep(MEMORY_SAMPLE_SECONDS)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        step()
    finally:
        done.set()
        sampler.join()
    return max(peak, _anonymous_resident_bytes()) - before


def _timed_once(step: Callable[[], None]) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def _slowest_rank_median(step: Callable[[], None], repeats: int) -> float:
    """Median over repeats of the slowest rank's time; the ranks start each repeat together."""
    step()  # warm-up: first-touch memory, thread pools
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    per_rank: List[List[float]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(per_rank, times)
    return statistics.median(max(repeat) for repeat in zip(*per_rank))


def _attention_step(attend, inputs, backward):
    leaves = [x.detach().clone().requires_grad_(backward) for x in inputs]

    def step():
        out = attend(*leaves)
        if backward:
            out.backward(torch.ones_like(out))
            for leaf in leaves:
                leaf.grad = None

    return step


def _run_case(spec: Dict, repeats: int, meter: CommunicationMeter) -> Dict:
    # Imported in the ranks only: mha_ext.distributed loads torch.distributed.tensor (0.6 s),
    # which the other suites of python -m mha_ext.bench do not need.
    from ..distributed import context_parallel_attention, shard_sequence

    rank, ranks = dist.get_rank(), dist.get_world_size()
    seq, head_dim, dtype = spec["seq"], spec["head_dim"], getattr(torch, spec["dtype"])
    generator = torch.Generator().manual_seed(0)
    full = [
        torch.randn(BATCH, HEADS, seq, head_dim, generator=generator).to(dtype)  # (B, H, S, D)
        for _ in range(3)
    ]
    single = {}
    if rank == 0:
        full_step = _attention_step(
            lambda q, k, v: functional.attention(q, k, v, causal=CAUSAL), full, spec["backward"]
        )
        full_step()
        single["seconds"] = statistics.median(_timed_once(full_step) for _ in range(repeats))
        single["peak_memory_bytes"] = peak_memory_bytes(full_step)
    dist.barrier()

    local = [shard_sequence(x, 2) for x in full]  # (B, H, S / W, D) each, zigzag
    step = _attention_step(
        lambda q, k, v: context_parallel_attention(
            q, k, v, strategy=spec["strategy"], causal=CAUSAL
        ),
        local,
        spec["backward"],
    )
    meter.bytes_sent, meter.replays, meter.recording = 0, [], True
    step()
    meter.recording = False
    bytes_sent = meter.bytes_sent
    replays = meter.replays
    step_seconds = _slowest_rank_median(step, repeats)
    meter.skip = True
    try:
        compute_seconds = _slowest_rank_median(step, repeats)
    finally:
        meter.skip = False
    comm_seconds = _slowest_rank_median(lambda: [replay() for replay in replays], repeats)
    dist.barrier()
    peak = peak_memory_bytes(step)
    per_rank: List[Dict] = [{} for _ in range(ranks)]
    dist.all_gather_object(per_rank, {"bytes_sent": bytes_sent, "peak_memory_bytes": peak})
    exposed = max(step_seconds - compute_seconds, 0.0)
    hidden = 1.0 - exposed / comm_seconds if comm_seconds > 0 else 1.0
    direction = "forward + backward" if spec["backward"] else "forward"
    return {
        "suite": SUITE,
        "label": f"{spec['strategy']} {direction} S{seq} D{head_dim} {spec['dtype']}",
        "params": {**spec, "world": ranks, "batch": BATCH, "heads": HEADS, "causal": CAUSAL},
        "unit": "s",
        "baseline": "single_process",
        "results": {
            "context_parallel": {"seconds_per_call": step_seconds},
            "single_process": {"seconds_per_call": single.get("seconds")},
        },
        "compute_only_seconds": compute_seconds,
        "communication_only_seconds": comm_seconds,
        "hidden_communication_share": min(max(hidden, 0.0), 1.0),
        "ranks": per_rank,
        "single_process_peak_memory_bytes": single.get("peak_memory_bytes"),
        "unsupported": {},
    }


def case_specs(seqs, head_dims, dtypes) -> List[Dict]:
    return [
        {"strategy": s, "backward": b, "seq": n, "head_dim": d, "dtype": str(t).split(".")[-1]}
        for s in STRATEGIES
        for b in (False, True)
        for d in head_dims
        for t in dtypes
        for n in seqs
    ]


def _rank_main(rank, world, port, threads, specs, repeats, results_queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=TIMEOUT)
    try:
        from ..distributed import context_parallel

        meter = CommunicationMeter()
        with meter.installed([context_parallel]):
            results = [_run_case(spec, repeats, meter) for spec in specs]
        if rank == 0:
            results_queue.put(results)
        dist.barrier()  # lets Gloo's threads free the last tensors first (mha_ext/train.py)
    finally:
        dist.destroy_process_group()


def run_suite(world: int, seqs, head_dims, dtypes, repeats: int) -> List[Dict]:
    """Spawns `world` ranks (gloo, CPU) that run every case; returns rank 0's results.
    Each rank gets an equal share of this process's threads (at least one)."""
    if world < 2:
        raise ValueError(f"mha_ext.bench: --world must be at least 2 ranks, got {world}")
    bad = [n for n in seqs if n % (2 * world)]
    if bad:
        raise ValueError(
            f"mha_ext.bench: context_parallel sequence lengths must be multiples of 2 x world "
            f"= {2 * world} (zigzag's chunks), got {bad}"
        )
    threads = max(torch.get_num_threads() // world, 1)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    results_queue = mp.get_context("spawn").SimpleQueue()
    specs = case_specs(seqs, head_dims, dtypes)
    mp.spawn(
        _rank_main,
        args=(world, port, threads, specs, repeats, results_queue),
        nprocs=world,
        join=True,
    )
    results = results_queue.get()
    for result in results:
        result["params"]["threads_per_rank"] = threads
    return results
