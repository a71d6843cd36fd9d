"""hier: collectives across hosts in three stages, shared memory inside each host and
TCP (the net transport; with COMMLIB_CROSS, MPI's messages under mpiexec or gloo under
torchrun) between them, so each byte crosses the network
once per host, not once per rank.

    all_reduce      host reduce-scatter -> all-reduce of each shard among the ranks that
                    own it on every host -> host all-gather
    reduce_scatter  host reduce-scatter (blocks regrouped by owner) -> reduce-scatter among
                    the same-shard ranks
    all_gather      all-gather among the same-shard ranks -> host all-gather (regrouped)
    broadcast       broadcast inside the root's host -> broadcast of each shard among the
                    ranks that own it on every host -> host all-gather of the shards on
                    every other host (the hosts' link carries a stream per local rank, as
                    in all_reduce and all_gather)

Runners take the several-hosts transport (commlib/transports/hosts.py, whose vocabulary
they use); each stage is a call of its own, run by ``local.execute`` or ``cross.execute``.
"""
from dataclasses import replace

from .. import _C
from ..call import Call, ReduceOp
from . import gloo
from .direct import terms as direct_terms
from .registry import candidates, register


def _stage(call, collective, out, inp=None, count=None, root=None) -> Call:
    """A stage of ``call`` (which agreed, and scales an average once, at the end)."""
    op = ReduceOp.SUM if call.op is ReduceOp.AVG else call.op
    return Call(collective, out, inp, out.numel if count is None else count, call.dtype, op,
                root, None, None)


def all_reduce(t, call):
    buf = call.out
    t.local.all_reduce_phase(call, 1)  # local rank i now holds the host's sum of chunk i
    offset, count = _chunk(buf.numel, t.local.size, t.local.rank)
    t.cross.execute(_stage(call, "all_reduce", buf.part(offset, count)))
    t.local.all_reduce_phase(call, 2)


def _chunk(count, parts, i):
    base, extra = divmod(count, parts)
    return i * base + min(i, extra), base + (i < extra)


def reduce_scatter(t, call):
    out, inp = call.out, call.inp
    n, hosts = out.numel, t.cross.size
    # blocks ordered by (local rank, host)
    grouped = t.scratch("hier:grouped", t.size * n, call.dtype)
    for i, row in enumerate(t.owner):
        for h, r in enumerate(row):
            _C.copy(grouped.ptr + (i * hosts + h) * out.nbytes, inp.ptr + r * out.nbytes,
                    out.nbytes)
    shard = t.scratch("hier:shard", hosts * n, call.dtype)
    t.local.execute(_stage(call, "reduce_scatter", shard, grouped))
    t.cross.execute(_stage(call, "reduce_scatter", out, shard))


def all_gather(t, call):
    out, inp = call.out, call.inp
    n, hosts = inp.numel, t.cross.size
    shard = t.scratch("hier:shard", hosts * n, call.dtype)
    t.cross.execute(_stage(call, "all_gather", shard, inp, n))
    grouped = t.scratch("hier:grouped", t.size * n, call.dtype)
    t.local.execute(_stage(call, "all_gather", grouped, shard, hosts * n))
    for i, row in enumerate(t.owner):
        for h, r in enumerate(row):
            _C.copy(out.ptr + r * inp.nbytes, grouped.ptr + (i * hosts + h) * inp.nbytes,
                    inp.nbytes)


def broadcast(t, call):
    buf, L = call.out, t.local.size
    on_roots_host = t.host_of[call.root] == t.host_of[t.rank]
    if on_roots_host:
        t.local.execute(_stage(call, "broadcast", buf, root=t.position[call.root][0]))
    # equal shards (one all-gather puts them together), the last one with the remainder
    shard, tail = divmod(buf.numel, L)
    mine = buf.part(t.local.rank * shard, shard + (tail if t.local.rank == L - 1 else 0))
    t.cross.execute(_stage(call, "broadcast", mine,
                           root=t.cross_rank_of_host[t.host_of[call.root]]))
    if not on_roots_host:
        t.local.execute(_stage(call, "all_gather", buf.part(0, L * shard),
                               buf.part(t.local.rank * shard, shard), shard))
        if tail:
            t.local.execute(_stage(call, "broadcast", buf.part(L * shard, tail), root=L - 1))


# what the cross stage's transport offers, by what joins the hosts (Where.cross)
CROSS_OFFERS = {"mpi": frozenset({"mpi", "schedules"}), "net": frozenset({"mpi", "schedules"}),
                "gloo": frozenset({"gloo"})}

# L ranks on each of H hosts: per-rank bytes of the host stage and of the cross stage
BYTES = {
    "all_reduce": lambda L, H, N: (N, N / L),
    "reduce_scatter": lambda L, H, N: (H * N, N),
    "all_gather": lambda L, H, N: (H * N, N),
    "broadcast": lambda L, H, N: (N, N / L),
}


def terms(collective, model, where, n, nbytes) -> dict | None:
    local = where.local or n
    if local >= n:
        return None
    hosts = n // local
    host_bytes, cross_bytes = BYTES[collective](local, hosts, nbytes)
    cross_where = replace(where, transport=where.cross)
    cross = min((a.cost(model, cross_where, hosts, int(cross_bytes))
                 for a in candidates(collective, CROSS_OFFERS[where.cross])), key=model.price)
    total = dict(direct_terms(collective, replace(where, transport="shm"), local, int(host_bytes)))
    # between torchrun's nodes the whole call is agreed on first, over gloo (its MPI
    # agreement, like every algorithm's there, is left out)
    extra = gloo.agreement_terms(n) if where.cross == "gloo" and where.checked else {}
    for name, coefficient in [*cross.items(), *extra.items()]:
        total[name] = total.get(name, 0) + coefficient
    return total


for _fn in (all_reduce, reduce_scatter, all_gather, broadcast):
    register("hier", _fn.__name__, lambda model, where, n, nbytes, c=_fn.__name__:
             terms(c, model, where, n, nbytes), run=_fn, needs="hosts")
