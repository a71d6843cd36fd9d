"""What a rank's compressed gradient calls carry from one step to the next (error feedback's
residuals, PowerSGD's queries), as named float32 arrays for a checkpoint and back.

The holders are DataParallel's per bucket or ZeRO's per unit (``compression_holders()``):
commlib.compressed.ErrorFeedback, commlib.low_rank.LowRankState, or None (nothing held).
A name is ``<holder index>.<field>`` (ErrorFeedback: worker, server) or
``<holder index>.<field>.<tensor index>`` (LowRankState: queries, residuals). They belong to
the rank and the layout that made them: a checkpoint restores them only into the same
layout (``signature``); another one starts them afresh, as a regrouped run does.
"""
from __future__ import annotations

import numpy as np

from commlib.compressed import ErrorFeedback
from commlib.low_rank import LowRankState


def holders_of(trainer) -> list:
    """The trainer's holders: its ZeRO's or its data parallelism's (none without either)."""
    for wrapper in (trainer.zero, getattr(trainer, "data_parallel", None)):
        if wrapper is not None:
            return wrapper.compression_holders()
    return []


def signature(trainer) -> dict:
    """What must be equal for a rank's held arrays to mean the same after a resume."""
    args = getattr(trainer, "args", None)
    settings = {k: getattr(args, k, None) for k in ("compress", "low_rank", "no_feedback",
                                                     "bucket_mb")}
    return {"world": trainer.mesh.world.size, **trainer.mesh.sizes,
            "zero": trainer.zero.stage if trainer.zero else 0,
            "holders": len(holders_of(trainer)), **settings}


def named_arrays(holders: list) -> dict:
    """Every array the holders hold, by name."""
    out = {}
    for i, held in enumerate(holders):
        if isinstance(held, ErrorFeedback):
            out.update({f"{i}.{k}": v for k, v in held.state_dict().items() if v is not None})
        elif isinstance(held, LowRankState):
            for field, arrays in held.state_dict().items():
                out.update({f"{i}.{field}.{k}": v for k, v in arrays.items()})
    return out


def restore(holders: list, arrays: dict) -> None:
    """The holders given back ``arrays`` (named_arrays' names); what is not named starts
    afresh."""
    for i, held in enumerate(holders):
        mine = {name.split(".", 1)[1]: v for name, v in arrays.items()
                if name.split(".", 1)[0] == str(i)}
        if isinstance(held, ErrorFeedback):
            held.load_state_dict({k: mine.get(k) for k in ("worker", "server")})
        elif isinstance(held, LowRankState):
            held.load_state_dict({field: {k.split(".", 1)[1]: v for k, v in mine.items()
                                          if k.split(".", 1)[0] == field}
                                  for field in ("queries", "residuals")})


def as_float32(data: bytes, shape: list) -> np.ndarray:
    return np.frombuffer(data, np.float32).reshape(shape).copy()
