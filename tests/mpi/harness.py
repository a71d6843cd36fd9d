"""Shared by the scripts that run under mpiexec: exact test data, and a checker that
gathers failures from every rank and sets the exit code."""
import os
import socket
import sys
import time
import traceback
from collections import Counter
from functools import lru_cache

import numpy as np
from mpi4py import MPI

import stacks

stacks.arm()  # COMMLIB_TEST_STACKS=SECONDS: where each rank stands, should it hang


def __getattr__(name):
    """``harness.torch`` (None without torch), imported on first use: importing torch
    costs seconds per rank, which scripts on numpy arrays need not pay."""
    if name != "torch":
        raise AttributeError(f"module 'harness' has no attribute {name!r}")
    try:
        import torch
    except ImportError:
        torch = None
    globals()["torch"] = torch
    return torch

NUMPY_DTYPES = ["float16", "float32", "float64", "int8", "uint8", "int32", "int64"]
ALL_DTYPES = ["float16", "bfloat16"] + NUMPY_DTYPES[1:]


def values(count: int, rank: int, op: str, dtype: str, salt: int = 0) -> np.ndarray:
    """Integer-valued float64 data whose reductions over <= 4 ranks are exact in every dtype.
    Read-only and cached: copy before writing."""
    return _values(count, rank, op == "prod", dtype == "uint8", salt)


