"""Training throughput: strategies' DP and ZeRO-2/3 on commlib against torch DDP and FSDP2
on gloo, the same GPT and data, in one run.

    mpiexec -n 2 python -m commlib_bench.train [--rounds 3] [--steps 5] [--d-model 256] [--layers 4]
    python -m commlib_bench.train --hosts 2 --link 1gbit    # across 2 namespace hosts (root)

Every contestant starts from the same weights (commlib_strategies.model.GPT, one seed) and trains
on the same global batches with AdamW. Rounds alternate between the contestants so drifts
of the machine hit all alike; a step is forward, backward, the contestant's gradient
communication and the optimizer step, timed on the slowest rank. Reported: median
tokens/s (global batch tokens over step time) and the ratio to the matching torch one.
"""
import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import commlib
import commlib.torch.backend as tb
from commlib.testing import across_hosts, add_host_arguments
from commlib_strategies.data import AdditionDataset, shard, vocab_size
from commlib_strategies.data_parallel import DataParallel
from commlib_strategies.model import GPT, GPTConfig, cross_entropy
from commlib_strategies.zero import ZeRO


class Contestant:
    """A model and how one optimizer step runs on it."""

    def __init__(self, name, model, optimizer, step_optimizer=None):
        self.name, self.model, self.optimizer = name, model, optimizer
        self._step = step_optimizer

    def step(self, x, y):
        cross_entropy(self.model(x), y).backward()  # through DDP's forward, as it needs
        if self._step:
            self._step()
        else:
            self.optimizer.step()
            self.optimizer.zero_grad()


def contestants(config, seed, lr, world):
    adamw = lambda params: torch.optim.AdamW(params, lr=lr)  # noqa: E731
    out = []
    dp = DataParallel(GPT(config, seed), world)
    out.append(Contestant("commlib DP", dp.module, adamw(dp.module.parameters())))
    for stage in (2, 3):
        zero = ZeRO(GPT(config, seed), world, stage, adamw)

        def step(zero=zero):
            zero.step()
            zero.zero_grad()
        out.append(Contestant(f"commlib ZeRO-{stage}", zero.module, zero.optimizer, step))
    ddp = DDP(GPT(config, seed))
    out.append(Contestant("torch DDP gloo", ddp, adamw(ddp.parameters())))
    for reshard, label in ((False, "FSDP2 (ZeRO-2-like) gloo"), (True, "FSDP2 gloo")):
        model = GPT(config, seed)
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        out.append(Contestant(f"torch {label}", model, adamw(model.parameters())))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=16, help="global batch in sequences")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    add_host_arguments(p)
    args = p.parse_args()
    if args.hosts:
        return across_hosts(args, sys.argv[1:], "commlib_bench.train")
    torch.set_num_threads(args.threads)
    tb.init_process_group("gloo")  # torch's default group is gloo; commlib's world is MPI's
    world = commlib.init()
    rank, n = world.rank, world.size
    config = GPTConfig(vocab_size=vocab_size(), seq_len=args.seq_len, d_model=args.d_model,
                       n_heads=max(1, args.d_model // 64), n_layers=args.layers)
    runners = contestants(config, 0, 1e-3, world)
    data = AdditionDataset(0)
    tokens = args.batch * args.seq_len
    times = {c.name: [] for c in runners}
    for r in range(args.rounds + 1):  # round 0 warms up (buffers, DDP buckets, FSDP state)
        for c in runners:
            for i in range(args.steps):  # every contestant sees the same batches
                x, y = data.batch(r * args.steps + i, args.batch, args.seq_len)
                world.barrier()
                start = time.perf_counter()
                c.step(shard(x, rank, n), shard(y, rank, n))
                t = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                world.all_reduce(t, op="max")
                if r:
                    times[c.name].append(float(t))
    if rank == 0:
        numel = sum(p.numel() for p in GPT(config, 0).parameters())
        print(f"# GPT {numel / 1e6:.1f}M parameters, {n} ranks, global batch {args.batch} x "
              f"{args.seq_len} tokens, {args.threads} thread(s)/rank, {args.rounds} rounds x "
              f"{args.steps} steps, alternating")
        rate = {name: tokens / statistics.median(t) for name, t in times.items()}
        pairs = {"commlib DP": "torch DDP gloo", "commlib ZeRO-2": "torch FSDP2 (ZeRO-2-like) gloo",
                 "commlib ZeRO-3": "torch FSDP2 gloo"}
        for name, t in times.items():
            versus = f"  x{rate[name] / rate[pairs[name]]:.2f} vs {pairs[name]}" \
                if name in pairs else ""
            print(f"  {name:32s} {rate[name]:9.0f} tok/s  (median step "
                  f"{statistics.median(t) * 1e3:.1f} ms){versus}")
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
