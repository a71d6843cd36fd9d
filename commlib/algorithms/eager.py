"""eager: small collectives whose data ride in the agreement's messages (transports/mpi.py's
Agreement, run by csrc/mpi_exchange.cpp). Each rank sends its call's descriptor and its
data to every other rank in one message and computes its result from what arrives, so a
small call across hosts costs one exchange, where checking the call and then running MPI's
own collective costs two or more. Every rank reduces the rows in rank order, so the
results are bitwise equal everywhere. What a rank sends: all_reduce and reduce its buffer,
all_gather its input, reduce_scatter its whole input, broadcast the root's buffer (the
others only their descriptor); at most payload_bytes(n, where), and it goes to all n - 1
peers, so it pays only while the messages are small.

Between torchrun's nodes (transports/gloo.py) the rows are one gloo all-gather, of a fixed
length (gloo aborts the process on an all-gather whose ranks differ in length): every
agreement there sends a row that long, so a call that is eager on one rank and not on
another still meets a row of its length, and is told they disagree.
"""
from ..collectives import COLLECTIVES, of as collective_of
from ..transports import rows
from ..transports.base import Where
from .registry import register
from .gloo import agreement_terms


def payload_bytes(n: int, where: Where | None = None) -> int:
    """The most data a rank's row carries among ``n`` ranks at ``where`` (None: MPI)."""
    if where is not None and where.over_gloo:
        return rows.gloo_payload_bytes(n)
    return rows.mpi_payload_bytes(n)


def _sent_bytes(collective: str, n: int, nbytes: int) -> int:
    return collective_of(collective).input_bytes(nbytes, n)


def _refuses(collective):
    def refuses(n, nbytes, where=None):
        sent, most = _sent_bytes(collective, n, nbytes), payload_bytes(n, where)
        if sent > most:
            return (f"eager sends at most {most} bytes with its descriptor among {n} "
                    f"ranks here, and this call would send {sent}")
        return None
    return refuses


def _terms(collective):
    def terms(model, where, n, nbytes):
        if _refuses(collective)(n, nbytes, where):
            return None
        if where.over_gloo:  # the agreement's all-gather alone
            return {**agreement_terms(n), "gamma": n * nbytes}
        sent = _sent_bytes(collective, n, nbytes)
        return {"alpha_native": 1, "beta": (n - 1) * sent, "gamma": n * nbytes}
    return terms


def run(t, call):
    t.eager(call)


for _collective in (c for c in COLLECTIVES if not collective_of(c).uneven):  # (rows: even)
    register("eager", _collective, _terms(_collective), run=run, needs="eager",
             refuses=_refuses(_collective), agrees=True, rank_order=True)
