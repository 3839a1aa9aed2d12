"""A tp × cp run whose rank dies: every group the others make (tensor-parallel and ring) waits
only the run's timeout for it, so each surviving rank stops with an error — never a hang for
torch's own default (30 minutes on gloo)."""

from __future__ import annotations

import time

from tests.test_tp_runtime import RUN, torchrun_style

TIMEOUT = 15


def test_a_rank_that_dies_in_a_tp_by_cp_run_stops_the_others_within_the_timeout() -> None:
    """tp = 2 × cp = 2 (ranks 2 and 3 one tensor-parallel group, ranks 1 and 3 one ring): rank
    3 exits after joining, and ranks 0, 1 and 2 each stop with an error, in time."""
    start = time.monotonic()
    codes, outs = torchrun_style([*RUN, "--tp", "2", "--cp", "2", "--timeout", str(TIMEOUT)],
                                 4, {"ARCHC_TEST_EXIT_RANK": "3"})
    elapsed = time.monotonic() - start
    assert codes == [1, 1, 1, 3], [e for _, e in outs]
    # rank 0 speaks for the run (torch's own warnings before it)
    last = outs[0][1].strip().splitlines()[-1]
    assert last.startswith("archc run: error: rank 0: "), last
    assert "another rank stopped or did not answer within the timeout" in last
    tracebacks = [e for _, e in outs if "Traceback" in e]
    assert not tracebacks, tracebacks[0]
    # a rank waits out the timeout at most twice (making a group, then a collective on
    # another), after the processes start (slow on a loaded machine: four import torch)
    assert elapsed < 2 * TIMEOUT + 45
