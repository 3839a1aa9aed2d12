"""Running on many processes: a rank's process groups, and the local launcher.

A run of tensor parallelism ``tp`` and context parallelism ``cp`` has ``tp · cp`` ranks in one
torch.distributed default group. The layout is tp-major: global rank ``g = c · tp + t`` is tp
rank ``t`` of cp group ``c`` — the ``tp`` consecutive ranks ``c · tp … c · tp + tp − 1`` form
a tensor-parallel group (the chattiest group on the nearest devices: neighbouring GPUs of one
node), and ranks ``t, t + tp, …, t + (cp − 1) · tp`` a context-parallel ring.

``archc run SRC --tp N [--cp M]`` started by hand spawns the ``N · M`` workers on this machine
itself, through torch.distributed's elastic launcher (``launch``); started by ``torchrun
--nproc-per-node N·M -m archc run SRC --tp N`` (RANK and WORLD_SIZE set) each process is the
rank torchrun made it (``init_from_env``). Each worker joins the default group — NCCL on GPUs,
gloo on CPUs — with a timeout: a collective that waits longer on a rank that died fails
rather than hangs, and a worker that dies makes the launcher stop the others and report it.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import sys
import time
from collections.abc import Sequence
from typing import Any

from archc.errors import ArchcError, RunError
from archc.ir.attrs import Call
from archc.ir.graph import Graph, Program
from archc.ir.ops import Op, canonical
from archc.ir.paramexpr import leaves, shard
from archc.quant.tensor import Weight
from archc.runtime.comm import Comm, LocalComm, TorchComm

# Test hook: a worker whose rank this names exits at once with status 3 after joining the group,
# the way a rank that crashes does — how the tests check that the others stop with an error.
EXIT_RANK_VARIABLE = "ARCHC_TEST_EXIT_RANK"


def parallel_sizes(tp: Any, cp: Any) -> tuple[int, int]:
    """tp and cp checked: whole numbers ≥ 1."""
    for name, value in (("tp", tp), ("cp", cp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ArchcError(f"{name} must be a whole number ≥ 1, got {value!r}")
    return tp, cp


def groups(tp: int, cp: int, timeout: float | None = None) -> dict[str, Comm]:
    """This rank's communicators of the "tp" and "cp" groups, over the initialized default
    process group of tp · cp ranks (laid out tp-major, as the module says). Every rank must
    call it, in the same order: creating a group is itself collective. Each group waits
    `timeout` seconds for a rank (default: as long as the default group does), in its creation
    and in every collective on it."""
    import torch.distributed as dist
    want = tp * cp
    if not dist.is_available() or not dist.is_initialized():
        raise ArchcError(f"tp={tp}, cp={cp} runs on {want} ranks: initialize a torch.distributed "
                         f"process group of {want} processes first (torch.distributed."
                         "init_process_group, or start with torchrun), or use `archc run "
                         "--tp`, which starts them")
    world = dist.get_world_size()
    if world != want:
        raise ArchcError(f"tp={tp} × cp={cp} needs {want} ranks; the process group has {world}")
    rank = dist.get_rank()
    wait = datetime.timedelta(seconds=timeout) if timeout is not None else group_timeout()
    out: dict[str, Comm] = {}
    # every rank creates every group (new_group is collective), keeping its own; a group of
    # every rank is the default group itself (nothing to create, nothing to wait for)
    for name, size, members in (
            ("tp", tp, [[c * tp + t for t in range(tp)] for c in range(cp)]),
            ("cp", cp, [[c * tp + t for c in range(cp)] for t in range(tp)])):
        for ranks in members:
            if size == 1:
                if rank in ranks:
                    out[name] = LocalComm()
                continue
            group = dist.group.WORLD if size == world else _new_group(name, ranks, wait)
            if rank in ranks:
                out[name] = TorchComm(group)
    return out


def _new_group(name: str, ranks: list[int], timeout: datetime.timedelta) -> object:
    """A new process group of `ranks` that waits `timeout` for any of them — torch's own
    default (30 minutes for gloo) would hang a run on a rank that died for as long — and
    that, when one does not come, fails with a RunError naming the group."""
    import torch.distributed as dist
    try:
        return dist.new_group(ranks, timeout=timeout)
    except RuntimeError as err:   # torch's DistBackendError and gloo's errors
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise RunError(f"rank {dist.get_rank()}: making the {name} group of ranks "
                       f"{', '.join(map(str, ranks))} failed — another rank stopped or did "
                       f"not answer within the timeout ({first})") from None


def group_timeout() -> datetime.timedelta:
    """How long the default process group waits for a rank: the timeout it was initialized
    with (`init_process_group(timeout=…)`, `archc run --timeout`). torch keeps it in the
    group's backend options and has no public getter; where those cannot be read, its own
    default."""
    import torch
    import torch.distributed as dist
    world = dist.group.WORLD
    for device in ("cuda", "cpu"):
        with contextlib.suppress(Exception):   # a backend this group does not have
            found = world._get_backend(torch.device(device)).options._timeout
            if isinstance(found, datetime.timedelta):
                return found
    return dist.default_pg_timeout


# ---- starting the ranks ----------------------------------------------------------------------

def under_launcher() -> bool:
    """Was this process started as one rank of several (torchrun, or `launch` below)?"""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_from_env(world: int, timeout: float, device: str | None) -> int:
    """Join the default process group as the rank the environment names (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT); returns the rank. NCCL when `device` is a GPU, else gloo.
    Ranks other than 0 stop writing to standard output: rank 0 speaks for the run."""
    import torch
    import torch.distributed as dist
    size = int(os.environ["WORLD_SIZE"])
    if size != world:
        raise ArchcError(f"--tp × --cp is {world} ranks; this process was started as one of "
                         f"{size} (WORLD_SIZE)")
    if not dist.is_initialized():
        device = device or "auto"
        gpu = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
        if gpu:   # one GPU per rank of this node
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if gpu else "gloo",
                                timeout=datetime.timedelta(seconds=timeout))
    rank = dist.get_rank()
    if os.environ.get(EXIT_RANK_VARIABLE) == str(rank):
        os._exit(3)
    if rank != 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the rest of the process
    return rank


def leave() -> None:
    """Leave the default process group this process joined (its threads stopped before the
    interpreter exits, which would otherwise abort a rank that has finished)."""
    import torch.distributed as dist
    if dist.is_initialized():
        # a group whose peers are gone has nothing left to leave
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def free_port() -> int:
    """A TCP port on localhost that nothing listens on now (the rendezvous's)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(argv: Sequence[str]) -> int:
    """One spawned rank: the same command line, run as the rank the launcher made this."""
    from archc.cli import main
    try:
        rc = main(list(argv))
    except Exception:   # a bug, not bad input: its traceback, then the launcher's one line
        import traceback
        traceback.print_exc()
        raise SystemExit(1) from None
    if rc:
        raise SystemExit(rc)
    return 0


# the exit statuses of an error archc reported itself (ArchcError: bad input, a failed run)
REPORTED = (1, 2)


def check_before_launch(args: Any) -> None:
    """What can be refused before any rank starts: a source that does not shard over --tp or
    run as a ring over --cp (every rank would refuse it, each after loading). Its weights as
    they will be held — quantized in the file, or by --quantize — since a quantized weight
    splits along K only on whole groups."""
    from archc.commands.common import quant_of
    from archc.ir.lower import lower
    from archc.passes.context import context_parallel
    from archc.passes.shard import shard_program
    spec, quant = quant_of(args)
    program = lower(spec, quant=quant)
    if args.tp > 1:
        program = shard_program(program, args.tp)
    if args.cp > 1:
        context_parallel(program, args.cp)


def launch(argv: Sequence[str], world: int, timeout: float) -> int:
    """Run the command `argv` as `world` local ranks (torch.distributed's elastic launcher,
    no restarts); returns rank 0's exit status. A rank that fails stops the others: the result
    is one error naming it, its exit status and how long the run had gone."""
    import logging

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch
    # the launcher logs every failure with its traceback; the one line below says it instead
    for name in ("torch.distributed.elastic", "torch.multiprocessing"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    port = free_port()
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=world, run_id=f"archc-{port}",
                          rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{port}",
                          rdzv_configs={"timeout": int(timeout)}, max_restarts=0,
                          monitor_interval=0.5, start_method="spawn")
    start = time.monotonic()
    try:
        elastic_launch(config, _worker)(list(argv))
    except ChildFailedError as err:
        own = err.failures.get(0)
        if own is not None and all(f.exitcode in REPORTED for f in err.failures.values()):
            return own.exitcode     # rank 0 said why (every rank meets the same bad input)
        raise RunError(failed_ranks(err, time.monotonic() - start)) from None
    return 0


def failed_ranks(err: Any, elapsed: float) -> str:
    """A launcher's failure as one line: each failed rank and its exit status."""
    parts = []
    for rank, failure in sorted(err.failures.items()):
        status = failure.exitcode
        how = f"was killed by signal {-status}" if status < 0 else f"exited with status {status}"
        parts.append(f"rank {rank} {how}")
    return (f"{'; '.join(parts)}; the other ranks were stopped after {elapsed:.1f} s")


# ---- a rank's slices of a checkpoint ---------------------------------------------------------

def rank_slices(sharded: Program) -> dict[str, tuple[int, int, int]]:
    """Checkpoint tensor → (dim, parts, every) for each tensor a sharded program reads only as
    ``shard(w(NAME), …)`` into a param of that name: what a rank's loader may read just its
    slice of. A tensor read any other way as well is read whole."""
    slices: dict[str, tuple[int, int, int]] = {}
    whole: set[str] = set()
    for g in sharded:
        for n in g.nodes:
            if n.op != Op.PARAM:
                continue
            expr = n.attr("expr")
            cut = _plain_shard(expr)
            if cut is not None and cut[0] == n.name:
                slices[n.name] = cut[1]
            else:
                whole.update(leaves(expr) if expr is not None else [n.name])
    return {k: v for k, v in slices.items() if k not in whole}


def _plain_shard(expr: Any) -> tuple[str, tuple[int, int, int]] | None:
    """(NAME, (dim, parts, every)) when `expr` is ``shard(w(NAME), dim, parts, every)``."""
    if not isinstance(expr, Call) or expr.fn != "shard" or len(expr.args) != 1:
        return None
    arg, kw = expr.args[0], dict(expr.kwargs)
    if not isinstance(arg, Call) or arg.fn != "w":
        return None
    return arg.args[0], (int(kw["dim"]), int(kw["parts"]), int(kw.get("every", 1)))


def rank_span(cut: tuple[int, int, int], length: int, rank: int) -> tuple[int, int, int]:
    """(dim, start, stop): the elements of `dim` (of `length` in the whole tensor) that rank
    `rank` keeps of a tensor cut `cut` — what `take_slice` takes, and a loader reads."""
    dim, parts, every = cut
    size = length // parts
    index = rank // every
    return dim, index * size, (index + 1) * size


def take_slice(w: Weight, cut: tuple[int, int, int], rank: int) -> Weight:
    """Rank `rank`'s part of `w` (a copy: the whole tensor can be let go)."""
    dim, parts, every = cut
    return shard(w, dim, parts, every, rank=rank)


def presliced(sharded: Program, names: set[str]) -> Program:
    """`sharded` reading the tensors `names` as they are: their ``shard()`` already taken when
    the checkpoint was read (``archc.load(…, tp=…, rank=…)``)."""
    graphs = []
    for g in sharded:
        nodes = tuple(n.replace(attrs=canonical(Op.PARAM, {**dict(n.attrs), "expr": None}))
                      if n.op == Op.PARAM and n.name in names and
                      (_plain_shard(n.attr("expr")) or ("",))[0] == n.name else n
                      for n in g.nodes)
        graphs.append(Graph(g.name, nodes))
    return Program(sharded.model, tuple(graphs))
