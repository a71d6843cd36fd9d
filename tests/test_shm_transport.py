"""The shared-memory transport on its own (no MPI): two processes, names passed by a pipe."""
import multiprocessing as mp
import os
import stat

import numpy as np
import pytest

import commlib
from commlib import _C

F32, SUM = _C.DTYPES["float32"], _C.OPS["sum"]


def make(rank):
    return _C.ShmComm(rank, 2, slot_bytes=4096, slots=2, staging_bytes=1 << 16, spin=100,
                      yields=10)


def peer(conn, behaviour):
    """Rank 1: attach, then either take part in one all_reduce or exit without it."""
    me = make(1)
    conn.send(me.name)
    me.attach(conn.recv())
    conn.send("attached")
    conn.recv()  # the parent has unlinked its segment
    me.unlink_own()
    if behaviour == "exit":
        os._exit(0)
    buf = np.full(1000, 2.0, np.float32)
    me.all_reduce(buf.ctypes.data, buf.size, F32, SUM, 3)
    conn.send(buf.tolist())


def start(behaviour, monkeypatch):
    ctx = mp.get_context("spawn")  # no fork of a process that may have MPI up
    mine, theirs = ctx.Pipe()
    child = ctx.Process(target=peer, args=(theirs, behaviour))
    # the child imports commlib (so mpi4py) but must not start MPI: an MPI process that
    # dies leaves MPICH's own segments behind, which is not what is tested here
    monkeypatch.setenv("MPI4PY_RC_INITIALIZE", "false")
    child.start()
    me = make(0)
    path = "/dev/shm" + me.name
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, "the segment must be private"
    names = [me.name, mine.recv()]
    mine.send(names)
    me.attach(names)
    assert mine.recv() == "attached"
    me.unlink_own()
    mine.send("go")
    return me, mine, child, names


def test_two_processes_all_reduce_and_leave_nothing_in_dev_shm(monkeypatch):
    me, conn, child, names = start("reduce", monkeypatch)
    buf = np.full(1000, 1.0, np.float32)
    me.all_reduce(buf.ctypes.data, buf.size, F32, SUM, 3)
    assert np.array_equal(buf, np.full(1000, 3.0, np.float32))
    assert conn.recv() == [3.0] * 1000
    child.join(30)
    assert child.exitcode == 0
    for name in names:  # unlinked once both had mapped them
        assert not os.path.exists("/dev/shm" + name)


def test_a_peer_that_exited_is_reported_not_waited_for(monkeypatch):
    me, conn, child, _ = start("exit", monkeypatch)
    child.join(30)
    buf = np.ones(4, np.float32)
    with pytest.raises(commlib.CommError, match="has exited"):
        me.all_reduce(buf.ctypes.data, buf.size, F32, SUM, 3)
    with pytest.raises(commlib.CommError, match="unusable"):  # and the communicator stays failed
        me.barrier()
