"""Low-rank gradient averaging: PowerSGD (Vogels, Karimireddy and Jaggi, 2019), one power
iteration a step with the previous step's factor as its start, and error feedback.

    matrix    a tensor of two or more dimensions, as a (first dimension) x (the rest)
              matrix M, n x m. Vectors (biases, norms' weights), and matrices whose
              factors would not carry ``min_ratio`` times fewer elements than they have,
              are averaged as they are, in one call with the second factors.
    factors   P (n x r) and Q (m x r), r the ``rank``: each rank computes P = M Q, the
              ranks average P (one all_reduce for every matrix's), orthonormalise it, each
              computes Q = M^T P and the ranks average Q (one all_reduce): M's average is
              taken as P Q^T, (n + m) r elements on the wire where M has n m.
    query     Q, kept per matrix from one step to the next (the warm start that lets one
              iteration a step track the gradients' leading subspace); the first is drawn
              from ``seed``, the same on every rank.
    residual  M - P Q^T, this rank's, added to its next step's M (error feedback: what the
              rank-r average leaves out is sent later, not lost).

Every rank orthonormalises the same averaged P and multiplies the same factors, so the
results are equal on every rank. LowRankState holds one tensor list's queries and
residuals (state_dict() and load_state_dict() carry them through a checkpoint).
"""
from __future__ import annotations

import numpy as np


class LowRankState:
    """One tensor list's queries and residuals, by the tensors' positions."""

    def __init__(self):
        self.queries: dict[int, np.ndarray] = {}
        self.residuals: dict[int, np.ndarray] = {}

    def reset(self) -> None:
        self.queries.clear()
        self.residuals.clear()

    def state_dict(self) -> dict:
        return {"queries": {i: q.copy() for i, q in self.queries.items()},
                "residuals": {i: r.copy() for i, r in self.residuals.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.queries = {int(i): np.array(q, np.float32) for i, q in state["queries"].items()}
        self.residuals = {int(i): np.array(r, np.float32)
                          for i, r in state["residuals"].items()}


class PowerSGD:
    """Average float32 tensors over a communicator as rank-``rank`` factors (see above)."""

    def __init__(self, rank: int = 4, min_ratio: float = 2.0, seed: int = 0,
                 feedback: bool = True):
        if not isinstance(rank, int) or rank < 1:
            raise ValueError(f"PowerSGD(rank={rank!r}): the factors' rank is a positive int")
        if min_ratio < 1:
            raise ValueError(f"PowerSGD(min_ratio={min_ratio!r}): at least 1 (factors no "
                             f"larger than the matrix)")
        self.rank, self.min_ratio, self.seed, self.feedback = rank, min_ratio, seed, feedback

    def factored(self, shape: tuple) -> bool:
        """Whether a tensor of ``shape`` travels as factors."""
        if len(shape) < 2:
            return False
        n, m = shape[0], int(np.prod(shape[1:]))
        r = min(self.rank, n, m)
        return (n + m) * r * self.min_ratio <= n * m

    def all_reduce(self, comm, tensors: list, state: LowRankState, op: str = "avg") -> None:
        """Average (``op`` "avg") or sum ("sum") ``tensors`` (float32 numpy arrays or CPU
        torch tensors, each contiguous) over ``comm``'s ranks, in place."""
        if op not in ("avg", "sum"):
            raise ValueError(f"PowerSGD sums or averages, not {op!r}")
        arrays = [_float32(t, i) for i, t in enumerate(tensors)]
        if comm.size == 1:
            return
        matrices = [i for i, a in enumerate(arrays) if self.factored(a.shape)]
        whole = [i for i, a in enumerate(arrays) if not self.factored(a.shape)]
        views = {i: arrays[i].reshape(arrays[i].shape[0], -1) for i in matrices}
        if self.feedback:
            for i in matrices:
                residual = state.residuals.get(i)
                if residual is not None:
                    if residual.shape != views[i].shape:
                        raise ValueError(f"PowerSGD: tensor {i} is {views[i].shape}, its "
                                         f"residual {residual.shape}: one LowRankState per "
                                         f"tensor list (or reset() it)")
                    views[i] += residual
        queries = {i: self._query(state, i, views[i].shape[1]) for i in matrices}
        # P = M Q, averaged; orthonormal columns (the same on every rank: the same input)
        ps = _average(comm, [views[i] @ queries[i] for i in matrices], op)
        ps = [np.linalg.qr(p)[0].astype(np.float32) for p in ps]
        # Q = M^T P, averaged, in one call with the tensors that travel whole
        qs = [views[i].T @ p for i, p in zip(matrices, ps)]
        averaged = _average(comm, qs + [arrays[i].reshape(-1) for i in whole], op)
        for k, i in enumerate(whole):
            arrays[i].reshape(-1)[:] = averaged[len(qs) + k]
        for i, p, q in zip(matrices, ps, averaged[:len(qs)]):
            approx = p @ q.T
            if self.feedback:
                state.residuals[i] = views[i] - approx
            views[i][:] = approx
            state.queries[i] = q

    def _query(self, state: LowRankState, i: int, m: int) -> np.ndarray:
        q = state.queries.get(i)
        r = min(self.rank, m)
        if q is None or q.shape != (m, r):
            q = np.random.default_rng((self.seed, i)).standard_normal((m, r)).astype(np.float32)
        return q


def _average(comm, arrays: list, op: str) -> list:
    """``arrays`` summed (or averaged) over the ranks in one call, as new arrays."""
    if not arrays:
        return []
    flat = np.concatenate([a.reshape(-1) for a in arrays]).astype(np.float32, copy=False)
    comm.all_reduce(flat, op=op)
    out, at = [], 0
    for a in arrays:
        out.append(flat[at:at + a.size].reshape(a.shape))
        at += a.size
    return out


def _float32(t, i: int) -> np.ndarray:
    if hasattr(t, "detach") and hasattr(t, "numpy"):  # torch
        if getattr(t, "is_cuda", False):
            raise TypeError(f"PowerSGD: tensor {i} is on the GPU; PowerSGD here averages "
                            f"CPU tensors")
        t = t.detach().numpy()
    if not isinstance(t, np.ndarray) or t.dtype != np.float32:
        raise TypeError(f"PowerSGD: tensor {i} must be float32 (numpy or CPU torch), not "
                        f"{getattr(t, 'dtype', type(t).__name__)}")
    if not t.flags.c_contiguous or not t.flags.writeable:
        raise ValueError(f"PowerSGD: tensor {i} must be contiguous and writable")
    return t