@lru_cache(maxsize=64)
def _values(count, rank, prod, unsigned, salt):
    # element k is pattern(7k + c), periodic in k with the pattern's period (3 or 9, which
    # divide 7 * period): tile one period rather than compute every element
    period = 3 if prod else 9
    first = np.arange(period, dtype=np.int64) * 7 + rank * 5 + salt * 11
    x = np.tile(_pattern(first, prod, unsigned), -(-count // period))[:count]
    x.flags.writeable = False
    return x


def _pattern(i, prod, unsigned):
    if prod:
        table = np.array([1.0, 1.0, 2.0]) if unsigned else np.array([-1.0, 1.0, 2.0])
        return table[i % 3]
    return (i % 9).astype(np.float64) - (0 if unsigned else 4)


def make(x: np.ndarray, dtype: str, backend: str):
    """float64 values -> array of ``dtype`` in ``backend`` ('numpy' or 'torch')."""
    if backend == "torch":
        import torch
        return torch.tensor(x, dtype=getattr(torch, dtype))  # always a copy
    return x.astype(dtype)


def torchrun() -> bool:
    """Whether torchrun started this rank (alone in its MPI world)."""
    return MPI.COMM_WORLD.size == 1 and int(os.environ.get("WORLD_SIZE", "1")) > 1


def ranks_per_host() -> list:
    """How many ranks each host has, hosts in order of their lowest rank: the virtual
    hosts of COMMLIB_RANKS_PER_HOST, else the real ones (by hostname)."""
    from commlib import settings  # (here: a script imports commlib when it chooses to)
    per_host = settings.get("COMMLIB_RANKS_PER_HOST") or 0
    if per_host:
        names = [r // per_host for r in range(MPI.COMM_WORLD.size)]
    elif torchrun():
        names = _store_allgather("harness/host", socket.gethostname())
    else:
        names = MPI.COMM_WORLD.allgather(socket.gethostname())
    return list(Counter(names).values())  # a Counter keeps first-seen order


def expected_transport() -> str:
    """The transport commlib's auto choice must pick for this launch: shared memory on one
    host, hosts for equal ranks on each of several, else what joins the hosts: net (TCP;
    mpi with COMMLIB_CROSS=mpi under mpiexec, gloo with COMMLIB_CROSS=gloo under torchrun
    (or COMMLIB_TRANSPORT's)."""
    from commlib import settings
    forced = settings.get("COMMLIB_TRANSPORT")
    if forced and forced != "auto":
        return forced
    layout = ranks_per_host()
    if len(layout) == 1:
        return "shm"
    if len(set(layout)) == 1:
        return "hosts"
    return settings.get("COMMLIB_CROSS")


def assert_equal(got, want) -> None:
    """Exact comparison that reports the first differing element."""
    if got.shape != want.shape or not np.array_equal(got, want):
        if got.shape != want.shape:
            raise AssertionError(f"shape {got.shape} != expected {want.shape}")
        i = int(np.flatnonzero(got != want)[0])
        raise AssertionError(f"element {i}: got {got[i]}, expected {want[i]} "
                             f"({int((got != want).sum())} of {got.size} differ)")


def to_f64(a) -> np.ndarray:
    torch = sys.modules.get("torch")  # (not a tensor if torch was never imported)
    if torch is not None and isinstance(a, torch.Tensor):
        return a.to(torch.float64).numpy()
    return np.asarray(a, dtype=np.float64)


def use_device():
    """The device a strategies script runs on, made torch's default device so that its
    models and tensors are created there: COMMLIB_TEST_DEVICE (cpu unless set; cuda means
    GPU 0, which the ranks share)."""
    import torch
    device = torch.device(os.environ.get("COMMLIB_TEST_DEVICE", "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    torch.set_default_device(device)
    return device


def leaf(t):
    """A detached copy of tensor ``t`` that requires grad."""
    return t.detach().clone().requires_grad_(True)


def close(got, want, rtol=1e-12, atol=1e-12) -> None:
    """Tensors of the same shape, equal within tolerances; the message gives the largest
    difference."""
    import torch
    assert got.shape == want.shape, (got.shape, want.shape)
    assert torch.allclose(got, want, rtol=rtol, atol=atol), \
        f"max diff {(got - want).abs().max():.3g}"


def same_as(got: dict, want: dict, rtol=1e-4, atol=1e-6) -> None:
    """Two name -> tensor dicts (parameters, gradients) with the same names, every tensor
    within tolerances; the message names the first that is not."""
    import torch
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    for name, p in got.items():
        assert torch.allclose(p, want[name], rtol=rtol, atol=atol), \
            f"{name}: max diff {(p - want[name]).abs().max():.3g}"


def raises(exc, match: str, fn) -> None:
    """``fn()`` must raise ``exc`` with ``match`` in its message."""
    try:
        fn()
    except exc as e:
        assert match in str(e), f"{match!r} not in {e!r}"
    else:
        raise AssertionError(f"no {exc.__name__} ({match})")


class Checker:
    def __init__(self):
        self.cases = 0
        self.failures = []

    def check(self, name: str, fn) -> None:
        self.cases += 1
        if os.environ.get("COMMLIB_TEST_CASE_SECONDS"):  # each case its own limit
            stacks.arm(float(os.environ["COMMLIB_TEST_CASE_SECONDS"]), name)
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - collected and reported below
            detail = "".join(traceback.format_exception_only(type(e), e)).strip()
            self.failures.append(f"{name}: {detail[:400]}")
            # at once: a failure that leaves the ranks out of step may hang the next case
            rank = os.environ.get("RANK", MPI.COMM_WORLD.rank)  # torchrun's, else MPI's
            print(f"[rank {rank}] FAIL {self.failures[-1]}", flush=True)

    def run_cases(self, namespace: dict) -> None:
        """Check every public zero-argument function the calling script defined (those
        COMMLIB_TEST_CASES names, comma-separated, where it is set), then finish."""
        chosen = os.environ.get("COMMLIB_TEST_CASES")
        for name, fn in list(namespace.items()):
            if (callable(fn) and getattr(fn, "__module__", None) == "__main__"
                    and not name.startswith("_") and fn.__code__.co_argcount == 0
                    and (not chosen or name in chosen.split(","))):
                self.check(name, fn)
        self.finish()

    def finish(self) -> None:
        failed, rank, barrier = _over_ranks(len(self.failures))
        barrier()
        if rank == 0:
            print(f"commlib-check: {self.cases} cases, {failed} failures", flush=True)
        sys.exit(1 if failed else 0)


def _store():
    """torchrun's store, as a client."""
    import torch.distributed as dist
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                         is_master=False)


def _store_allgather(key: str, value: str) -> list:
    """Every torchrun rank's ``value``, through the store (not the code under test)."""
    store, size = _store(), int(os.environ["WORLD_SIZE"])
    store.set(f"{key}/{os.environ['RANK']}", value)
    return [store.get(f"{key}/{r}").decode() for r in range(size)]


def _over_ranks(value: int):
    """(sum of ``value`` over ranks, this rank, a barrier): over MPI, or through torchrun's
    store when torchrun started the ranks (each alone in its MPI world), so that the
    verdict needs no process group of the code under test."""
    world = MPI.COMM_WORLD
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if not torchrun():
        return world.allreduce(value), world.rank, world.Barrier
    store = _store()
    store.add("harness/failures", value)

    def arrive_and_wait(key):
        store.add(key, 1)
        while store.add(key, 0) < size:
            time.sleep(0.01)
    arrive_and_wait("harness/counted")
    total = store.add("harness/failures", 0)
    return total, int(os.environ["RANK"]), lambda: arrive_and_wait("harness/printed")
