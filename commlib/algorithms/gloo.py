"""gloo: torch's gloo collectives (TCP), where ranks met through a store on several hosts
(torchrun's nodes) and no MPI library joins them: the whole group's calls, and hier's cross
stage between hosts (commlib/transports/gloo.py). Buffers go to gloo as torch views of
their memory; an average is a sum the caller scales.
"""
from ..transports.rows import gloo_row_bytes
from ..collectives import COLLECTIVES
from .registry import register
from .native import FORMULAS


def _tensor(buf):
    import torch
    dtype = getattr(torch, buf.dtype.name)
    if not buf.numel:  # (an empty byte view has no stride a dtype view accepts)
        return torch.empty(0, dtype=dtype)
    return torch.from_numpy(buf.bytes).view(dtype)


_OPS = {"sum": "SUM", "avg": "SUM", "prod": "PRODUCT", "min": "MIN", "max": "MAX",
        "band": "BAND", "bor": "BOR", "bxor": "BXOR"}


def _options(kind: str, call=None, **fields):
    from torch._C import _distributed_c10d as c10d
    opts = getattr(c10d, kind)()
    if call is not None:
        opts.reduceOp = getattr(c10d.ReduceOp, _OPS[call.op.value])
    for name, value in fields.items():
        setattr(opts, name, value)
    return opts


def all_reduce(t, call):
    t.count_sent(2 * (t.size - 1) / t.size * call.out.nbytes)  # the least any algorithm sends
    t.wait(t.group.allreduce([_tensor(call.out)], _options("AllreduceOptions", call)))


def reduce_scatter(t, call):
    out, inp = _tensor(call.out), _tensor(call.inp)
    t.count_sent((t.size - 1) * call.out.nbytes)
    result = out.clone() if call.out.overlaps(call.inp) else out  # gloo writes out early
    t.wait(t.group._reduce_scatter_base(result, inp, _options("ReduceScatterOptions", call)))
    if result is not out:
        out.copy_(result)


def all_gather(t, call):
    out, inp = _tensor(call.out), _tensor(call.inp)
    t.count_sent((t.size - 1) * call.inp.nbytes)
    if call.out.overlaps(call.inp):  # in place: this rank's block is the input
        inp = inp.clone()
    t.wait(t.group._allgather_base(out, inp, _options("AllgatherOptions")))


def all_to_all(t, call):
    input_splits, output_splits = call.splits
    t.count_sent((sum(input_splits) - input_splits[t.rank]) * call.dtype.itemsize)
    t.wait(t.group.alltoall_base(_tensor(call.out), _tensor(call.inp), list(output_splits),
                                 list(input_splits), _options("AllToAllOptions")))


def broadcast(t, call):
    t.count_sent(call.out.nbytes if t.size > 1 else 0)
    t.wait(t.group.broadcast([_tensor(call.out)], _options("BroadcastOptions",
                                                           rootRank=call.root)))


def reduce(t, call):
    t.count_sent(call.out.nbytes if t.size > 1 else 0)
    x = _tensor(call.out)
    if t.rank != call.root:  # gloo leaves partial results there; commlib leaves the input
        x = x.clone()
    t.wait(t.group.reduce([x], _options("ReduceOptions", call, rootRank=call.root)))


def terms(collective, n, nbytes, checked=True) -> dict:
    """A library's own collective, like MPI's (native.FORMULAS), at gloo's constants, after
    the agreement's all-gather of rows (GlooTransport.agree) where calls are checked."""
    rounds, moved = FORMULAS[collective](n, nbytes)
    agreement = agreement_terms(n) if checked else {"alpha_gloo": 0, "beta_gloo": 0}
    return {"alpha_gloo": max(1, rounds) + agreement["alpha_gloo"],
            "beta_gloo": moved + agreement["beta_gloo"]}


def agreement_terms(n) -> dict:
    """GlooTransport.agree among ``n`` ranks: one all-gather of whole rows."""
    rounds, _ = FORMULAS["all_gather"](n, 0)
    return {"alpha_gloo": max(1, rounds), "beta_gloo": (n - 1) * gloo_row_bytes(n)}


RUNNERS = {f.__name__: f for f in (all_reduce, reduce_scatter, all_gather, all_to_all,
                                   broadcast, reduce)}
for _collective in COLLECTIVES:
    register("gloo", _collective,
             lambda model, where, n, nbytes, c=_collective: terms(c, n, nbytes, where.checked),
             run=RUNNERS[_collective], needs="gloo", user_ops=False)
