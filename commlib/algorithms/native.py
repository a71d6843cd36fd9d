"""native: the MPI library's own collectives through mpi4py (the baseline to beat).

Each runs as MPI's non-blocking collective, waited for with the transport's timeout (a
blocking one cannot time out), on the world's ``coll`` communicator, its dtypes and ops
as transports/mpi_types.py names them. The fast path makes the same calls from C++
(csrc/mpi_native.cpp), for MPI's own datatypes and ops. With a CUDA-aware MPI the same
calls run on GPU arrays themselves (the "device" entries), except where the host must
touch the data.
"""
import numpy as np
from mpi4py import MPI

from ..transports.mpi_types import op_for as _op
from ..transports.mpi_types import spec as _spec
from ..work import Deadline, wait_request
from ..collectives import COLLECTIVES, of as collective_of
from .registry import log2_rounds, register

def _wait(transport, request, keep) -> None:
    wait_request(request, Deadline(transport.timeout), "its peers inside MPI's "
                 "collective (MPI does not say which)", keep=keep)


def all_reduce(t, call):
    # MPI's traffic is hidden: count the least any algorithm sends (nccl-tests' bus bytes)
    t.world.count_sent(2 * (t.size - 1) / t.size * call.out.nbytes)
    _wait(t, t.world.coll.Iallreduce(MPI.IN_PLACE, _spec(call.out), _op(call)), call)


def reduce_scatter(t, call):
    out, inp = call.out, call.inp
    t.world.count_sent((t.size - 1) * out.nbytes)
    if out.overlaps(inp):  # MPI's in-place form leaves the result at the front, not in block r
        result = np.empty_like(out.bytes)
        _wait(t, t.world.coll.Ireduce_scatter_block(
            _spec(inp), [result, getattr(MPI, out.dtype.mpi)], _op(call)), (call, result))
        out.bytes[:] = result
    else:
        _wait(t, t.world.coll.Ireduce_scatter_block(_spec(inp), _spec(out), _op(call)), call)


def all_gather(t, call):
    out, inp = call.out, call.inp
    t.world.count_sent((t.size - 1) * inp.nbytes)
    send = MPI.IN_PLACE if out.overlaps(inp) else _spec(inp)
    _wait(t, t.world.coll.Iallgather(send, _spec(out)), call)


def all_to_all(t, call):
    input_splits, output_splits = call.splits
    mpi_type = getattr(MPI, call.dtype.mpi)
    t.world.count_sent((sum(input_splits) - input_splits[t.rank]) * call.dtype.itemsize)
    displs = lambda splits: np.concatenate([[0], np.cumsum(splits)[:-1]])  # noqa: E731
    _wait(t, t.world.coll.Ialltoallv(
        [call.inp.bytes, (input_splits, displs(input_splits)), mpi_type],
        [call.out.bytes, (output_splits, displs(output_splits)), mpi_type]), call)


def broadcast(t, call):
    t.world.count_sent(call.out.nbytes if t.size > 1 else 0)
    _wait(t, t.world.coll.Ibcast(_spec(call.out), call.root), call)


def reduce(t, call):
    t.world.count_sent(call.out.nbytes if t.size > 1 else 0)
    if t.rank == call.root:
        request = t.world.coll.Ireduce(MPI.IN_PLACE, _spec(call.out), _op(call), call.root)
    else:
        request = t.world.coll.Ireduce(_spec(call.out), None, _op(call), call.root)
    _wait(t, request, call)


# (latency rounds, bytes its traffic moves) per collective
FORMULAS = {
    "all_reduce": lambda n, N: (2 * log2_rounds(n), 2 * (n - 1) / n * N),
    "reduce_scatter": lambda n, N: (log2_rounds(n), (n - 1) * N),
    "all_gather": lambda n, N: (log2_rounds(n), (n - 1) * N),
    "all_to_all": lambda n, N: (n - 1, (n - 1) / n * N),
    "broadcast": lambda n, N: (log2_rounds(n), N),
    "reduce": lambda n, N: (log2_rounds(n), N),
}


def terms(collective, n, nbytes) -> dict:
    rounds, moved = FORMULAS[collective](n, nbytes)
    return {"alpha_native": max(1, rounds), f"native:{collective}": moved}


def on_device(transport, call) -> str | None:
    """Why MPI cannot take this call on GPU arrays as they are (None: it can)."""
    if call.op is not None and not call.op.builtin:
        return "MPI to run a user-defined op on the GPU (commlib reduces it on the host)"
    if call.op is not None and call.dtype.itemsize == 2 and call.dtype.floating:
        return "MPI to reduce 16-bit floats on the GPU (commlib reduces them on the host)"
    if collective_of(call.collective).parts == "scatter" and call.out.overlaps(call.inp):
        return "an output apart from the input (in place, the host copies the result)"
    return None


RUNNERS = {f.__name__: f for f in (all_reduce, reduce_scatter, all_gather, all_to_all,
                                   broadcast, reduce)}
def device_terms(collective, n, nbytes) -> dict:  # the stream's and the device's waits too
    return {**terms(collective, n, nbytes), "alpha_cuda_mpi": 1}


for _collective in COLLECTIVES:
    register("native", _collective, lambda model, where, n, nbytes, c=_collective:
             terms(c, n, nbytes), run=RUNNERS[_collective], needs="mpi")
    register("native", _collective, lambda model, where, n, nbytes, c=_collective:
             device_terms(c, n, nbytes), run=RUNNERS[_collective], needs="cuda_mpi",
             memory="device", applies=on_device)
