"""Survivors shrink their communicator and go on (Communicator.shrink): ranks meet through a
torch FileStore, so no launcher kills them when a rank dies. Each rank reports how it ended
to REPORT_DIR/rank-R.txt: the survivors, the shrunk communicator's results checked.

Scenarios (a victim SIGKILLs itself):
  dp        DataParallel, ZeRO-1 and ZeRO-2 (SGD with momentum) train side by side on a
            global batch sharded over a data-parallel mesh; the last rank dies in step 3
            before its backward (the others wait for it in their gradients' collectives);
            rank 0 comes late to shrink; the survivors shrink the mesh, regroup, redo step 3
            on the batch sharded over them, and every step's loss and the weights match
            one process training on the whole batch (for ZeRO, whose dead rank's momentum
            is lost, one whose momentum there restarts from zero at the death)
  between   rank 0 dies between calls (the others then wait for its message), then rank 1
            dies right after the survivors agreed on the group (inside shrink): their first
            shrink fails, the second goes on without both; a dp x tp mesh refuses to shrink
  host      the ranks on two hosts (namespace hosts: 2 + 2); the second host's ranks die
            together between calls (a whole host lost): the survivors' next call fails,
            they see the dead only by their pulses standing still, shrink to the first
            host's ranks and go on
  inside    3 ranks in a 64 MiB all_reduce; the last SIGKILLs itself 10 ms into it (in
            the middle of moving the data): the survivors' call fails, they shrink, go on
  silent    3 ranks, the last on a host of its own (COMMLIB_HOSTID: gloo joins the two);
            it stops (SIGSTOP) before a call, alive but silent, as a host cut off from
            the network: the survivors' gloo call ends when its pulse has stood still (not
            at the timeout), they shrink to the first host's ranks and go on
  cut       as host, but the second host's network is cut (tests/test_multihost.py, when
            its ranks say they are ready) with its ranks alive, and the store is a TCPStore
            on the first host: the survivors see the silence by the pulses, shrink and go
            on; the cut-off ranks fail (the store unreachable) and exit with 3
  abort     nobody dies: rank 2 comes to an all_reduce 3 s late, and rank 0's watchdog
            aborts its communicator 0.3 s into the call: rank 0's call fails at once (not
            at its timeout), and its peers' calls fail too, naming the abort

Usage: python tests/mpi/shrink.py RANK SIZE STORE REPORT_DIR SCENARIO   (one per rank)
STORE: a file (a FileStore), or tcp://HOST:PORT (a TCPStore that rank 0 serves)
"""
import os
import signal
import sys
import threading
import time
from datetime import timedelta

import numpy as np
import torch.distributed as dist

import commlib
from commlib import survivors
from commlib_strategies.mesh import Mesh

rank, size, store_file, report_dir, scenario = (int(sys.argv[1]), int(sys.argv[2]),
                                                sys.argv[3], sys.argv[4], sys.argv[5])
commlib.abort.unlink_mpich_segments()  # (an MPI singleton's segment, as kill_rank_store.py)
if store_file.startswith("tcp://"):  # (a host cut off loses it too)
    host, port = store_file[len("tcp://"):].rsplit(":", 1)
    store = dist.TCPStore(host, int(port), size, rank == 0, timeout=timedelta(seconds=15))
else:
    store = dist.FileStore(store_file, size)
comm = commlib.Communicator.from_store(store, rank, size)
comm.timeout = 20


