"""Train the reference GPT on the embedded addition data, in any layout:

    mpiexec -n 4 python -m strategies.train --dp 2 --tp 2 --zero 1 --steps 50

Every layout builds the same model from --seed and reads the same global batches, so the
losses it prints are the same (to fp32 rounding) for --dp 1, --dp 2 --tp 2, --zero 3, ...
With --save-dir the run saves sharded checkpoints (strategies/checkpoint.py), which
--resume continues from, in this layout or any other; in the same layout the resumed
losses are bit-identical to an uninterrupted run's.

Each step prints the loss (averaged over the data-parallel ranks), tokens/s and the most
any rank holds of parameters, gradients and optimizer state (strategies/accounting.py).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

import commlib
from strategies import accounting
from strategies.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from strategies.data import AdditionDataset, shard, vocab_size
from strategies.data_parallel import DataParallel
from strategies.mesh import DIMS, Mesh
from strategies.model import GPT, GPTConfig
from strategies.tensor_parallel import tensor_parallel_gpt
from strategies.zero import ZeRO


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m strategies.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    layout = p.add_argument_group("layout (the product must equal the number of ranks)")
    layout.add_argument("--dp", type=int, default=None,
                        help="data-parallel ranks (default: the ranks tp leaves)")
    layout.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (default 1)")
    layout.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3],
                        help="ZeRO stage over the dp ranks; 0: plain data parallelism "
                             "with bucketed all-reduce (default)")
    layout.add_argument("--bucket-mb", type=float, default=25.0,
                        help="gradient bucket size of plain data parallelism, MB (default 25)")
    model = p.add_argument_group("model")
    model.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    model.add_argument("--d-model", type=int, default=64, help="width (default 64)")
    model.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    model.add_argument("--seq-len", type=int, default=32, help="context length (default 32)")
    model.add_argument("--bf16", action="store_true",
                       help="bf16 parameters and gradients with fp32 master weights and "
                            "Adam states (needs --zero 1, 2 or 3)")
    run = p.add_argument_group("training")
    run.add_argument("--steps", type=int, default=100, help="optimizer steps (default 100)")
    run.add_argument("--batch", type=int, default=16,
                     help="global batch in sequences, split over dp (default 16)")
    run.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    run.add_argument("--seed", type=int, default=0, help="model and data seed (default 0)")
    ckpt = p.add_argument_group("checkpoints")
    ckpt.add_argument("--save-dir", help="save checkpoints in this directory (step-N/ each)")
    ckpt.add_argument("--save-every", type=int, default=0,
                      help="save every N steps (default: only after the last step)")
    ckpt.add_argument("--resume", nargs="?", const="", metavar="PATH",
                      help="continue from checkpoint PATH (a step-N directory, or a root: its "
                           "newest); without PATH, the newest in --save-dir if there is one")
    out = p.add_argument_group("output")
    out.add_argument("--log", help="write a JSON list, one record per step, to this file")
    out.add_argument("--plot", default="", help="write the loss curve to this PNG file")
    out.add_argument("--quiet", action="store_true", help="print only the summary")
    args = p.parse_args(argv)
    if args.save_every < 0:
        p.error("--save-every must be >= 0")
    if args.save_every and not args.save_dir:
        p.error("--save-every needs --save-dir")
    if args.resume == "" and not args.save_dir:
        p.error("--resume without PATH resumes from --save-dir: give one of them")
    if args.bf16 and args.zero == 0:
        p.error("--bf16 keeps fp32 master weights in ZeRO's optimizer shards: add --zero 1, 2 or 3")
    return args


class Trainer:
    """The model in the requested layout, and one optimizer step of it."""

    def __init__(self, args, world: commlib.Communicator):
        tp = args.tp
        if args.dp is None and (tp < 1 or world.size % tp):
            raise ValueError(f"--tp {tp} does not divide the {world.size} ranks; choose a "
                             f"divisor of {world.size} (or give --dp too)")
        dp = args.dp if args.dp is not None else world.size // tp
        self.mesh = Mesh(world, dp=dp, tp=tp)
        config = GPTConfig(vocab_size=vocab_size(), seq_len=args.seq_len, d_model=args.d_model,
                           n_heads=args.heads, n_layers=args.layers)
        if args.batch % dp:
            raise ValueError(f"--batch {args.batch} does not divide by dp={dp}; "
                             f"use a multiple of {dp}")
        model = GPT(config, args.seed)
        self.numel = model.count_parameters()
        if tp > 1:
            model = tensor_parallel_gpt(model, self.mesh.group("tp"))
        if args.bf16:
            model = model.to(torch.bfloat16)
        self.model = model

        def adamw(params):
            return torch.optim.AdamW(params, lr=args.lr)
        dp_group = self.mesh.group("dp")
        if args.zero:
            self.zero = ZeRO(model, dp_group, args.zero, adamw)
            self.optimizer = self.zero.optimizer
        else:
            self.zero = None
            # its hooks average the gradients during backward
            self.data_parallel = DataParallel(model, dp_group,
                                              bucket_bytes=int(args.bucket_mb * 2**20))
            self.optimizer = adamw(model.parameters())
        self.args = args
        self.data = AdditionDataset(args.seed)

    def bytes_sent(self) -> int:
        return sum(self.mesh.group(d).bytes_sent for d in DIMS)

    def step(self, step: int) -> tuple[float, dict]:
        """One optimizer step on global batch ``step``: (mean loss over the batch, bytes this
        rank held after backward, and sent during the step)."""
        before = self.bytes_sent()
        x, y = self.data.batch(step, self.args.batch, self.args.seq_len)
        dp, rank = self.mesh.size("dp"), self.mesh.rank("dp")
        loss = self.model.loss(shard(x, rank, dp), shard(y, rank, dp))
        loss.backward()
        held = accounting.measured(self.model, self.optimizer, self.zero)
        if self.zero:
            self.zero.step()
            self.zero.zero_grad()
        else:
            self.optimizer.step()
            self.optimizer.zero_grad()
        held["sent"] = self.bytes_sent() - before
        total = loss.detach().double().reshape(1)
        self.mesh.group("dp").all_reduce(total, op="avg")
        return float(total), held


def _bar(done: int, total: int, width: int = 20) -> str:
    filled = round(width * done / total)
    return "[" + "#" * filled + "." * (width - filled) + "]"


def _mb(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f}"


def main(argv=None) -> int:
    args = parse_args(argv)
    world = commlib.init()
    try:
        trainer = Trainer(args, world)
        first = _resume(args, trainer)
    except ValueError as e:
        if world.rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    lead = world.rank == 0
    mesh = trainer.mesh
    if lead:
        print(f"# GPT {trainer.numel:,} parameters; {world.size} ranks as "
              f"dp={mesh.size('dp')} tp={mesh.size('tp')}, zero={args.zero}"
              f"{', bf16 + fp32 master' if args.bf16 else ''}; global batch {args.batch} x "
              f"{args.seq_len} tokens", flush=True)
    if lead and first:
        print(f"# resumed at step {first}", flush=True)
    records, tokens = [], args.batch * args.seq_len
    for step in range(first, args.steps):
        world.barrier()
        start = time.perf_counter()
        loss, held = trainer.step(step)
        seconds = time.perf_counter() - start
        most = {k: max(v) for k, v in _gather_held(world, held).items()}
        records.append({"step": step, "loss": loss, "seconds": seconds,
                        "tokens_per_s": tokens / seconds, "bytes_held_max": most})
        if lead and not args.quiet:
            print(f"step {step + 1:4d}/{args.steps} {_bar(step + 1, args.steps)} loss {loss:.6f}"
                  f"  {tokens / seconds:9.0f} tok/s  MB/rank: params {_mb(most['parameters'])}"
                  f" grads {_mb(most['gradients'])} optim {_mb(most['optimizer'])}"
                  f" sent {_mb(most['sent'])}", flush=True)
        done = step + 1
        if args.save_dir and (done == args.steps or args.save_every and done % args.save_every == 0):
            path = save_checkpoint(args.save_dir, done, trainer)
            if lead and not args.quiet:
                print(f"# saved {path}", flush=True)
    if lead and not records:
        print(f"# nothing to do: the run is at step {first} of {args.steps}")
    if lead and records:
        _summary(args, trainer, records)
        if args.plot:
            _plot(records, args.plot)
    if lead and args.log:
        with open(args.log, "w") as f:
            json.dump(records, f, indent=1)
    return 0


def _resume(args, trainer) -> int:
    """The step to start from: 0, or the step of the checkpoint --resume names."""
    if args.resume is None:
        return 0
    path = args.resume or latest_checkpoint(args.save_dir)
    return 0 if path is None else load_checkpoint(path, trainer)


HELD = ("parameters", "gradients", "optimizer", "sent")


def _gather_held(world, held: dict) -> dict:
    values = torch.tensor([held[k] for k in HELD], dtype=torch.int64)
    out = torch.empty(world.size * len(HELD), dtype=torch.int64)
    world.all_gather(out, values)
    rows = out.view(world.size, len(HELD))
    return {k: rows[:, i].tolist() for i, k in enumerate(HELD)}


def _summary(args, trainer, records) -> None:
    rates = sorted(r["tokens_per_s"] for r in records[1:] or records)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    want = accounting.theory(trainer.numel // trainer.mesh.size("tp"), dtype,
                             trainer.mesh.size("dp"), args.zero)
    got = records[-1]["bytes_held_max"]
    print(f"# final loss {records[-1]['loss']:.6f}; median {rates[len(rates) // 2]:.0f} tok/s")
    dp = trainer.mesh.size("dp")
    want["sent"] = accounting.traffic_theory(trainer.numel, dtype, dp, args.zero)
    print("# per-rank MB, measured vs the seeds' figures (Φ/tp parameters per rank; "
          "sent: gradient and parameter traffic of data parallelism, without tp's):")
    for k in HELD:
        theory = _mb(want[k]) if k != "sent" or trainer.mesh.size("tp") == 1 else "-"
        print(f"#   {k:10s} {_mb(got[k]):>10s} {theory:>10s}")


def _plot(records, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("# no plot: matplotlib is not installed (pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["step"] for r in records], [r["loss"] for r in records])
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("GPT on the addition data")
    fig.tight_layout()
    fig.savefig(path)
    print(f"# loss curve: {path}")


if __name__ == "__main__":
    sys.exit(main())
