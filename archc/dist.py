"""A rank's process groups: joining the default group of a run, and its "tp" and "cp" groups.

A run of tensor parallelism ``tp`` and context parallelism ``cp`` has ``tp · cp`` ranks in one
torch.distributed default group. The layout is tp-major: global rank ``g = c · tp + t`` is tp
rank ``t`` of cp group ``c`` — the ``tp`` consecutive ranks ``c · tp … c · tp + tp − 1`` form
a tensor-parallel group (the chattiest group on the nearest devices: neighbouring GPUs of one
node), and ranks ``t, t + tp, …, t + (cp − 1) · tp`` a context-parallel ring.

A rank started by torchrun, or by ``archc run SRC --tp N`` (``archc.commands.launch``), finds
RANK and WORLD_SIZE set and joins the default group (``init_from_env``) — NCCL on GPUs, gloo on
CPUs — with a timeout: a collective that waits longer on a rank that died fails rather than
hangs. Which tensors a rank reads of a checkpoint is the sharded program's
(``archc.passes.slices``).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
from typing import Any

from archc.errors import ArchcError
from archc.runtime.comm import PEER_ERRORS, Comm, LocalComm, TorchComm, peer_lost

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
    except PEER_ERRORS as err:
        raise peer_lost(dist.get_rank(), f"making the {name} group of ranks "
                        f"{', '.join(map(str, ranks))}", err) from None


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


# ---- joining the run's default group --------------------------------------------------------

def under_launcher() -> bool:
    """Was this process started as one rank of several (torchrun, or ``archc.commands.launch``)?"""
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
        try:
            dist.init_process_group("nccl" if gpu else "gloo",
                                    timeout=datetime.timedelta(seconds=timeout))
        except PEER_ERRORS as err:   # a rank that stopped while the others were joining
            raise peer_lost(int(os.environ["RANK"]), "joining the run's process group",
                            err) from None
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
