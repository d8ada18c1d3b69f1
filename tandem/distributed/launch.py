"""Starting the ranks of a tensor-parallel run: torchrun's environment, the process group, the rank's cores.

`tandem bench --gpus N` (and `generate`) start themselves again under torchrun (`relaunch`), one process per
GPU; a script run with `torchrun --nproc-per-node N` calls `init_ranks` itself. Each rank then:

- binds to the cores of its GPU's NUMA node (shared evenly with the other ranks whose GPU sits on that node;
  all the process's cores, shared evenly, where the machine reports no NUMA placement), before any CPU
  attention thread exists, so its host tier's pages and its CPU attention stay next to its GPU and the ranks'
  threads never compete for a core; `TandemConfig.host.threads` then defaults to `rank_threads` of that
  share ($TANDEM_CPU_THREADS);
- joins the process group: NCCL on CUDA, gloo on the CPU (tests run the same collectives there).

A rank that stops before a collective leaves the others waiting: the group's timeout (`TIMEOUT_S`) ends them
with an error instead of a hang. A rank ends with `exit_rank`.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import CPU_THREADS_ENV
from .tensor_parallel import Rank

TIMEOUT_S = 600  # a collective waiting longer than this ends the run (a 128K prefill chunk takes seconds)
EXIT_GRACE_S = 10


def run_on_ranks(args, body, command: str) -> int:
    """`body(args)` for a command with `--gpus`: on one GPU as it is; with `--gpus N` outside torchrun, the
    command again as N ranks (`relaunch`), once the GPU count and the model's split are checked here; on a rank,
    then `exit_rank` with its status, an error printed as `tandem` prints errors (a rank's traceback would
    interleave with the others')."""
    if isinstance(args.gpus, bool) or not isinstance(args.gpus, int) or args.gpus < 1:
        raise ValueError(f"--gpus must be an integer >= 1, got {args.gpus!r}")
    if args.gpus > 1 and not in_launch():
        if getattr(args, "argv", None) is None:
            raise ValueError(
                f"--gpus N starts N processes from the command line: run `tandem {command} --gpus N`"
            )
        check_launch(args.gpus, args.device, args.model)
        return relaunch(args.gpus, args.argv)
    if not in_launch():
        return body(args)
    code = 2
    try:
        code = body(args)
    except BaseException as err:
        message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        # sys.__stderr__: a rank other than 0 may have silenced sys.stderr, not its errors. One write with its
        # newline: print() writes the two apart, and the ranks' lines then interleave in the shared stderr
        sys.__stderr__.write(f"tandem: error (rank {os.environ.get('RANK')}): {message}\n")
        sys.__stderr__.flush()
    exit_rank(code)


def in_launch() -> bool:
    """Whether this process is one of torchrun's ranks."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def check_launch(world: int, device: str | None, model: str | None) -> None:
    """Refuse, before any rank starts, more ranks than the host has GPUs and a model that does not split over
    `world` of them (ValueError naming the allowed values)."""
    from ..models import resolve_device

    if resolve_device(device).type == "cuda" and torch.cuda.device_count() < world:
        count = torch.cuda.device_count()
        raise ValueError(f"--gpus {world}: this host has {count} CUDA device(s); allowed 1-{count}")
    from transformers import AutoConfig

    from .. import shapes
    from ..models import locate_model
    from .tensor_parallel import check_shardable

    if model in shapes.SHAPES:
        config = shapes.shape_config(model)
    else:
        _, location, extra, _ = locate_model(model)
        config = AutoConfig.from_pretrained(location, local_files_only=True, **extra)
    check_shardable(config, world)


def relaunch(num_ranks: int, argv: list[str]) -> int:
    """Run `tandem <argv>` as `num_ranks` processes under torchrun's launcher on this host (a free port is
    picked); returns the exit status of the run: 0, or the largest a failed rank returned. The ranks print their
    own errors; the launcher's report of them, a traceback, is not printed."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    # set, torchrun prints no banner about it; each rank then sets its own (init_ranks)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    launch_args = get_args_parser().parse_args(
        ["--standalone", f"--nproc-per-node={num_ranks}", "-m", "tandem.cli", *argv]
    )
    try:
        run(launch_args)
    except ChildFailedError as err:
        codes = [failure.exitcode for failure in err.failures.values()]
        return max((code for code in codes if code > 0), default=1)
    return 0


