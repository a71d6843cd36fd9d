"""DP and ZeRO-1/2/3 train the reference GPT on CUDA tensors (the ranks share device 0) for
a few optimizer steps on the same global batches as one process does on the GPU, and must
end with the same parameters (1e-4 relative, fp32). Under mpiexec, on a GPU machine."""
import torch

import commlib
from harness import Checker
from strategies.data import AdditionDataset, shard, vocab_size
from strategies.data_parallel import DataParallel
from strategies.model import GPT, GPTConfig, cross_entropy
from strategies.zero import ZeRO

world = commlib.init()
n, rank = world.size, world.rank
check = Checker()
GPU = torch.device("cuda", 0)

CONFIG = GPTConfig(vocab_size=vocab_size(), seq_len=16, d_model=32, n_heads=4, n_layers=2)
DATA = AdditionDataset(seed=0)
BATCH, STEPS, SEED = 12, 5, 1  # 12 divides by 1..4 ranks


def optimizer(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def batches():
    return [tuple(t.to(GPU) for t in DATA.batch(step, BATCH, CONFIG.seq_len))
            for step in range(STEPS)]


def reference() -> dict:
    model = GPT(CONFIG, SEED).to(GPU)
    opt = optimizer(model.parameters())
    for x, y in batches():
        model.loss(x, y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach() for k, v in model.named_parameters()}


REFERENCE = reference()


def same_as_reference(named):
    for name, p in named:
        assert p.device.type == "cuda", f"{name} left the GPU"
        w = REFERENCE[name]
        assert torch.allclose(p.detach(), w, rtol=1e-4, atol=1e-6), \
            f"{name}: max diff {(p.detach() - w).abs().max():.3g}"


def data_parallel_on_cuda():
    model = DataParallel(GPT(CONFIG, SEED + rank).to(GPU), world, bucket_bytes=8 << 10)
    opt = optimizer(model.parameters())
    for x, y in batches():
        cross_entropy(model(shard(x, rank, n)), shard(y, rank, n)).backward()
        opt.step()
        opt.zero_grad()
    same_as_reference(model.module.named_parameters())


def zero_on_cuda():
    for stage in (1, 2, 3):
        model = ZeRO(GPT(CONFIG, SEED + rank).to(GPU), world, stage, optimizer)
        for x, y in batches():
            cross_entropy(model(shard(x, rank, n)), shard(y, rank, n)).backward()
            model.step()
            model.zero_grad()
        same_as_reference(model.full_parameters().items())


check.run_cases(globals())
