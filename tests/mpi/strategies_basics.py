"""commlib_strategies.mesh and commlib_strategies.mappings under mpiexec: the mesh's groups, and
every communication op's forward and backward against a single-process computation of the
same total loss (each rank can rebuild every rank's inputs: they come from seeds). On the CPU,
or (COMMLIB_TEST_DEVICE=cuda) on GPU 0, which the ranks share."""
import torch

import commlib
from harness import Checker, raises, use_device
from commlib_strategies import mappings as m
from commlib_strategies.mesh import Mesh

torch.set_num_threads(1)
world = commlib.init()
n, rank = world.size, world.rank
check = Checker()
DEVICE = use_device()


def data(who, shape, salt):
    g = torch.Generator().manual_seed(1000 * salt + who)  # on the CPU: the same on every device
    return torch.randn(shape, generator=g, dtype=torch.float64, device="cpu").to(DEVICE)


def close(got, want):
    assert got.shape == want.shape, (got.shape, want.shape)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12), (got.flatten()[:4],
                                                               want.flatten()[:4])


def members(group):
    out = torch.empty(group.size, dtype=torch.int64)
    group.all_gather(out, torch.tensor([rank]))
    return out.tolist()


# ------------------------------------------------------------------------------ mesh

def mesh_groups():
    for tp in [d for d in range(1, n + 1) if n % d == 0]:
        mesh = Mesh(world, dp=n // tp, tp=tp)
        assert (mesh.size("dp"), mesh.size("tp")) == (n // tp, tp)
        assert (mesh.rank("dp"), mesh.rank("tp")) == divmod(rank, tp)  # tp varies fastest
        assert members(mesh.group("tp")) == [rank // tp * tp + i for i in range(tp)]
        assert members(mesh.group("dp")) == [rank % tp + i * tp for i in range(n // tp)]
        assert members(mesh.group("pp")) == [rank]
        mesh.free()


def mesh_errors():
    raises(ValueError, f"dp={n + 1} makes {n + 1} ranks, but the world has {n}",
           lambda: Mesh(world, dp=n + 1))
    raises(ValueError, "tp must be a positive int", lambda: Mesh(world, tp=0))
    mesh = Mesh(world, dp=n)
    raises(ValueError, "unknown dimension 'sp'", lambda: mesh.group("sp"))
    mesh.free()


# ------------------------------------------------------------------------------ mappings

def leaf(t):
    return t.clone().requires_grad_(True)


def copy_to_group():
    x = leaf(data(0, (3, 4), 1))  # replicated; each rank uses it with its own weight
    y = m.copy_to_group(x, world)
    (y * data(rank, (3, 4), 2)).sum().backward()
    close(y.detach(), x.detach())
    close(x.grad, sum(data(r, (3, 4), 2) for r in range(n)))


def reduce_from_group():
    p = leaf(data(rank, (5,), 3))  # partial sums
    y = m.reduce_from_group(p, world)
    w = data(0, (5,), 4)
    (y * w).sum().backward()
    close(y.detach(), sum(data(r, (5,), 3) for r in range(n)))
    close(p.grad, w)


def gather_along():
    x = leaf(data(rank, (3, 2, 4), 5))
    y = m.gather_along(x, world, 1)
    w = data(0, (3, 2 * n, 4), 6)
    (y * w).sum().backward()
    close(y.detach(), torch.cat([data(r, (3, 2, 4), 5) for r in range(n)], 1))
    close(x.grad, w.chunk(n, 1)[rank])


def split_along():
    x = leaf(data(0, (3, 2 * n), 7))
    y = m.split_along(x, world, -1)
    (y * data(rank, (3, 2), 8)).sum().backward()
    close(y.detach(), x.detach().chunk(n, -1)[rank])
    close(x.grad, torch.cat([data(r, (3, 2), 8) for r in range(n)], -1))
    if n > 1:
        raises(ValueError, f"into {n} equal parts",
               lambda: m.split_along(data(0, (2 * n + 1,), 9), world, 0))


def reduce_scatter_along():
    p = leaf(data(rank, (2 * n, 3), 10))
    y = m.reduce_scatter_along(p, world, 0)
    (y * data(rank, (2, 3), 11)).sum().backward()
    total = sum(data(r, (2 * n, 3), 10) for r in range(n))
    close(y.detach(), total.chunk(n, 0)[rank])
    close(p.grad, torch.cat([data(r, (2, 3), 11) for r in range(n)], 0))


def all_to_all():
    x = leaf(data(rank, (2 * n, 3), 12))
    y = m.all_to_all(x, world, scatter_dim=0, gather_dim=1)
    (y * data(rank, (2, 3 * n), 13)).sum().backward()
    close(y.detach(), torch.cat([data(s, (2 * n, 3), 12).chunk(n, 0)[rank] for s in range(n)], 1))
    close(x.grad, torch.cat([data(j, (2, 3 * n), 13).chunk(n, 1)[rank] for j in range(n)], 0))


def in_bfloat16():
    x = leaf(data(rank, (4, 2), 14).to(torch.bfloat16))
    y = m.gather_along(m.reduce_from_group(x, world), world, 0)
    y.float().sum().backward()
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16
    assert torch.equal(x.grad, torch.ones_like(x.grad))


check.run_cases(globals())
