"""The shared-memory transport on its own (no MPI): two processes, names passed by a pipe."""
import multiprocessing as mp
import os
import stat
import threading
import time

import numpy as np
import pytest

import commlib
from commlib import _C

F32, SUM = _C.DTYPES["float32"], _C.OPS["sum"]


def make(rank, spin=100, background_spin=0):
    return _C.ShmComm(rank, 2, slot_bytes=4096, slots=2, staging_bytes=1 << 16, spin=spin,
                      yields=10, background_spin=background_spin)


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
    for _ in range(2 if behaviour == "late" else 1):
        if behaviour == "late":
            time.sleep(LATE)
        me.all_reduce(buf.ctypes.data, buf.size, F32, SUM, 3)
    conn.send(buf.tolist())


LATE = 0.4  # seconds the "late" peer sleeps before each all_reduce


def start(behaviour, monkeypatch, **config):
    ctx = mp.get_context("spawn")  # no fork of a process that may have MPI up
    mine, theirs = ctx.Pipe()
    child = ctx.Process(target=peer, args=(theirs, behaviour))
    # the child imports commlib (so mpi4py) but must not start MPI: an MPI process that
    # dies leaves MPICH's own segments behind, which is not what is tested here
    monkeypatch.setenv("MPI4PY_RC_INITIALIZE", "false")
    child.start()
    me = make(0, **config)
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


def test_a_background_thread_waits_without_spinning_where_told(monkeypatch):
    """background_spin=0 (a rank with one core): a call on a thread other than the main
    one yields and sleeps while its peer is late, leaving the core to the main thread's
    compute; on the main thread the same call spins (spin: more polls than the wait)."""
    me, conn, child, _ = start("late", monkeypatch, spin=1 << 40, background_spin=0)
    buf = np.ones(1000, np.float32)
    used = []

    def all_reduce():
        start = time.thread_time()
        me.all_reduce(buf.ctypes.data, buf.size, F32, SUM, 3)
        used.append(time.thread_time() - start)
    background = threading.Thread(target=all_reduce)
    background.start()
    background.join(30)
    all_reduce()
    assert conn.recv() == [6.0] * 1000 and buf[0] == 6.0  # ((1 + 2) * 2)
    child.join(30)
    assert used[0] < LATE / 8 < LATE / 4 < used[1], used  # (loose: a busy machine)


def test_a_peer_that_exited_is_reported_not_waited_for(monkeypatch):
    me, conn, child, _ = start("exit", monkeypatch)
    child.join(30)
    buf = np.ones(4, np.float32)
    with pytest.raises(commlib.CommError, match="has exited"):
        me.all_reduce(buf.ctypes.data, buf.size, F32, SUM, 3)
    with pytest.raises(commlib.CommError, match="unusable"):  # and the communicator stays failed
        me.barrier()
