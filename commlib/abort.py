"""An uncaught exception on one rank ends the whole job, promptly.

Otherwise the failed rank waits in MPI_Finalize for peers that wait for it in a collective,
and the job hangs until killed. commlib.init() (and the torch backend) install this hook:
the rank prints its traceback as usual, then MPI_Abort makes mpiexec stop every rank, and
the job exits non-zero. COMMLIB_ABORT_ON_EXCEPTION=0 leaves Python's default behaviour.
"""
from __future__ import annotations

import os
import sys
import time

from mpi4py import MPI

from . import settings

_installed = False


def install() -> None:
    """Chain the abort after the current sys.excepthook (once per process)."""
    global _installed
    if _installed or not settings.get("COMMLIB_ABORT_ON_EXCEPTION"):
        return
    _installed = True
    previous = sys.excepthook

    def abort_job(exc_type, exc, tb):
        previous(exc_type, exc, tb)  # the traceback first, as Python prints it
        if MPI.Is_initialized() and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1:
            print(f"commlib: uncaught {exc_type.__name__} on rank {MPI.COMM_WORLD.Get_rank()}: "
                  "aborting the job (COMMLIB_ABORT_ON_EXCEPTION=0 to wait instead)",
                  file=sys.stderr, flush=True)
            unlink_mpich_segments()
            # mpiexec kills every rank and exits as soon as it hears of the abort; output
            # still in its forwarding pipes is lost, the traceback with it. Give it a moment.
            time.sleep(0.3)
            MPI.COMM_WORLD.Abort(1)

    sys.excepthook = abort_job


def unlink_mpich_segments() -> None:
    """MPICH unlinks its node segment in MPI_Finalize, which a killed or aborted job never
    reaches, so the file would stay in /dev/shm. This rank maps it, so it is this job's:
    unlink it (ranks that map it keep their mapping). commlib.init() calls this once every
    rank has mapped it, so nothing is left whatever happens next."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split(None, 5)[5].strip() for line in maps
                     if "/dev/shm/mpich_shm_" in line and not line.rstrip().endswith("(deleted)")}
    except OSError:
        return
    for path in paths:
        try:
            os.unlink(path)
        except OSError:
            pass
