"""`shardbound run DIR --nproc P`: start P ranks of DIR/program.py on this machine.

The ranks rendezvous through env:// on 127.0.0.1, joining a store the launcher hosts (as
torchrun's agent does).
The launcher watches them: when one exits with an error, the others get the collective
timeout to notice and stop, after which they are killed; the message names the rank that
failed first and how (exit code or signal).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


def _rendezvous_store(timeout_s: float):
    """The job's rendezvous store, hosted by the launcher on a port the OS picks while the
    store binds it (so no other process can take it in between, as it could when a free port
    was looked up first and bound later by rank 0). The ranks join it as clients, the way
    torchrun's agent store works (TORCHELASTIC_USE_AGENT_STORE)."""
    import datetime

    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=timeout_s),
                    wait_for_workers=False)


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def launch(program: str, argv: list[str], nproc: int, timeout_s: float, stderr=None) -> int:
    """Run `program argv` as `nproc` ranks; the exit code of the job (0, 1, or 2 for a user
    error a rank reported). `stderr`: an open file for the ranks' stderr (default: ours)."""
    store = _rendezvous_store(timeout_s)
    procs = []
    for rank in range(nproc):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                   LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(store.port), TORCHELASTIC_USE_AGENT_STORE="True")
        procs.append(subprocess.Popen([sys.executable, program, *argv], env=env, stderr=stderr))
    failure = None
    deadline = None
    while True:
        codes = [p.poll() for p in procs]
        if failure is None:
            for rank, code in enumerate(codes):
                if code not in (None, 0):
                    failure = (rank, code)
                    deadline = time.monotonic() + timeout_s + 5
                    break
        if all(c is not None for c in codes):
            break
        if deadline is not None and time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            for p in procs:
                p.wait()
            break
        time.sleep(0.05)
    if failure is None:
        return 0
    rank, code = failure
    if code != 2:  # 2: a user error the rank already explained in one line
        print(f"error: rank {rank} of {nproc} {_describe(code)}; the other ranks were stopped",
              file=stderr or sys.stderr, flush=True)
    return 2 if code == 2 else 1
