"""What a rank holds: bytes of parameters, gradients and optimizer state, measured from the
tensors it actually keeps (each storage counted once), next to the figures the seeds give
for Adam (ZeRO paper accounting, Φ = parameter count, N = data-parallel ranks):

    mixed precision  parameters 2Φ, gradients 2Φ, optimizer 12Φ (fp32 master, m, v)
    fp32             parameters 4Φ, gradients 4Φ, optimizer  8Φ (m, v; ZeRO adds a fp32
                     master shard: 12Φ/N)
    ZeRO stage 1 divides the optimizer state by N, stage 2 also the gradients, stage 3 also
    the parameters.

Measured after backward. Stage 1 reduce-scatters each unit's gradients during backward
(overlapping the rest of it) and keeps them too, full size, as stage 1 holds them: it then
holds the seeds' gradients and this rank's reduced shard, Φ + Φ/N (theory says so).

and what it sends per step: the gradients' all-reduce (plain data parallelism), or their
reduce-scatter plus the parameters' all-gather (ZeRO 1 and 2), moves 2Φ·(N-1)/N elements
per rank; ZeRO 3 gathers the parameters twice (forward, backward): 3Φ·(N-1)/N. The seeds
quote the large-N limits, 2Φ and 3Φ. Measured traffic comes from commlib's own counters
(Communicator.bytes_sent).
"""
from __future__ import annotations

import torch


def _bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def measured(model: torch.nn.Module, optimizer: torch.optim.Optimizer, zero=None) -> dict:
    """Bytes this rank holds now. ``zero``: the ZeRO wrapper, whose shards count as
    parameters (stage 3's parameter shard), gradients and optimizer state (master)."""
    held_params = list(model.parameters())
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    grads = [p.grad for p in held_params]
    if zero is not None:
        held_params.append(zero.param_shard if zero.stage == 3 else None)
        grads.append(zero.grad_shard)
        state.append(zero.master)
    return {"parameters": _bytes(held_params), "gradients": _bytes(grads),
            "optimizer": _bytes(state)}


def traffic_theory(numel: int, dtype: torch.dtype, ranks: int, stage: int) -> float:
    """Bytes each of ``ranks`` data-parallel ranks sends per step (see above)."""
    width = torch.finfo(dtype).bits // 8
    return (3 if stage == 3 else 2) * numel * width * (ranks - 1) / ranks


def theory(numel: int, dtype: torch.dtype, ranks: int, stage: int) -> dict:
    """The seeds' figures for ``numel`` parameters (Adam) on each of ``ranks`` ranks."""
    width = torch.finfo(dtype).bits // 8
    # Adam's m and v, and master weights in fp32 at least where the parameters are not them
    master = max(width, 4)
    states = 3 * master if width < 4 or stage > 0 else 2 * width
    return {"parameters": numel * width / (ranks if stage >= 3 else 1),
            "gradients": numel * width * (1 / ranks if stage >= 2 else
                                          1 + 1 / ranks if stage == 1 else 1),
            "optimizer": numel * states / (ranks if stage >= 1 else 1)}
