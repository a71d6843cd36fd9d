"""Pipeline schedules on real stages: each schedule's step time and measured idle fraction,
next to the simulator's (with the step's measured action costs, and with unit costs).

    mpiexec -n 2 python commlib_bench/pipeline.py [--d-model 256 --layers 8 --micro-batches 8]

Every stage computes with one thread; the median of --steps steps after one warm-up step.
"""
from __future__ import annotations

import argparse

import torch

import commlib
from commlib_strategies.data import AdditionDataset, vocab_size
from commlib_strategies.model import GPT, GPTConfig
from commlib_strategies.pipeline import Pipeline, PipelineStage
from commlib_strategies.plans import PLANS

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    world = commlib.init()
    config = GPTConfig(vocab_size=vocab_size(), seq_len=args.seq_len, d_model=args.d_model,
                       n_heads=4, n_layers=args.layers)
    data = AdditionDataset(0)
    if world.rank == 0:
        print(f"# {world.size} stages, GPT d_model {args.d_model} x {args.layers} layers, batch "
              f"{args.batch} x {args.seq_len} in {args.micro_batches} micro-batches; median of "
              f"{args.steps} steps")
        print(f"# {'schedule':18s} {'step ms':>8s} {'idle':>6s} {'simulated':>10s} "
              f"{'unit costs':>10s}")
    for name, virtual in SCHEDULES:
        stage = PipelineStage(GPT(config, 0), PLANS["gpt"], world, virtual=virtual)
        pipeline = Pipeline(stage, name, args.micro_batches)
        reports = []
        for step in range(args.steps + 1):
            x, y = data.batch(step, args.batch, args.seq_len)
            pipeline.step(x, y)
            for param in stage.parameters():
                param.grad = None
            if step:  # the first step warms up
                reports.append(pipeline.report)
        median = sorted(reports, key=lambda r: r.seconds)[len(reports) // 2]
        if world.rank == 0:
            print(f"  {name:18s} {median.seconds * 1e3:8.1f} {median.bubble:6.2f} "
                  f"{median.simulated_bubble:10.2f} {pipeline.simulation.bubble:10.2f}", flush=True)


if __name__ == "__main__":
    main()
