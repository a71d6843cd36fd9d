"""A timeout for tests/test_trace.py: the last rank is outside any call (after a call of its
own on a communicator of its own) while the others time out in an all_reduce; each of those
prints its error's note, whose timeline holds every rank that answers: the last rank's too
where it waits, not where it is stopped (SIGSTOP, until rank 0 continues it).

Usage: mpiexec -n 3 python tests/mpi/trace_stuck.py sleep|stop"""
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import commlib

world = commlib.init()
n, rank = world.size, world.rank
alone = world.split(int(rank == n - 1))
pids = world.mpi.allgather(os.getpid())
go = Path(tempfile.gettempdir()) / f"go-{pids[0]}"  # the last rank's to go on
world.all_reduce(np.ones(4))
if rank == n - 1:
    alone.broadcast(np.ones(3))  # where the last rank was last
    if sys.argv[1] == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    while not go.exists():
        time.sleep(0.02)
else:
    try:
        world.all_reduce(np.ones(8), timeout=1.0)
    except commlib.CommTimeoutError as e:
        notes = [note for note in getattr(e, "__notes__", []) if "last calls" in note]
        assert notes, e
        print(f"rank {rank}: {notes[0]}", flush=True)
        alone.mpi.Barrier()  # every failing rank has asked: the last may go on
        if rank == 0:
            go.touch()
            if sys.argv[1] == "stop":
                os.kill(pids[n - 1], signal.SIGCONT)
    else:
        raise AssertionError("no CommTimeoutError")
