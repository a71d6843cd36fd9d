"""eager: small collectives whose data ride in the agreement's messages
(transports/mpi.py, Agreement.exchange). Each rank sends its call's descriptor and its
data to every other rank in one message and computes its result from what arrives, so a
small call across hosts costs one exchange, where checking the call and then running MPI's
own collective costs two or more. Every rank reduces the rows in rank order, so the
results are bitwise equal everywhere. What a rank sends: all_reduce and reduce its buffer,
all_gather its input, reduce_scatter its whole input, broadcast the root's buffer (the
others only their descriptor); at most Agreement.payload_bytes (64 KiB, less among many
ranks), and it goes to all n - 1 peers, so it pays only while the messages are small.
"""
import numpy as np

from .. import _C
from ..transports.mpi import Agreement
from . import register


_NOTHING = np.empty(0, np.uint8)


def _payload_bytes(collective: str, n: int, nbytes: int) -> int:
    return n * nbytes if collective == "reduce_scatter" else nbytes


def _refuses(collective):
    def refuses(n, nbytes):
        sent, most = _payload_bytes(collective, n, nbytes), Agreement.payload_bytes(n)
        if sent > most:
            return (f"eager sends at most {most} bytes with its descriptor among {n} "
                    f"ranks, and this call would send {sent}")
        return None
    return refuses


def _terms(collective):
    def terms(model, where, n, nbytes):
        if _refuses(collective)(n, nbytes):
            return None
        sent = _payload_bytes(collective, n, nbytes)
        return {"alpha_native": 1, "beta": (n - 1) * sent, "gamma": n * nbytes}
    return terms


def _reduce_rows(call, ptrs, offset: int) -> None:
    """call.out = row 0 (op) row 1 (op) ... from ``offset`` bytes into each row."""
    out = call.out
    if len(ptrs) == 1:
        _C.copy(out.ptr, ptrs[0] + offset, out.nbytes)
        return
    _C.reduce(out.ptr, ptrs[0] + offset, ptrs[1] + offset, out.numel, call.dtype.code,
              call.op_code)
    for p in ptrs[2:]:
        _C.reduce(out.ptr, out.ptr, p + offset, out.numel, call.dtype.code, call.op_code)


def run(t, call):
    collective, rank = call.collective, t.rank
    sends = collective != "broadcast" or rank == call.root
    data = (call.inp if collective in ("all_gather", "reduce_scatter") else call.out).bytes
    rows = t.exchange(call.descriptor("eager"), call.dtype.itemsize,
                      data if sends else _NOTHING)  # every rank's payload, as addresses
    t.world.count_sent((t.size - 1) * data.nbytes if sends else 0)
    out = call.out
    if collective == "all_reduce" or (collective == "reduce" and rank == call.root):
        _reduce_rows(call, rows, 0)
    elif collective == "reduce_scatter":
        _reduce_rows(call, rows, rank * out.nbytes)
    elif collective == "broadcast" and rank != call.root:
        _C.copy(out.ptr, rows[call.root], out.nbytes)
    elif collective == "all_gather":
        block = call.inp.nbytes
        for r, row in enumerate(rows):
            _C.copy(out.ptr + r * block, row, block)


for _collective in ("all_reduce", "reduce", "reduce_scatter", "all_gather", "broadcast"):
    register("eager", _collective, _terms(_collective), run=run, needs="eager",
             refuses=_refuses(_collective), agrees=True)