def init_ranks(device_type: str, expected_world: int | None = None) -> Rank:
    """Join the process group torchrun described and bind this rank's cores; returns the `Rank`.

    device_type: "cuda" (rank i takes GPU LOCAL_RANK, NCCL) or "cpu" (gloo). Raises ValueError outside
    torchrun, for a world other than `expected_world`, or for more ranks on this host than GPUs."""
    if not in_launch():
        raise ValueError(
            "init_ranks runs under torchrun (WORLD_SIZE and RANK unset): use --gpus N or torchrun"
        )
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if expected_world is not None and world != expected_world:
        raise ValueError(f"--gpus {expected_world} but torchrun started {world} ranks: pass the same number")
    if device_type == "cuda":
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise ValueError(f"gpus={local_world} on a host with {count} CUDA device(s): allowed 1-{count}")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    elif device_type == "cpu":
        device, backend = torch.device("cpu"), "gloo"
    else:
        raise ValueError(f"device_type must be 'cuda' or 'cpu', got {device_type!r}")
    cores = rank_cores(local_rank, local_world, device)
    if cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)
        threads = str(rank_threads(len(cores), world))
        # torchrun sets OMP_NUM_THREADS=1 for every rank; the CPU kernels read it as their thread count
        os.environ["OMP_NUM_THREADS"] = os.environ[CPU_THREADS_ENV] = threads
        torch.set_num_threads(int(threads))
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    return Rank(rank, world, device)


def rank_cores(local_rank: int, local_world: int, device: torch.device) -> list[int]:
    """The cores rank `local_rank` of `local_world` on this host takes: its GPU's NUMA node's cores (of those
    this process may use), split evenly among the ranks whose GPU is on that node; without NUMA placement, all
    usable cores split evenly among the ranks. Empty where the platform cannot say."""
    if not hasattr(os, "sched_getaffinity"):
        return []
    usable = sorted(os.sched_getaffinity(0))
    nodes = [
        _numa_node(torch.device("cuda", i)) if device.type == "cuda" else None for i in range(local_world)
    ]
    pool, sharers = usable, list(range(local_world))
    node = nodes[local_rank]
    if node is not None:
        on_node = [c for c in usable if c in _node_cpus(node)]
        if len(on_node) >= sum(1 for n in nodes if n == node):
            pool, sharers = on_node, [i for i, n in enumerate(nodes) if n == node]
    share = len(pool) // len(sharers)
    if share < 1:
        return []
    index = sharers.index(local_rank)
    return pool[index * share : (index + 1) * share]


def _numa_node(device: torch.device) -> int | None:
    """The NUMA node of a CUDA device's PCI slot (sysfs), None where unknown or the machine has one node."""
    if not torch.cuda.is_available() or device.index is None or device.index >= torch.cuda.device_count():
        return None
    props = torch.cuda.get_device_properties(device)
    bus = getattr(props, "pci_bus_id", None)
    if bus is None:
        return None
    address = f"{getattr(props, 'pci_domain_id', 0):04x}:{bus:02x}:{getattr(props, 'pci_device_id', 0):02x}.0"
    try:
        node = int(Path(f"/sys/bus/pci/devices/{address}/numa_node").read_text())
    except (OSError, ValueError):
        return None
    return node if node >= 0 and len(_all_nodes()) > 1 else None


def _all_nodes() -> list[int]:
    root = Path("/sys/devices/system/node")
    return sorted(int(p.name[4:]) for p in root.glob("node[0-9]*")) if root.is_dir() else []


def _node_cpus(node: int) -> set[int]:
    try:
        text = Path(f"/sys/devices/system/node/node{node}/cpulist").read_text().strip()
    except OSError:
        return set()
    cpus: set[int] = set()
    for part in filter(None, text.split(",")):
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def rank_threads(cores: int, world: int) -> int:
    """CPU attention threads of a rank with `cores` cores: all but one on one GPU; with several ranks three
    quarters of them less one, leaving the rest to the rank's other threads (its graph launcher, NCCL's proxy,
    Python): every collective waits for the slowest rank, so all but one core per rank made the steps slower and
    their tails longer (docs/distributed.md § The rank's cores)."""
    if world <= 1:
        return max(1, cores - 1)
    return max(1, 3 * cores // 4 - 1)


def all_ok(rank: Rank, ok: bool) -> bool:
    """Whether every rank passed ok=True (a collective: every rank must call it)."""
    flag = torch.tensor([1 if ok else 0], device=rank.device if rank.backend == "nccl" else "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=rank.group)
    return bool(flag.item())


def merged_row(rank: Rank, row: dict) -> dict:
    """One result row for all ranks (a collective): rank 0's measurements, or the first failed rank's status
    and error (named by rank) where any rank failed; `ranks` says how many GPUs the row ran on."""
    rows: list = [None] * rank.world
    dist.all_gather_object(rows, row, group=rank.group)
    merged = dict(rows[0], ranks=rank.world)
    for i, other in enumerate(rows):
        if other["status"] != "ok":
            merged.update(status=other["status"], error=f"rank {i}: {other.get('error')}")
            break
    return merged


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def exit_rank(code: int):
    """End this rank's process with `code`: output flushed, the process group left, then `os._exit`. Tearing
    down an NCCL group whose collectives CUDA graphs recorded can block for good (seen with torch 2.11 on 2
    H100s), as can the interpreter's own exit then: the group gets `EXIT_GRACE_S` to leave."""
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        if stream is not None:
            stream.flush()
    if dist.is_initialized():
        leaving = threading.Thread(target=dist.destroy_process_group, daemon=True)
        leaving.start()
        leaving.join(EXIT_GRACE_S)
    os._exit(code)
