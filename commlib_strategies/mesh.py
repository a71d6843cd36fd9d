"""The parallel layout: one validated object that slices the world's ranks into groups.

The ranks form a grid of shape (pp, dp, ep, cp, tp), row-major, so tensor-parallel
partners are neighbouring ranks (on one host when hosts are filled in rank order, as
mpiexec does) and pipeline stages are the farthest apart. ``group(dim)`` holds the ranks
that differ only in that coordinate: the ones a tp collective, a dp gradient reduction
or a pp send talks to. Every group is created when the mesh is, by every rank in the
same order (creating communicators is collective); pass the mesh explicitly to whatever
needs it. ``joint_group(*dims)`` holds the ranks that differ only in several coordinates
(dp and ep: a pipeline stage's ranks that see different data); it is made the first time
it is asked for, so every rank must ask for it at the same point.
"""
from __future__ import annotations

import math

import commlib

DIMS = ("pp", "dp", "ep", "cp", "tp")


class Mesh:
    def __init__(self, world: commlib.Communicator, *, dp: int = 1, tp: int = 1, pp: int = 1,
                 cp: int = 1, ep: int = 1):
        sizes = check_sizes({"pp": pp, "dp": dp, "ep": ep, "cp": cp, "tp": tp}, world.size)
        self.world = world
        self.sizes = sizes
        self.coords = _unravel(world.rank, [sizes[d] for d in DIMS])
        self._groups = {}
        for i, dim in enumerate(DIMS):
            # ranks that agree on every other coordinate share a group, ordered along dim
            others = self.coords[:i] + (0,) + self.coords[i + 1:]
            self._groups[dim] = world.split(_ravel(others, [sizes[d] for d in DIMS]),
                                            key=self.coords[i])

    def group(self, dim: str) -> commlib.Communicator:
        return self._groups[_check_dim(dim)]

    def joint_group(self, *dims: str) -> commlib.Communicator:
        """The ranks that differ only in the coordinates ``dims``. Collective over the world
        the first time these dimensions are asked for (the world itself when they span it)."""
        if not dims:
            raise ValueError("mesh: joint_group needs at least one dimension, e.g. 'dp', 'ep'")
        key = tuple(d for d in DIMS if d in {_check_dim(d) for d in dims})
        if len(key) == 1:
            return self._groups[key[0]]
        if math.prod(self.sizes[d] for d in key) == self.world.size:
            return self.world
        if key not in self._groups:
            shape = [self.sizes[d] for d in DIMS]
            others = tuple(0 if d in key else c for d, c in zip(DIMS, self.coords))
            inside = tuple(c if d in key else 0 for d, c in zip(DIMS, self.coords))
            self._groups[key] = self.world.split(_ravel(others, shape), key=_ravel(inside, shape))
        return self._groups[key]

    def size(self, dim: str) -> int:
        return self.sizes[_check_dim(dim)]

    def rank(self, dim: str) -> int:
        """This rank's coordinate along ``dim`` (its rank in ``group(dim)``)."""
        return self.coords[DIMS.index(_check_dim(dim))]

    def __repr__(self):
        shape = ", ".join(f"{d}={s}" for d, s in self.sizes.items())
        return f"<Mesh {shape}; rank {self.world.rank} at {dict(zip(DIMS, self.coords))}>"

    def free(self) -> None:
        for g in self._groups.values():
            g.free()

    def shrink(self, timeout: float | None = None) -> "Mesh":
        """The survivors' mesh after a rank died (a call naming it raised CommError): data
        parallelism over the world's ranks still alive (Communicator.shrink; collective over
        them), whose strategies then regroup over its dp group (DataParallel.regroup,
        ZeRO.regroup). Only a mesh of data parallelism alone can shrink: tp, cp, ep and pp
        split the model among ranks, so a dead rank takes a part no survivor has: CommError
        saying so."""
        split = [f"{d}={s}" for d, s in self.sizes.items() if d != "dp" and s > 1]
        if split:
            raise commlib.CommError(
                f"mesh.shrink: this mesh splits the model ({', '.join(split)}): a dead rank "
                f"held a part of it that no survivor has, so there is no smaller mesh to go "
                f"on with; restart every rank from the last checkpoint (commlib-train "
                f"--resume; torchrun --max-restarts restarts the workers)")
        world = self.world.shrink(timeout)
        for g in self._groups.values():
            g.abort()
        return Mesh(world, dp=world.size)


def check_sizes(sizes: dict, world_size: int) -> dict:
    """``sizes`` (dimension -> ranks) if each is a positive int and they multiply to the
    world's size; else ValueError saying which."""
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"mesh: {name} must be a positive int, got {value!r}")
    total = math.prod(sizes.values())
    if total != world_size:
        layout = " x ".join(f"{d}={s}" for d, s in sizes.items() if s > 1) or "1"
        raise ValueError(f"mesh: {layout} makes {total} ranks, but the world has "
                         f"{world_size}; choose sizes whose product is {world_size}")
    return sizes


def _check_dim(dim: str) -> str:
    if dim not in DIMS:
        raise ValueError(f"mesh: unknown dimension {dim!r}; valid: {', '.join(DIMS)}")
    return dim


def _unravel(index: int, shape: list[int]) -> tuple:
    coords = []
    for extent in reversed(shape):
        index, c = divmod(index, extent)
        coords.append(c)
    return tuple(reversed(coords))


def _ravel(coords, shape: list[int]) -> int:
    index = 0
    for c, extent in zip(coords, shape):
        index = index * extent + c
    return index
