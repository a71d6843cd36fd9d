"""eager: small collectives whose data ride in the agreement's messages (transports/mpi.py's
Agreement, run by csrc/mpi_exchange.cpp). Each rank sends its call's descriptor and its
data to every other rank in one message and computes its result from what arrives, so a
small call across hosts costs one exchange, where checking the call and then running MPI's
own collective costs two or more. Every rank reduces the rows in rank order, so the
results are bitwise equal everywhere. What a rank sends: all_reduce and reduce its buffer,
all_gather its input, reduce_scatter its whole input, broadcast the root's buffer (the
others only their descriptor); at most Agreement.payload_bytes (64 KiB, less among many
ranks), and it goes to all n - 1 peers, so it pays only while the messages are small.
"""
from ..transports.mpi import Agreement
from . import register


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


def run(t, call):
    inp = call.out if call.inp is None else call.inp
    t.agreement.native.eager(call.descriptor("eager"), call.out.ptr, call.out.numel, inp.ptr,
                             inp.numel, call.op_code)


for _collective in ("all_reduce", "reduce", "reduce_scatter", "all_gather", "broadcast"):
    register("eager", _collective, _terms(_collective), run=run, needs="eager",
             refuses=_refuses(_collective), agrees=True, rank_order=True)
