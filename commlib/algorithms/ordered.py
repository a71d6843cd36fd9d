"""ordered: the reducing collectives reduced in rank order, built from collectives that do not
reduce, so that they run on any transport and give the same bits as direct, one_copy and
eager (deterministic mode: select.choose).

Rank order: every element's result is ((x0 op x1) op x2) ... op x(n-1), with x_r rank r's
value, the same binary kernel at every step, whatever the size or the algorithms of the
stages below (they only move data). Vocabulary: rank r *owns* chunk r of the vector (the
chunks: schedule.chunks, near-equal; reduce_scatter's blocks for reduce_scatter).

    reduce_scatter  all_to_all of the raw blocks (rank r receives block r of every rank),
                    then rank r folds them
    all_reduce      the same on the chunks, then all_gather of the folded chunks (into the
                    output; uneven ones padded to the longest in scratch, then copied)
    reduce          the same on the chunks, then an all_to_all that sends each chunk to the root
"""
from .. import _C
from ..call import Call
from ..collectives import of as collective_of
from ..schedule import chunks
from .registry import entries, register

# the transport's scratch slots (apart from those of the stages' algorithms: hier's)
_RECEIVED, _FOLDED, _GATHERED = "ordered:received", "ordered:folded", "ordered:gathered"


def _stage(t, collective, out, inp, count, splits=None):
    """Run a non-reducing stage of the (already agreed) call on transport ``t``."""
    t.execute(Call(collective, out, inp, count, out.dtype, None, None, splits, None))


def _fold(call, received, parts: int, count: int, out) -> None:
    """out = received[0] op received[1] op ... (``parts`` rows of ``count``), in order (an
    average adds: the caller scales)."""
    row = [received.ptr + i * count * call.dtype.itemsize for i in range(parts)]
    if parts == 1:
        _C.copy(out.ptr, row[0], count * call.dtype.itemsize)
        return
    _C.reduce(out.ptr, row[0], row[1], count, call.dtype.code, call.op_code)
    for i in range(2, parts):
        _C.reduce(out.ptr, out.ptr, row[i], count, call.dtype.code, call.op_code)


def _reduce_chunks(t, call):
    """Rank r's chunk of ``call.out`` folded over the ranks: (scratch, its length, chunks)."""
    n, r, buf = t.size, t.rank, call.out
    parts = chunks(buf.numel, n)
    mine = parts[r][1]
    received = t.scratch(_RECEIVED, n * mine, buf.dtype)
    _stage(t, "all_to_all", received, buf, buf.numel,
           (tuple(c for _, c in parts), (mine,) * n))
    folded = t.scratch(_FOLDED, max(c for _, c in parts), buf.dtype)
    _fold(call, received, n, mine, folded)
    return folded, parts


def reduce_scatter(t, call):
    n, count = t.size, call.out.numel
    received = t.scratch(_RECEIVED, n * count, call.dtype)
    _stage(t, "all_to_all", received, call.inp, n * count, ((count,) * n,) * 2)
    _fold(call, received, n, count, call.out)


def all_reduce(t, call):
    folded, parts = _reduce_chunks(t, call)
    longest = folded.numel
    if longest * t.size == call.out.numel:  # equal chunks: gathered where they belong
        _stage(t, "all_gather", call.out, folded, longest)
        return
    gathered = t.scratch(_GATHERED, t.size * longest, call.dtype)
    _stage(t, "all_gather", gathered, folded, longest)
    size = call.dtype.itemsize
    for j, (offset, count) in enumerate(parts):
        _C.copy(call.out.ptr + offset * size, gathered.ptr + j * longest * size, count * size)


def reduce(t, call):
    n, root, buf = t.size, call.root, call.out
    folded, parts = _reduce_chunks(t, call)
    mine = parts[t.rank][1]
    sends = tuple(mine if j == root else 0 for j in range(n))
    gets = tuple(c for _, c in parts) if t.rank == root else (0,) * n
    # the root receives the chunks in place; the others' buffers are left as they were
    out = buf if t.rank == root else t.scratch(_GATHERED, 0, buf.dtype)
    _stage(t, "all_to_all", out, folded.part(0, mine), mine, (sends, gets))


def terms(collective, model, where, n, nbytes) -> dict:
    """The stages' costs (gloo's where gloo joins the ranks, else the schedules pairwise and
    ring stand for whatever runs them), plus the folds, the copies out of the scratch and a
    round per stage for composing them."""
    scatters = collective_of(collective).parts == "scatter"  # (no gather stage)
    exchange, gather = (n * nbytes, 0) if scatters else (nbytes, -(-nbytes // n))
    shm = where.transport == "shm"
    total = {"gamma_shm" if shm else "gamma":
             (n - 1) * (nbytes if scatters else nbytes / n),
             "alpha_shm" if shm else "alpha": 2, "beta_shm": nbytes}
    gloo = where.over_gloo
    stages = [("all_to_all", "gloo" if gloo else "pairwise", exchange)]
    if gather:
        stages.append(("all_gather", "gloo" if gloo else "ring", gather))
    for stage, name, stage_bytes in stages:
        for key, value in entries(stage)[name].cost(model, where, n, stage_bytes).items():
            total[key] = total.get(key, 0) + value
    return total


for _fn in (all_reduce, reduce_scatter, reduce):
    register("ordered", _fn.__name__, lambda model, where, n, nbytes, c=_fn.__name__:
             terms(c, model, where, n, nbytes), run=_fn, rank_order=True)
