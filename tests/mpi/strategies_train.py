"""Each parallel layout trains the reference GPT for a few optimizer steps on the same global
batches as one process does, and must end with the same parameters (1e-4 relative, fp32).
Under mpiexec, on the CPU or (COMMLIB_TEST_DEVICE=cuda) on GPU 0, which the ranks share."""
import torch

import commlib
from harness import Checker, raises, use_device
from commlib_strategies.data import AdditionDataset, shard, vocab_size
from commlib_strategies.data_parallel import DataParallel
from commlib_strategies.model import GPT, GPTConfig, cross_entropy
from commlib_strategies.zero import ZeRO

torch.set_num_threads(1)
world = commlib.init()
n, rank = world.size, world.rank
check = Checker()
DEVICE = use_device()

CONFIG = GPTConfig(vocab_size=vocab_size(), seq_len=16, d_model=32, n_heads=4, n_layers=2)
DATA = AdditionDataset(seed=0)
BATCH, STEPS, SEED = 12, 5, 1  # 12 divides by 1..4 ranks


def optimizer(params):
    # SGD with momentum (state to shard) rather than Adam: Adam divides by the gradient's
    # own scale, so it would blow rounding noise in gradients that are zero in theory (the
    # key bias: softmax ignores a shift shared by all keys) up to full-size steps.
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def batches(steps=STEPS):
    return [DATA.batch(step, BATCH, CONFIG.seq_len) for step in range(steps)]


def reference(micro=1) -> dict:
    """One process, whole batches (each split into ``micro`` accumulated micro-batches)."""
    model = GPT(CONFIG, SEED)
    opt = optimizer(model.parameters())
    for x, y in batches():
        for xs, ys in zip(x.chunk(micro), y.chunk(micro)):
            (model.loss(xs, ys) / micro).backward()
        opt.step()
        opt.zero_grad()
    return dict(model.named_parameters())


REFERENCE = reference()


def same_as_reference(named, want=REFERENCE):
    for name, p in named:
        assert p.device == DEVICE, f"{name} is on {p.device}, not {DEVICE}"
        w = want[name].detach()
        assert torch.allclose(p.detach(), w, rtol=1e-4, atol=1e-6), \
            f"{name}: max diff {(p.detach() - w).abs().max():.3g}"


# ------------------------------------------------------------------------------ DP

def data_parallel():
    model = DataParallel(GPT(CONFIG, SEED + rank), world, bucket_bytes=8 << 10)  # seeds differ:
    opt = optimizer(model.parameters())                                # the broadcast fixes it
    for x, y in batches():
        cross_entropy(model(shard(x, rank, n)), shard(y, rank, n)).backward()
        opt.step()
        opt.zero_grad()
    same_as_reference(model.module.named_parameters())
    assert len(model.buckets) > 3
    if n > 1:  # some buckets' all-reduce was launched while backward was still running
        assert model.launched_during_backward > 0
    if DEVICE.type == "cuda" and n > 1:  # registered buckets: zero-copy all-reduce
        assert len(model.registered) == len(model.buckets)
        assert any(c["algorithm"] == "zerocopy" for c in world.flight_record())
    else:
        assert model.registered == []


def data_parallel_accumulates_with_no_sync():
    model = DataParallel(GPT(CONFIG, SEED), world)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref = GPT(CONFIG, SEED)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in batches(3):
        xs, ys = shard(x, rank, n), shard(y, rank, n)
        with model.no_sync():
            (cross_entropy(model(xs[:1]), ys[:1]) / 2).backward()
        (cross_entropy(model(xs[1:]), ys[1:]) / 2).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # the gradients stay views of the buckets
        # the same total on one process: each rank's two halves, averaged over ranks
        for r in range(n):
            xr, yr = shard(x, r, n), shard(y, r, n)
            (ref.loss(xr[:1], yr[:1]) / (2 * n)).backward()
            (ref.loss(xr[1:], yr[1:]) / (2 * n)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    same_as_reference(model.module.named_parameters(), dict(ref.named_parameters()))


def data_parallel_errors():
    raises(ValueError, "bucket_bytes must be positive",
           lambda: DataParallel(GPT(CONFIG, SEED), world, bucket_bytes=0))
    if n > 1:
        raises(ValueError, f"does not divide by dp={n}", lambda: shard(torch.ones(n + 1), 0, n))


# ------------------------------------------------------------------------------ ZeRO

def train_zero(stage, micro=1):
    model = ZeRO(GPT(CONFIG, SEED + rank), world, stage, optimizer)
    for x, y in batches():
        xs, ys = shard(x, rank, n), shard(y, rank, n)
        for xm, ym in zip(xs.chunk(micro), ys.chunk(micro)):
            (cross_entropy(model(xm), ym) / micro).backward()
        model.step()
        model.zero_grad()
    return model


def zero_stage_1():
    model = train_zero(1)
    same_as_reference(model.full_parameters().items())
    shard_elems = model.master.numel()
    total = sum(p.numel() for p in model.module.parameters())
    assert shard_elems <= total // n + len(model.units), (shard_elems, total, n)


def zero_stage_2():
    model = train_zero(2)
    same_as_reference(model.full_parameters().items())
    # every unit's reduce-scatter was launched from backward, once its gradients were done
    assert model.reduced_during_backward == STEPS * len(model.units)


def zero_stage_3():
    model = train_zero(3)
    assert all(p.numel() == 0 for p in model.module.parameters())  # only shards are kept
    # every gather but the first of each forward and backward was prefetched
    assert model.prefetched == STEPS * 2 * (len(model.units) - 1), model.prefetched
    same_as_reference(model.full_parameters().items())


def zero_stage_2_and_3_accumulate_micro_batches():
    # one process computing the same total: each rank's micro-batches, averaged over ranks
    ref = GPT(CONFIG, SEED)
    opt = optimizer(ref.parameters())
    for x, y in batches():
        for r in range(n):
            for xm, ym in zip(shard(x, r, n).chunk(2), shard(y, r, n).chunk(2)):
                (ref.loss(xm, ym) / (2 * n)).backward()
        opt.step()
        opt.zero_grad()
    for stage in (2, 3):
        same_as_reference(train_zero(stage, micro=2).full_parameters().items(),
                          dict(ref.named_parameters()))


def zero_errors():
    raises(ValueError, "stage must be 1, 2 or 3",
           lambda: ZeRO(GPT(CONFIG, SEED), world, 4, optimizer))


check.run_cases(globals())
