"""Run by torchrun, not mpiexec: each process is alone in its MPI world, so the backend's
communicators are made from torch's store (Communicator.from_store). What differs from
the MPI path: the transport has no MPI library, split/dup go through the store, and
send/recv travel through it (in order per tag, tags independent)."""
import numpy as np
import torch.distributed as dist
from mpi4py import MPI

import commlib
import commlib.torch.backend as tb
from harness import Checker, raises

tb.init_process_group()
rank, n = dist.get_rank(), dist.get_world_size()
comm = dist.group.WORLD.comm
check = Checker()


def made_from_the_store():
    assert MPI.COMM_WORLD.size == 1 and comm.mpi is None
    assert (comm.rank, comm.size, comm.transport) == (rank, n, "shm")
    assert "direct" in comm.algorithms("all_reduce")
    assert "native" not in comm.algorithms("all_reduce")
    raises(ValueError, "needs the MPI library", lambda: comm.all_reduce(
        np.ones(4, np.float32), algorithm="native"))


def every_algorithm_sums():
    for algo in comm.algorithms("all_reduce"):
        t = np.full(1000, rank + 1.0)
        comm.all_reduce(t, algorithm=algo)
        assert (t == n * (n + 1) / 2).all(), (algo, t[:4])


def split_and_dup():
    half = comm.split(rank % 2, key=-rank)  # reversed order inside each half
    members = [r for r in range(n) if r % 2 == rank % 2]
    assert half.size == len(members) and half.rank == len(members) - 1 - members.index(rank)
    t = np.array([rank], np.int64)
    half.all_reduce(t)
    assert t[0] == sum(members)
    rest = comm.split(None if rank == 0 else 1)  # rank 0 opts out
    assert (rest is None) == (rank == 0) and (rest is None or rest.size == n - 1)
    twin = comm.dup()
    u = np.arange(6.0) + rank
    twin.broadcast(u, root=n - 1)
    assert (u == np.arange(6.0) + n - 1).all()
    for c in (half, twin, rest):
        if c is not None:
            c.free()


def point_to_point_through_the_store():
    nxt, prev = (rank + 1) % n, (rank - 1) % n
    # two tags sent in one order, received in the other: tags must not block each other
    comm.send(np.full(3, 10.0 * rank), nxt, tag=1)
    comm.send(np.full(5, 20.0 * rank), nxt, tag=2)
    a, b = np.zeros(5), np.zeros(3)
    late = comm.recv(b, prev, tag=1, async_op=True)
    comm.recv(a, prev, tag=2)
    late.wait(30)
    assert (a == 20.0 * prev).all() and (b == 10.0 * prev).all()
    for k in range(3):  # in order within a tag
        comm.send(np.array([k], np.int32), nxt, tag=7)
    got = [comm.recv(np.zeros(1, np.int32), prev, tag=7)[0] for _ in range(3)]
    assert got == [0, 1, 2], got
    if rank != 0:  # from any source: the Work says which rank sent
        comm.send(np.full(2, float(rank)), 0, tag=8)
    else:
        sources = set()
        for _ in range(n - 1):
            w = comm.recv(buf := np.zeros(2), None, tag=8, async_op=True)
            w.wait(30)
            assert (buf == w.source).all() and w.source not in sources, (buf, w.source)
            sources.add(w.source)
        assert sources == set(range(1, n)), sources
    comm.send(np.zeros(4), nxt, tag=9)
    raises(commlib.CommError, "got 32 bytes, tensor holds 16",
           lambda: comm.recv(np.zeros(2), prev, tag=9))


check.check("made_from_the_store", made_from_the_store)
check.check("every_algorithm_sums", every_algorithm_sums)
if n > 1:
    check.check("split_and_dup", split_and_dup)
    check.check("point_to_point_through_the_store", point_to_point_through_the_store)
dist.barrier()
dist.destroy_process_group()
check.finish()
