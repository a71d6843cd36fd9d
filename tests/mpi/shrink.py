"""Survivors shrink their communicator and go on (Communicator.shrink): ranks meet through a
torch FileStore, so no launcher kills them when a rank dies. Each rank reports how it ended
to REPORT_DIR/rank-R.txt: the survivors, the shrunk communicator's results checked.

Scenarios (a victim SIGKILLs itself):
  dp        DataParallel trains on a global batch sharded over the ranks; the last rank
            dies in step 3 before its backward (the others wait for it in their gradients'
            all-reduce); rank 0 comes late to shrink; the survivors regroup, redo step 3
            on the batch sharded over them, and every step's loss matches one process
            training on the whole batch
  between   rank 0 dies between calls (the others then wait for its message), then rank 1
            dies right after the survivors agreed on the group (inside shrink): their first
            shrink fails, the second goes on without both

Usage: python tests/mpi/shrink.py RANK SIZE STORE_FILE REPORT_DIR SCENARIO   (one per rank)
"""
import os
import signal
import sys
import time

import numpy as np
import torch.distributed as dist

import commlib
from commlib import survivors

rank, size, store_file, report_dir, scenario = (int(sys.argv[1]), int(sys.argv[2]),
                                                sys.argv[3], sys.argv[4], sys.argv[5])
commlib.abort.unlink_mpich_segments()  # (an MPI singleton's segment, as kill_rank_store.py)
store = dist.FileStore(store_file, size)
comm = commlib.Communicator.from_store(store, rank, size)
comm.timeout = 20


def die() -> None:
    store.set(f"died/{rank}", repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


victim = 0 if scenario == "between" else size - 1
failed_at, attempts, first_call = None, 0, None


def recover(error) -> None:
    """Shrink (again where a peer dies meanwhile) and check the shrunk communicator."""
    global comm, failed_at, attempts, first_call, old
    assert failed_at is None, f"a second failure: {error}"
    failed_at = step
    assert f"rank {victim}" in str(error) and "exited" in str(error), error
    if scenario == "between" and rank == 1:
        survivors.agree(comm._transport.world, 1, 20.0)  # as shrink does, then dies
        die()
    if scenario == "dp" and rank == 0:
        time.sleep(0.3)  # comes late: the others wait for it
    while True:
        attempts += 1
        try:
            comm = comm.shrink()
            break
        except commlib.CommError as again:
            assert scenario == "between" and attempts == 1, again
            assert "exited" in str(again), again
    died = max(float(store.get(f"died/{r}")) for r in range(size)
               if store.check([f"died/{r}"]))
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


if scenario == "between":
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

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(),
                                   torch.nn.Linear(16, 1)).double()
    dp, alone = DataParallel(model(), comm), model()
    optimizer = torch.optim.SGD(dp.parameters(), lr=0.1)
    reference = torch.optim.SGD(alone.parameters(), lr=0.1)
    for step in range(6):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(12, 6, generator=g, dtype=torch.float64), \
            torch.randn(12, 1, generator=g, dtype=torch.float64)
        reference.zero_grad()
        expected = torch.nn.functional.mse_loss(alone(x), y)
        expected.backward()
        reference.step()
        while True:  # a step that fails is redone over the survivors
            optimizer.zero_grad()
            shard = slice(comm.rank * 12 // comm.size, (comm.rank + 1) * 12 // comm.size)
            loss = torch.nn.functional.mse_loss(dp(x[shard]), y[shard])
            try:
                if rank == victim and step == 3:
                    die()
                loss.backward()
                mean = loss.detach().clone()
                comm.all_reduce(mean, op="avg")
                break
            except commlib.CommError as error:
                recover(error)
                dp.regroup(comm)
        optimizer.step()
        assert torch.allclose(mean, expected, rtol=1e-12), (step, mean, expected)
    for p, q in zip(dp.parameters(), alone.parameters()):
        assert torch.allclose(p, q, rtol=1e-10), (p, q)
with open(os.path.join(report_dir, f"rank-{rank}.txt"), "w") as f:
    f.write(f"SURVIVOR rank {rank} failed at step {failed_at}, shrank in {attempts} "
            f"attempt(s) to ranks {old.tolist()}; first call after the death "
            f"{first_call:.3f} s\n")
comm.free()
