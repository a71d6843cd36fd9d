"""Deterministic mode: every reducing collective gives the bits of one fold in rank order,
((x0 + x1) + x2) ..., computed here by numpy (torch for bfloat16), on every algorithm that
reduces in rank order and auto, on every transport this job can make (shared memory, with
tiny staging pieces, mpi, several virtual hosts), at sizes past every piece and chunk; and
DDP (torch backend) and DataParallel train to the same weights whatever the algorithms.

Usage: mpiexec -n N python tests/mpi/deterministic.py [torch]   (torch: bfloat16 and training)
"""
import hashlib
import os
import sys

import numpy as np

import commlib
from commlib.algorithms import entries
from harness import Checker, raises

world = commlib.init()
n, rank = world.size, world.rank
TORCH = "torch" in sys.argv
check = Checker()
# past shm staging's pieces (4 KiB staging below), eager's 64 KiB, one_copy's chunks
SIZES = (1, 13, 70_001, (1 << 18) + 3)
REDUCING = ("all_reduce", "reduce_scatter", "reduce")
# each made with this environment, on every rank alike
TRANSPORTS = {"shm": {}, "shm with 4 KiB staging": {"COMMLIB_SHM_STAGING_BYTES": "4096"},
              "mpi": {"COMMLIB_TRANSPORT": "mpi"}}