def die() -> None:
    if scenario == "inside":  # (10 ms into the call that follows)
        def kill():
            store.set(f"died/{rank}", repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Timer(0.01, kill).start()
        return
    if scenario == "cut":  # (its network is cut by the test: it goes on, and fails)
        open(os.path.join(report_dir, f"silent-{rank}"), "w").close()
        time.sleep(1)
        return
    store.set(f"died/{rank}", repr(time.time()))
    os.kill(os.getpid(), signal.SIGSTOP if scenario == "silent" else signal.SIGKILL)


victim = 0 if scenario == "between" else size - 1
dead = set(range(size // 2, size)) if scenario in ("host", "cut") \
    else {0, 1} if scenario == "between" else {victim}
failed_at, attempts, first_call = None, 0, None


def recover(error) -> None:
    """Shrink (again where a peer dies meanwhile) and check the shrunk communicator."""
    global comm, mesh, failed_at, attempts, first_call, old
    assert failed_at is None, f"a second failure: {error}"
    failed_at = step
    if scenario not in ("host", "cut"):  # (across hosts the transport says how it lost it)
        assert f"rank {victim}" in str(error) and "exited" in str(error), error
    if scenario == "between" and rank == 1:
        survivors.agree(comm._transport.world, 1, 20.0)  # as shrink does, then dies
        die()
    if scenario == "dp" and rank == 0:
        time.sleep(0.3)  # comes late: the others wait for it
    if scenario == "between":
        try:
            mesh.shrink()
            raise AssertionError("a dp x tp mesh shrank")
        except commlib.CommError as refused:
            assert "tp=2" in str(refused) and "checkpoint" in str(refused), refused
    while True:
        attempts += 1
        try:
            if scenario == "dp":
                mesh = mesh.shrink()
                comm = mesh.world
            else:
                comm = comm.shrink()
            break
        except commlib.CommError as again:
            assert scenario == "between" and attempts == 1, again
            assert "exited" in str(again), again
    if scenario == "cut":
        with open(os.path.join(report_dir, "cut-at")) as f:
            died = float(f.read())
    else:
        died = max(float(store.get(f"died/{r}")) for r in dead if store.check([f"died/{r}"]))
    x = np.full(1000, comm.rank + 1, np.float64)
    comm.all_reduce(x)
    first_call = time.time() - died
    assert (x == comm.size * (comm.size + 1) / 2).all(), (x[0], comm.size)
    half = comm.split(comm.rank % 2)  # sub-communicators derive from the shrunk one
    y = np.full(10, comm.rank, np.int64)
    half.all_reduce(y)
    assert y[0] == sum(r for r in range(comm.size) if r % 2 == comm.rank % 2), y
    half.free()
    old = np.zeros(comm.size, np.int64)
    comm.all_gather(old, np.array([rank], np.int64))


if scenario == "abort":
    if rank == 2:
        time.sleep(3)
    elif rank == 0:
        threading.Timer(0.3, comm.abort).start()
    start = time.monotonic()
    try:
        comm.all_reduce(np.ones(1000))
        raise AssertionError("the all_reduce went through an aborted communicator")
    except commlib.CommError as error:
        assert "rank 0 aborted the communicator" in str(error), error
        with open(os.path.join(report_dir, f"rank-{rank}.txt"), "w") as f:
            f.write(f"ABORTED rank {rank} after {time.monotonic() - start:.3f} s\n")
    comm.abort()
    sys.exit(0)
elif scenario in ("host", "silent", "cut", "inside"):
    for step in range(6):
        try:
            if rank in dead and step == 3:
                die()
            big = scenario == "inside" and step == 3  # (64 MiB: a call of some 50 ms)
            x = np.full(1 << 23 if big else 1000, comm.rank + 1, np.float64)
            comm.all_reduce(x)
            assert (x == comm.size * (comm.size + 1) / 2).all(), (step, x[0], comm.size)
        except commlib.CommError as error:
            if rank in dead:  # (cut off)
                with open(os.path.join(report_dir, f"rank-{rank}.txt"), "w") as f:
                    f.write(f"CUT OFF rank {rank} at step {step}: {error}\n")
                comm.abort()
                sys.exit(3)
            recover(error)
elif scenario == "between":
    mesh = Mesh(comm, dp=2, tp=2)
    for step in range(6):
        try:
            if rank == victim and step == 3:
                die()
            if step == 3:
                time.sleep(0.2)  # the survivors were not in a call when it died
                comm.recv(np.zeros(4), src=0)  # (its messages never come: raises at once)
            x = np.full(1000, comm.rank + 1, np.float64)
            comm.all_reduce(x)
            assert (x == comm.size * (comm.size + 1) / 2).all(), (step, x[0], comm.size)
        except commlib.CommError as error:
            recover(error)
else:
    import torch
    from commlib_strategies.data_parallel import DataParallel
    from commlib_strategies.zero import ZeRO

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(),
                                   torch.nn.Linear(16, 1)).double()

    def sgd(params, momentum=0.9):
        return torch.optim.SGD(params, lr=0.1, momentum=momentum)

    def forget(zero, reference, alone) -> None:
        """What ZeRO.regroup loses with the dead rank: its shards' momentum, in
        ``reference`` (over ``alone``, ``zero``'s twin) too."""
        twin = dict(zip(zero.module.parameters(), alone.parameters()))
        for u in zero.units:
            lost = range(victim * u.shard_numel, (victim + 1) * u.shard_numel)
            start = 0
            for p in u.params:
                flat = reference.state[twin[p]]["momentum_buffer"].view(-1)
                lo, hi = max(lost.start, start), min(lost.stop, start + p.numel())
                if lo < hi:
                    flat[lo - start:hi - start] = 0
                start += p.numel()

    mesh = Mesh(comm, dp=size)
    group = mesh.group("dp")
    dp = DataParallel(model(), group)
    zeros = [ZeRO(model(), group, stage, sgd) for stage in (1, 2)]
    alone = [model() for _ in range(3)]
    references = [sgd(m.parameters(), momentum) for m, momentum in zip(alone, (0, 0.9, 0.9))]
    optimizer = sgd(dp.parameters(), momentum=0)
    for step in range(6):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(12, 6, generator=g, dtype=torch.float64), \
            torch.randn(12, 1, generator=g, dtype=torch.float64)
        expected = []
        for m, reference in zip(alone, references):
            reference.zero_grad()
            expected.append(torch.nn.functional.mse_loss(m(x), y))
            expected[-1].backward()
        while True:  # a step that fails is redone over the survivors
            optimizer.zero_grad()
            for zero in zeros:
                zero.zero_grad()
            shard = slice(comm.rank * 12 // comm.size, (comm.rank + 1) * 12 // comm.size)
            try:
                means = []
                for m in [dp, *zeros]:
                    loss = torch.nn.functional.mse_loss(m(x[shard]), y[shard])
                    if rank == victim and step == 3:
                        die()
                    loss.backward()
                    means.append(loss.detach().clone())
                    comm.all_reduce(means[-1], op="avg")
                optimizer.step()
                for zero in zeros:
                    zero.step()
                break
            except commlib.CommError as error:
                recover(error)
                dp.regroup(mesh.group("dp"))
                for zero, reference, twin in zip(zeros, references[1:], alone[1:]):
                    forget(zero, reference, twin)
                    zero.regroup(mesh.group("dp"))
        for reference in references:
            reference.step()
        for mean, want in zip(means, expected):
            assert torch.allclose(mean, want, rtol=1e-12), (step, mean, want)
    for m, twin in zip([dp, *zeros], alone):
        for p, q in zip(m.module.parameters(), twin.parameters()):
            assert torch.allclose(p, q, rtol=1e-10), (p, q)
with open(os.path.join(report_dir, f"rank-{rank}.txt"), "w") as f:
    f.write(f"SURVIVOR rank {rank} failed at step {failed_at}, shrank in {attempts} "
            f"attempt(s) to ranks {old.tolist()}; first call after the death "
            f"{first_call:.3f} s\n")
comm.free()
