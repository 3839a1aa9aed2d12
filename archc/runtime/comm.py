"""Communicators: what a collective op does across the ranks of one group ("tp" or "cp").

``Comm`` is what eager semantics and the runtime call. Three implementations:

- ``LocalComm``: a group of one (every collective is the identity): an unsharded run.
- ``SimulatedComm``: N ranks as N threads of one process, meeting at a barrier. The sharding
  pass's translation validation runs a sharded program this way against the unsharded one, with
  no process group; sums are taken in rank order, so every rank gets the same bits.
- ``TorchComm``: a torch.distributed process group (NCCL on GPUs, gloo on CPUs): real runs.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

import torch

from archc.errors import RunError

T = TypeVar("T")


class Comm(Protocol):
    """One rank's view of a group of `size` ranks."""

    rank: int
    size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of x (a new tensor, every rank the same bits)."""
        ...

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's x concatenated along `dim`, in rank order."""
        ...

    def reduce_scatter(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's 1/size slice along `dim` of the sum over ranks of x: the sum everywhere,
        then the slice (gloo has no reduce_scatter)."""
        return self.all_reduce(x).chunk(self.size, dim=dim)[self.rank].contiguous()

    def ring_pass(self, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Send each of xs to rank + 1 and receive the same tensors of rank − 1 (mod size)."""
        ...

    def ring_pass_start(self, xs: Sequence[torch.Tensor]) -> Callable[[], list[torch.Tensor]]:
        """``ring_pass`` begun: calling the result waits and gives rank − 1's tensors. A
        communicator that can (``TorchComm``) moves them in the background while the caller
        computes — ring attention overlaps each K/V block's transfer with the attention over the
        block in hand this way; the others pass them at once."""
        got = self.ring_pass(xs)
        return lambda: got


class LocalComm(Comm):
    """A group of one rank: every collective returns its input."""

    rank, size = 0, 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return x.clone()

    def ring_pass(self, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return [x.clone() for x in xs]


class SimulatedWorld:
    """The meeting point of `size` threads that act as ranks: each collective is an exchange of
    every rank's value through `slots`, between two barrier waits. A rank that fails breaks the
    barrier, so the others stop with an error rather than wait for ever."""

    def __init__(self, size: int, timeout: float = 120.0) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=timeout)
        self.slots: list[object] = [None] * size

    def exchange(self, rank: int, value: T) -> list[T]:
        # a copy: the rank goes on once all have read, and may overwrite its buffer (a triton
        # plan reuses buffers) while a slower rank still sums the values it read
        self.slots[rank] = _copy(value)
        try:
            self.barrier.wait()
            out = list(self.slots)
            self.barrier.wait()
        except threading.BrokenBarrierError:
            raise RunError(f"rank {rank}: another rank of the group stopped or timed out "
                           "during a collective") from None
        return out  # type: ignore[return-value]


def _copy(value: T) -> T:
    """A tensor, or a list of tensors, copied (anything else as it is)."""
    if isinstance(value, torch.Tensor):
        return value.clone()  # type: ignore[return-value]
    if isinstance(value, (list, tuple)):
        return type(value)(_copy(v) for v in value)  # type: ignore[return-value]
    return value


class SimulatedComm(Comm):
    """Rank `rank` of a SimulatedWorld."""

    def __init__(self, world: SimulatedWorld, rank: int) -> None:
        self.world, self.rank, self.size = world, rank, world.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return functools.reduce(torch.add, self.world.exchange(self.rank, x))

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return torch.cat(self.world.exchange(self.rank, x), dim=dim)

    def ring_pass(self, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        every = self.world.exchange(self.rank, list(xs))
        return [x.clone() for x in every[(self.rank - 1) % self.size]]


def run_simulated(size: int, fn: Callable[[int], T], timeout: float = 120.0) -> list[T]:
    """fn(rank) for ranks 0 … size − 1, each in its own thread (collectives inside through
    comms built on one SimulatedWorld by the caller); the results in rank order. The first
    rank that raises makes the others stop (the world's barrier is broken) and is re-raised."""
    results: list[object] = [None] * size
    errors: list[tuple[int, BaseException]] = []

    def run(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append((rank, err))

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if any(t.is_alive() for t in threads):
        raise RunError(f"simulated ranks still running after {timeout:.0f} s")
    if errors:
        first = min(errors, key=lambda e: not isinstance(e[1], RunError))  # the cause first
        raise first[1]
    return results  # type: ignore[return-value]


# what torch.distributed raises when a peer process is gone or the group's timeout ran out:
# its DistError family and gloo's errors (RuntimeError), a store's socket timing out or closing
PEER_ERRORS = (RuntimeError, TimeoutError, OSError)


def peer_lost(rank: int, what: str, err: BaseException) -> RunError:
    """The RunError for `what` failing on `rank` because another rank stopped or did not
    answer: one line, with the first line of torch's own message."""
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return RunError(f"rank {rank}: {what} failed — another rank stopped or did not answer "
                    f"within the timeout ({first})")


def _peers_lost(fn: Callable[..., T]) -> Callable[..., T]:
    """A TorchComm collective whose failure — a peer process gone (its connection closed), or
    the group's timeout run out while waiting for one — is a RunError naming this rank."""
    @functools.wraps(fn)
    def run(self: TorchComm, *args: object) -> T:
        try:
            return fn(self, *args)
        except PEER_ERRORS as err:
            raise peer_lost(self.dist.get_rank(), fn.__name__, err) from None
    return run


class TorchComm(Comm):
    """A torch.distributed process group (None: the default group), as a Comm."""

    def __init__(self, group: object | None = None) -> None:
        import torch.distributed as dist
        self.dist, self.group = dist, group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    @_peers_lost
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        out = x.clone()
        self.dist.all_reduce(out, group=self.group)
        return out

    @_peers_lost
    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    @_peers_lost
    def ring_pass(self, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return self.ring_pass_start(xs)()

    def ring_pass_start(self, xs: Sequence[torch.Tensor]) -> Callable[[], list[torch.Tensor]]:
        """``ring_pass`` begun and not waited for: the sends and receives run in the background
        (batch_isend_irecv) while the caller computes; calling the result waits for them."""
        dist = self.dist
        nxt, prv = ((self.rank + d) % self.size for d in (1, -1))
        if self.group is not None:
            nxt, prv = (dist.get_global_rank(self.group, r) for r in (nxt, prv))
        sent = [x.contiguous() for x in xs]     # held until the sends are done
        got = [torch.empty_like(x) for x in xs]
        ops = [dist.P2POp(dist.isend, x, nxt, self.group) for x in sent] + \
            [dist.P2POp(dist.irecv, g, prv, self.group) for g in got]
        requests = dist.batch_isend_irecv(ops)

        @_peers_lost
        def ring_pass_wait(self: TorchComm) -> list[torch.Tensor]:
            for req in requests:
                req.wait()
            sent.clear()
            return got
        return lambda: ring_pass_wait(self)