if n >= 2 and n % 2 == 0:  # (virtual hosts)
    TRANSPORTS["hosts"] = {"COMMLIB_RANKS_PER_HOST": str(n // 2)}
if world.transport == "hosts":  # on real hosts (tests/test_multihost.py)
    TRANSPORTS = {"hosts": {}, "mpi": {"COMMLIB_TRANSPORT": "mpi"}}


def data(r: int, count: int, dtype: str):
    """Rank r's values: magnitudes over 6 decades, so the order of additions shows."""
    rng = np.random.default_rng([r, count])
    x = (rng.standard_normal(count) * 10.0 ** rng.uniform(-3, 3, count)).astype(np.float32)
    if dtype == "bfloat16":
        import torch
        return torch.from_numpy(x).to(torch.bfloat16)
    return x


def folded(count: int, dtype: str, op: str):
    acc = data(0, count, dtype)
    for r in range(1, n):
        acc = acc + data(r, count, dtype)
    if op == "avg":
        acc = acc * (np.float32(1 / n) if dtype == "float32" else 1 / n)
    return acc


def bits(x) -> bytes:
    return x.view(np.uint8).tobytes() if isinstance(x, np.ndarray) else \
        x.view(dtype=__import__("torch").int16).numpy().tobytes()


def same_bits(got, want, what: str) -> None:
    if bits(got) != bits(want):
        g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
        raise AssertionError(f"{what}: {int(np.sum(g != w))} of {g.size} elements differ "
                             f"from the rank-order fold (first at {int(np.argmax(g != w))})")


def reductions(comm, name: str) -> None:
    for collective in REDUCING:
        names = [a for a in comm.algorithms(collective)
                 if entries(collective)[a].rank_order or n <= 2]
        for algo in names + [None]:
            for dtype in ("float32", "bfloat16") if TORCH else ("float32",):
                for op in ("sum", "avg") if collective == "all_reduce" else ("sum",):
                    check.check(f"{name}/{collective}/{algo or 'auto'}/{dtype}/{op}",
                                lambda c=collective, a=algo, d=dtype, o=op: one(comm, c, a, d, o))
        others = [a for a in comm.algorithms(collective) if not entries(collective)[a].rank_order]
        for_call = comm.algorithms(collective, count=4, dtype="float32")
        assert set(for_call) == set(names), (for_call, names)  # (what the mode runs)
        if others and n > 2:  # (between 2 ranks every algorithm gives the fold's bits)
            check.check(f"{name}/{collective}/{others[0]} refused", lambda c=collective: raises(
                ValueError, "deterministic mode needs", lambda: call(comm, c, others[0],
                                                                     data(rank, 4 * n, "float32"))))


def call(comm, collective, algo, x, op="sum"):
    if collective == "all_reduce":
        comm.all_reduce(x, op=op, algorithm=algo)
        return x
    if collective == "reduce":
        comm.reduce(x, root=len(x) % n, op=op, algorithm=algo)
        return x
    out = x[:len(x) // n].clone() if hasattr(x, "clone") else x[:len(x) // n].copy()
    comm.reduce_scatter(out, x, op=op, algorithm=algo)
    return out


def one(comm, collective, algo, dtype, op) -> None:
    refuses = algo and entries(collective)[algo].refuses
    for count in SIZES:
        if refuses and refuses(n, count * 4):
            continue  # (eager: past what its messages carry)
        total = count * n if collective == "reduce_scatter" else count
        got = call(comm, collective, algo, data(rank, total, dtype), op)
        want = folded(total, dtype, op)
        if collective == "reduce_scatter":
            want = want[rank * count:(rank + 1) * count]
        if collective == "reduce" and rank != total % n:
            want = data(rank, total, dtype)  # left as it was
        same_bits(got, want, f"count {count}")


def order_shows() -> None:
    """The data tell rank orders apart (else the checks above could not fail)."""
    forward, backward = data(0, 1000, "float32"), data(n - 1, 1000, "float32")
    for r in range(1, n):
        forward = forward + data(r, 1000, "float32")
        backward = backward + data(n - 1 - r, 1000, "float32")
    assert bits(forward) != bits(backward)


def made_with(env: dict, make):
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return make()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v


def weights_after_training(wrap) -> str:
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    wrapped = wrap(model)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(3):
        x = torch.randn(16, 32, generator=g) * 10 ** (torch.rand(16, 1, generator=g) * 4 - 2)
        opt.zero_grad()
        wrapped(x).square().mean().backward()
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]


def training() -> None:
    """The same weights after 3 steps with each choice."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import commlib.torch.backend
    from commlib_strategies.data_parallel import DataParallel
    commlib.torch.backend.init_process_group()
    # (DataParallel takes one_copy itself where it may: with the first; the mpi transport's
    # rank-order algorithms give the fold's bits above)
    choices = {"direct": {"COMMLIB_ALGO_ALL_REDUCE": "direct"},
               "ordered": {"COMMLIB_ALGO_ALL_REDUCE": "ordered", "COMMLIB_ONE_COPY": "0"}}
    ddp, dp = {}, {}
    for name, env in choices.items():
        env = {**env, "COMMLIB_DETERMINISTIC": "1"}
        group = made_with(env, lambda: dist.new_group(list(range(n)), backend="commlib"))
        ddp[name] = weights_after_training(
            lambda m: DistributedDataParallel(m, process_group=group, bucket_cap_mb=0.01))
        comm = made_with(env, lambda: world.dup(deterministic=True))
        dp[name] = weights_after_training(lambda m: DataParallel(m, comm, bucket_bytes=4096))
    if n >= 3:  # the control: ring, outside deterministic mode, adds in another order
        group = made_with({"COMMLIB_ALGO_ALL_REDUCE": "ring"},
                          lambda: dist.new_group(list(range(n)), backend="commlib"))
        ring = weights_after_training(
            lambda m: DistributedDataParallel(m, process_group=group, bucket_cap_mb=0.01))
        assert ring not in ddp.values(), "the training cannot tell the orders apart"
    assert len(set(ddp.values())) == 1, f"DDP's weights differ: {ddp}"
    assert len(set(dp.values())) == 1, f"DataParallel's weights differ: {dp}"
    if rank == 0:
        print(f"deterministic training: DDP {ddp.popitem()[1]}, DataParallel "
              f"{dp.popitem()[1]} after 3 steps, whatever the algorithm", flush=True)


def on(comm, name: str) -> None:
    assert comm.deterministic
    if n > 1:
        assert comm.transport == name.split()[0], (comm.transport, name)


if n >= 3:
    check.check("the data show the order", order_shows)
for name, env in TRANSPORTS.items():
    comm = made_with(env, lambda: world.dup(deterministic=True))
    check.check(f"{name}: transport {comm.transport}", lambda: on(comm, name))
    reductions(comm, f"{name} ({comm.transport})")
    comm.free()
if TORCH:
    check.check("training", training)
check.finish()
