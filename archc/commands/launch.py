"""Running a command as the ranks of a --tp/--cp run on this machine.

``archc run SRC --tp N [--cp M]`` started by hand spawns the ``N · M`` workers itself, through
torch.distributed's elastic launcher (``launch``), each running the same command line; started
by ``torchrun --nproc-per-node N·M -m archc run SRC --tp N`` each process is the rank torchrun
made it. Either way a worker joins the run's default group (``archc.dist.init_from_env``), and
a worker that dies makes the launcher stop the others and report it.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

from archc.commands.common import quant_of
from archc.errors import RunError


def free_port() -> int:
    """A TCP port on localhost that nothing listens on now (the rendezvous's)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(main: Callable[[list[str]], int], argv: Sequence[str]) -> int:
    """One spawned rank: the same command line run by `main` (the command line's entry point),
    as the rank the launcher made this."""
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
    from archc.ir.lower import lower
    from archc.passes.context import context_parallel
    from archc.passes.shard import shard_program
    spec, quant = quant_of(args)
    program = lower(spec, quant=quant)
    if args.tp > 1:
        program = shard_program(program, args.tp)
    if args.cp > 1:
        context_parallel(program, args.cp)
    elif getattr(args, "backend", None) == "triton":   # what each rank's triton session refuses
        from archc.passes import optimize
        from archc.runtime.triton_backend import check_cache_writes
        check_cache_writes(optimize(program))


def launch(argv: Sequence[str], world: int, timeout: float,
           main: Callable[[list[str]], int]) -> int:
    """Run the command `argv` as `world` local ranks, each calling `main(argv)` (torch's
    elastic launcher, no restarts); returns rank 0's exit status. A rank that fails stops the
    others: the result is one error naming it, its exit status and how long the run had gone."""
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
        elastic_launch(config, _worker)(main, list(argv))   # `main` goes by its name
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
