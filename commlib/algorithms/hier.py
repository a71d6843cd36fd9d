"""hier: collectives across hosts in three stages, shared memory inside each host and
MPI between them, so each byte crosses the network once per host, not once per rank.

    all_reduce      host reduce-scatter -> all-reduce of each shard among the ranks that
                    own it on every host -> host all-gather
    reduce_scatter  host reduce-scatter (blocks regrouped by owner) -> reduce-scatter among
                    the same-shard ranks
    all_gather      all-gather among the same-shard ranks -> host all-gather (regrouped)
    broadcast       broadcast among the root's shard ranks -> broadcast inside every host

Vocabulary (commlib/hosts.py): ``local`` is this rank's host, ``cross`` the ranks with the
same local rank on every host; ``owner[i][h]`` is the rank with local rank i at position
h of its cross communicator. Offered when every host has the same number of ranks.
"""
from .. import _C
from ..ops import ReduceOp
from . import register


def _execute(comm, collective, bufs, count, dtype, op="sum", **params):
    from ..collectives import execute  # (import cycle: collectives -> select -> algorithms)
    # the top-level call checked agreement and scales an average once, at the end
    execute(comm, collective, bufs, count, dtype, ReduceOp("sum" if op == "avg" else op),
            **params)


def all_reduce(comm, bufs, dtype, op):
    lay, buf = comm._layout, bufs["out"]
    local = lay.local
    transport = local._executor.transport

    def phase(p):
        transport.all_reduce(buf.ptr, buf.numel, dtype.code, _C.OPS[op], p)
    phase(1)  # local rank i now holds the host's sum of chunk i
    offset, count = _chunk(buf.numel, local.size, local.rank)
    _execute(lay.cross, "all_reduce", {"out": buf.part(offset, count)}, count, dtype, op)
    phase(2)


def _chunk(count, parts, i):
    base, extra = divmod(count, parts)
    return i * base + min(i, extra), base + (i < extra)


def reduce_scatter(comm, bufs, dtype, op):
    lay, out, inp = comm._layout, bufs["out"], bufs["in"]
    n, hosts = out.numel, lay.cross.size
    grouped = lay.scratch(0, comm.size * n, dtype)  # blocks ordered by (local rank, host)
    for i, row in enumerate(lay.owner):
        for h, r in enumerate(row):
            _C.copy(grouped.ptr + (i * hosts + h) * out.nbytes, inp.ptr + r * out.nbytes, out.nbytes)
    shard = lay.scratch(1, hosts * n, dtype)
    _execute(lay.local, "reduce_scatter", {"out": shard, "in": grouped}, hosts * n, dtype, op)
    _execute(lay.cross, "reduce_scatter", {"out": out, "in": shard}, n, dtype, op)


def all_gather(comm, bufs, dtype, op):
    lay, out, inp = comm._layout, bufs["out"], bufs["in"]
    n, hosts = inp.numel, lay.cross.size
    shard = lay.scratch(1, hosts * n, dtype)
    _execute(lay.cross, "all_gather", {"out": shard, "in": inp}, n, dtype)
    grouped = lay.scratch(0, comm.size * n, dtype)
    _execute(lay.local, "all_gather", {"out": grouped, "in": shard}, hosts * n, dtype)
    for i, row in enumerate(lay.owner):
        for h, r in enumerate(row):
            _C.copy(out.ptr + r * inp.nbytes, grouped.ptr + (i * hosts + h) * inp.nbytes, inp.nbytes)


def broadcast(comm, bufs, dtype, op, root=0):
    lay, buf = comm._layout, bufs["out"]
    root_local, root_cross = lay.position[root]
    if lay.local.rank == root_local:
        _execute(lay.cross, "broadcast", {"out": buf}, buf.numel, dtype, root=root_cross)
    _execute(lay.local, "broadcast", {"out": buf}, buf.numel, dtype, root=root_local)


for _fn in (all_reduce, reduce_scatter, all_gather, broadcast):
    register("hier", _fn.__name__, run=_fn, requires="hosts")
