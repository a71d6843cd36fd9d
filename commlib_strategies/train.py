"""Train the reference GPT on the embedded addition data, in any layout:

    mpiexec -n 4 python -m commlib_strategies.train --dp 2 --tp 2 --zero 1 --steps 50
    mpiexec -n 4 python -m commlib_strategies.train --pp 2 --schedule zb-h1 --micro-batches 4
    mpiexec -n 4 python -m commlib_strategies.train --cp 2 --sp ring
    mpiexec -n 4 python -m commlib_strategies.train --tp 2 --pp 2 --sp megatron
    mpiexec -n 4 python -m commlib_strategies.train --cp 2 --tp 2 --sp ulysses
    mpiexec -n 4 python -m commlib_strategies.train --ep 2 --experts 4 --topk 2
    mpiexec -n 4 python -m commlib_strategies.train --pp 2 --ep 2 --experts 4 --zero 3
    mpiexec -n 4 python -m commlib_strategies.train --tp 2 --ep 2 --experts 4 --sp megatron
    mpiexec -n 4 python -m commlib_strategies.train --cp 2 --ep 2 --experts 4 --sp ring
    mpiexec -n 4 python -m commlib_strategies.train --pp 2 --tp 2 --experts 4 --sp megatron
    mpiexec -n 4 python -m commlib_strategies.train --cp 2 --tp 2 --experts 4 --sp ulysses
    mpiexec -n 2 python -m commlib_strategies.train --model llama --zero 3

--model MODEL_TYPE trains transformers' causal LM of that model_type (gpt2, llama, mixtral,
qwen3, phi3, qwen2, mistral, qwen3_moe, ...: any its AutoModelForCausalLM knows), from
its own default config shrunk to --layers, --d-model, --heads, --seq-len, in the same
layouts (MoE models: --experts, --topk set its MoE layers; dropless); --config PATH
trains the one a config.json describes, its sizes as they are.
Every model goes one way: parallelize() applies tp, cp and ep by the model's plan
(commlib_strategies/plans.py), PipelineStage cuts it where the plan says, and DataParallel
or ZeRO wrap it.

Every layout builds the same model from --seed and reads the same global batches, so the
losses it prints are the same (to fp32 rounding) for --dp 1, --dp 2 --tp 2, --zero 3,
--pp 2, --cp 2 --sp ulysses, ... (with --experts: the same MoE model in every layout; each
sequence is its own routing group, so routing does not depend on the layout either).
Which dimensions compose is in commlib_strategies/layout.py.
With --save-dir the run saves sharded checkpoints (commlib_strategies/checkpoint.py), which
--resume continues from, in this layout or any other; in the same layout the resumed
losses are bit-identical to an uninterrupted run's.

Each step prints the loss (averaged over the data-parallel ranks), tokens/s and the most
any rank holds of parameters, gradients and optimizer state (commlib_strategies/accounting.py).
With COMMLIB_TRACE=DIR every rank records its calls and the step's forward, backward and
optimizer regions: python -m commlib.trace DIR -o trace.json draws the timeline.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch

import commlib
from commlib.compressed import FORMATS
from commlib.low_rank import PowerSGD
from commlib.testing import across_hosts, add_host_arguments
from commlib.trace import busy_seconds, keep_calls, own_cpu_seconds, region
from commlib_strategies import accounting
from commlib_strategies.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from commlib_strategies.data import AdditionDataset, shard, vocab_size
from commlib_strategies.data_parallel import DataParallel
from commlib_strategies.families import FAMILIES, build, from_file, has_experts, sizes_of
from commlib_strategies.layout import SEQUENCE_KINDS, Layout, check
from commlib_strategies.mesh import DIMS, Mesh
from commlib_strategies.model import GPT, GPTConfig
from commlib_strategies.parallelize import parallelize
from commlib_strategies.config_plans import from_config
from commlib_strategies.plans import PLANS, Plan
from commlib_strategies.expert_parallel import data_shard, reduce_gradients, zero_arguments
from commlib_strategies.moe import moe_gpt
from commlib_strategies.pipeline import Pipeline, PipelineStage
from commlib_strategies.pipeline_schedules import SCHEDULES
from commlib_strategies.sequence_parallel import sequence_shard
from commlib_strategies.zero import ZeRO


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="commlib-train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    layout = p.add_argument_group("layout (the product must equal the number of ranks)")
    layout.add_argument("--dp", type=int, default=None,
                        help="data-parallel ranks (default: the ranks tp leaves)")
    layout.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (default 1)")
    layout.add_argument("--pp", type=int, default=1, help="pipeline stages (default 1)")
    layout.add_argument("--cp", type=int, default=1,
                        help="context-parallel ranks sharing each sequence (default 1; needs "
                             "--sp ulysses or ring)")
    layout.add_argument("--ep", type=int, default=1,
                        help="expert-parallel ranks (default 1; needs --experts)")
    layout.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3],
                        help="ZeRO stage over the dp ranks; 0: plain data parallelism "
                             "with bucketed all-reduce (default)")
    layout.add_argument("--bucket-mb", type=float, default=None,
                        help="gradient bucket size of plain data parallelism, MB (default: "
                             "an eighth of the gradients, at most DDP's 25: with one bucket "
                             "most of them, nothing is left to communicate during backward)")
    layout.add_argument("--compress", metavar="FORMAT", choices=sorted(FORMATS) + ["powersgd"],
                        help="data parallelism's gradients (ZeRO's reduce-scatter too) "
                             "carried in a wire format with error feedback "
                             "(commlib/compressed.py: " + ", ".join(FORMATS) +
                             "; float32 on the CPU), or as low-rank factors (powersgd: "
                             "commlib/low_rank.py; data parallelism without ZeRO)")
    layout.add_argument("--compress-params", metavar="FORMAT", choices=sorted(FORMATS),
                        help="ZeRO-3's parameter gathers carried in a wire format (as "
                             "ZeRO++'s qwZ; float32 on the CPU)")
    layout.add_argument("--low-rank", type=int, default=4, metavar="R",
                        help="--compress powersgd's rank (default 4)")
    layout.add_argument("--no-feedback", action="store_true",
                        help="--compress without error feedback (what encoding loses is lost)")
    layout.add_argument("--sp", choices=SEQUENCE_KINDS,
                        help="sequence parallelism: megatron (on the tp ranks), ulysses or "
                             "ring attention (on the cp ranks)")
    layout.add_argument("--schedule", choices=SCHEDULES, default="1f1b",
                        help="pipeline schedule (default 1f1b)")
    layout.add_argument("--micro-batches", type=int, default=None,
                        help="micro-batches per pipeline step (default: --pp)")
    layout.add_argument("--virtual", type=int, default=None,
                        help="model chunks per stage (default 1; 2 for interleaved-1f1b)")
    model = p.add_argument_group("model")
    model.add_argument("--model", default="gpt", metavar="MODEL_TYPE",
                       help="the project's GPT (default), or transformers' causal LM of this "
                            "model_type (" + ", ".join(FAMILIES) + ", or any other) built "
                            "from its own config shrunk to the sizes below (pip install "
                            "'commlib[models]'; in every layout but a few it names)")
    model.add_argument("--config", metavar="PATH",
                       help="transformers' config.json of the causal LM to train, its sizes "
                            "as they are (--layers, --d-model, --heads are read from it)")
    model.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    model.add_argument("--d-model", type=int, default=64, help="width (default 64)")
    model.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    model.add_argument("--seq-len", type=int, default=32, help="context length (default 32)")
    model.add_argument("--experts", type=int, default=0,
                       help="mixture-of-experts layers with this many experts in every block's "
                            "MLP slot (default 0: dense)")
    model.add_argument("--topk", type=int, default=2, help="experts per token (default 2)")
    model.add_argument("--bf16", action="store_true",
                       help="bf16 parameters and gradients with fp32 master weights and "
                            "Adam states (needs --zero 1, 2 or 3)")
    run = p.add_argument_group("training")
    run.add_argument("--steps", type=int, default=100, help="optimizer steps (default 100)")
    run.add_argument("--batch", type=int, default=16,
                     help="global batch in sequences, split over dp (default 16)")
    run.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    run.add_argument("--seed", type=int, default=0, help="model and data seed (default 0)")
    run.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                     help="where the model and data live (default cpu); cuda: each rank takes "
                          "GPU (its rank on the host mod the GPUs there), ranks may share one")
    ckpt = p.add_argument_group("checkpoints")
    ckpt.add_argument("--save-dir", help="save checkpoints in this directory (step-N/ each)")
    ckpt.add_argument("--save-every", type=int, default=0,
                      help="save every N steps (default: only after the last step)")
    ckpt.add_argument("--resume", nargs="?", const="", metavar="PATH",
                      help="continue from checkpoint PATH (a step-N directory, or a root: its "
                           "newest); without PATH, the newest in --save-dir if there is one")
    out = p.add_argument_group("output")
    out.add_argument("--log", "--step-log", dest="log",
                     help="write a JSON list, one record per step, to this file (under "
                          "torchrun, which takes --log for its own --log-dir: --step-log)")
    out.add_argument("--plot", default="", help="write the loss curve to this PNG file")
    out.add_argument("--quiet", action="store_true", help="print only the summary")
    add_host_arguments(p.add_argument_group(
        "across hosts (root; not under mpiexec): namespace hosts on this machine"))
    args = p.parse_args(argv)
    if args.save_every < 0:
        p.error("--save-every must be >= 0")
    if args.save_every and not args.save_dir:
        p.error("--save-every needs --save-dir")
    if args.resume == "" and not args.save_dir:
        p.error("--resume without PATH resumes from --save-dir: give one of them")
    if args.compress and (args.pp > 1 or args.experts or args.bf16 or args.device != "cpu"):
        p.error("--compress compresses data parallelism's (and ZeRO's) float32 gradients on "
                "the CPU (no --pp, --experts, --bf16 or --device cuda with it yet)")
    if args.no_feedback and not args.compress:
        p.error("--no-feedback is --compress's: give a format")
    if args.compress == "powersgd" and args.zero:
        p.error("--compress powersgd averages plain data parallelism's gradients: ZeRO's "
                "reduce-scatter takes a wire format (int8, bf16, ...), or leave --zero out")
    if args.compress_params and args.zero != 3:
        p.error("--compress-params compresses ZeRO-3's parameter gathers: add --zero 3")
    if args.compress_params and (args.pp > 1 or args.experts or args.bf16 or
                                 args.device != "cpu"):
        p.error("--compress-params compresses float32 parameters on the CPU (no --pp, "
                "--experts, --bf16 or --device cuda with it yet)")
    if args.low_rank < 1:
        p.error(f"--low-rank {args.low_rank}: PowerSGD's rank is at least 1")
    if args.bf16 and args.zero == 0:
        p.error("--bf16 keeps fp32 master weights in ZeRO's optimizer shards: add --zero 1, 2 or 3")
    if args.config:
        try:
            (args.model, args.layers, args.d_model, args.heads, experts,
             topk) = sizes_of(args.config)
        except (OSError, ValueError, ImportError) as e:
            p.error(str(e))
        if experts:  # its own
            args.experts, args.topk = experts, topk
    return args


# the rank on this host, as each launcher names it
LOCAL_RANK_VARIABLES = ("LOCAL_RANK", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK")


def use_device(name: str, world: commlib.Communicator) -> torch.device:
    """Make ``name`` (cpu or cuda) torch's default device, so the model and data are made
    there: for cuda, GPU (rank on the host mod the host's GPUs)."""
    if name == "cpu":
        device = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: torch sees no CUDA device (torch.cuda.is_available() "
                             "is False); run on a GPU machine or leave --device out")
        local = next((int(os.environ[v]) for v in LOCAL_RANK_VARIABLES if v in os.environ),
                     world.rank)
        device = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(device)
    torch.set_default_device(device)
    return device


def layout_of(args, world_size: int) -> Layout:
    """The validated layout the arguments ask for (dp defaults to the ranks the rest leave)."""
    others = {d: getattr(args, d) for d in ("tp", "pp", "cp", "ep")}
    dp = args.dp
    if dp is None:
        rest = math.prod(max(size, 1) for size in others.values())
        if world_size % rest:
            shown = " x ".join(f"--{d} {s}" for d, s in others.items() if s != 1)
            raise ValueError(f"{shown} does not divide the {world_size} ranks; choose a divisor "
                             f"of {world_size} (or give --dp too)")
        dp = world_size // rest
    virtual = args.virtual or (2 if args.schedule == "interleaved-1f1b" else 1)
    if args.model != "gpt" and not args.experts and has_experts(args.model):
        args.experts = 4  # its own MoE layers: top-2 of 4 by default
    layout = Layout(dp=dp, **others, zero=args.zero, sp=args.sp, schedule=args.schedule,
                    microbatches=args.micro_batches or args.pp, virtual=virtual,
                    experts=args.experts, topk=args.topk)
    return check(layout, world_size, args.batch, args.seq_len, args.heads, args.layers,
                 experts_split_over_tp=args.model == "gpt")


def _model(args, layout: Layout):
    """(the one-process model the arguments ask for, its plan)."""
    if args.model == "gpt":
        model = GPT(GPTConfig(vocab_size=vocab_size(), seq_len=args.seq_len,
                              d_model=args.d_model, n_heads=args.heads, n_layers=args.layers),
                    args.seed)
        if not layout.experts:
            return model, PLANS["gpt"]
        # one routing group per sequence: routing is the same in every layout
        return moe_gpt(model, experts=layout.experts, topk=layout.topk, group_rows=1,
                       seed=args.seed), PLANS["gpt-moe"]
    if layout.experts and not has_experts(args.model):
        raise ValueError(f"--experts: --model {args.model} has no mixture-of-experts layers "
                         "(--model mixtral, qwen3_moe or gpt has)")
    if args.config:
        model = from_file(args.config, vocab_size(), args.seed)
    else:
        model = build(args.model, vocab_size(), args.seed, seq_len=args.seq_len,
                      d_model=args.d_model, layers=args.layers, heads=args.heads,
                      experts=layout.experts, topk=layout.topk)
    plan = PLANS.get(args.model)  # hand-written, or the model's own
    if plan is None:
        try:
            plan = from_config(model)
        except ValueError:
            if max(layout.tp, layout.cp, layout.ep, layout.pp) > 1:
                raise
            plan = Plan()  # data parallelism and ZeRO cut nothing by a plan
    return model, plan


def bucket_bytes(model, args) -> int:
    """--bucket-mb's, else an eighth of the model's gradients (at least 1 MiB, at most
    DDP's 25 MiB), so that most of them are communicated during backward."""
    if args.bucket_mb is not None:
        return int(args.bucket_mb * 2**20)
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return int(min(25 << 20, max(1 << 20, grads // 8)))


class Trainer:
    """The model in the requested layout, and one optimizer step of it."""

    def __init__(self, args, world: commlib.Communicator):
        self.layout = layout_of(args, world.size)
        self.mesh = Mesh(world, **self.layout.sizes)
        try:
            # the loss's own communicators: calls on one run in order, and its average
            # must not wait behind the gathers ZeRO issues ahead of the next forward
            self.loss_groups = [self.mesh.group(dim).dup() for dim in ("dp", "ep")]
            self._build(args)
        except BaseException:  # (a model or layout refused: its communicators go too)
            for group in getattr(self, "loss_groups", ()):
                group.free()
            self.mesh.free()
            raise

    def _build(self, args) -> None:
        layout, mesh = self.layout, self.mesh
        model, plan = _model(args, layout)
        self.numel = model.count_parameters()
        self.pipeline = None
        model = parallelize(model, mesh, plan, sp=layout.sp)  # where the plan says
        if layout.pp > 1:
            model = PipelineStage(model, plan, mesh.group("pp"), layout.virtual)
        if args.bf16:
            model = model.to(torch.bfloat16)
        self.model = model

        def adamw(params):
            return torch.optim.AdamW(params, lr=args.lr)
        self.zero = None
        if layout.zero:
            # experts: dense parameters over dp x ep, experts over their replicas
            groups = zero_arguments(model, mesh) if layout.experts else \
                {"group": mesh.group("dp")}
            # a pipeline's microbatches accumulate: it says when a chunk's gradients are final
            # stages 1 and 2 gather the new parameters during the next forward
            self.zero = ZeRO(model, stage=layout.zero, optimizer=adamw,
                             reduce_in_backward=layout.pp == 1,
                             gather_ahead=layout.zero < 3, compress=args.compress,
                             error_feedback=not args.no_feedback,
                             compress_params=args.compress_params, **groups)
            self.optimizer = self.zero.optimizer
        else:
            if layout.pp == 1 and not layout.experts:
                # its hooks average the gradients during backward
                compress = PowerSGD(args.low_rank, feedback=not args.no_feedback) \
                    if args.compress == "powersgd" else args.compress
                self.data_parallel = DataParallel(model, mesh.group("dp"),
                                                  bucket_bytes=bucket_bytes(model, args),
                                                  compress=compress,
                                                  error_feedback=not args.no_feedback)
            self.optimizer = adamw(model.parameters())
        if layout.pp > 1:
            # gradients over dp: averaged by the pipeline, or reduce-scattered by ZeRO (2 and
            # 3 as each chunk's are final, overlapping the schedule; 1 in its step); with
            # experts and no ZeRO, reduce_gradients after the schedule
            reduce = {"gradients": self.zero} if layout.zero >= 2 else \
                {"dp_group": mesh.group("dp")} if not layout.zero and not layout.experts else {}
            self.pipeline = Pipeline(model, layout.schedule, layout.microbatches,
                                     measure=False, **reduce)
        self.args = args
        self.data = AdditionDataset(args.seed)
        self._quiet = None  # bytes sent at the last step's quiet point

    def named_parameters(self):
        """(the reference model's name, parameter) of every parameter this rank holds."""
        if self.pipeline is not None:
            return self.model.named_reference_parameters()
        return self.model.named_parameters()

    def bytes_sent(self) -> int:
        wrappers = [w for w in (self.zero, getattr(self, "data_parallel", None)) if w]
        return sum(self.mesh.group(d).bytes_sent for d in DIMS) + sum(
            g.bytes_sent for w in wrappers for g in w.own_groups)

    def _local_batch(self, step: int):
        x, y = self.data.batch(step, self.args.batch, self.args.seq_len)
        mesh = self.mesh
        if self.layout.experts:
            x, y = data_shard(x, mesh), data_shard(y, mesh)
        else:
            x, y = (shard(t, mesh.rank("dp"), mesh.size("dp")) for t in (x, y))
        if self.layout.cp > 1:
            x, y = (sequence_shard(t, mesh.group("cp")) for t in (x, y))
        return x, y

    def step(self, step: int) -> tuple[float, dict]:
        """One optimizer step on global batch ``step``: (mean loss over the batch, bytes this
        rank held after backward, and sent during the step)."""
        before = self.bytes_sent()
        x, y = self._local_batch(step)
        if self.pipeline is not None:
            with region("pipeline"):
                loss = torch.tensor(self.pipeline.step(x, y), dtype=torch.float64)
        else:
            with region("forward"):
                loss = self.model.loss(x, y)
            with region("backward"):
                loss.backward()
        if self.layout.experts and not self.zero:
            reduce_gradients(self.model, self.mesh)
        held = accounting.measured(self.model, self.optimizer, self.zero)
        # sent: from the last step's point to this one's where no call is in flight (after
        # backward: ZeRO's gathers ahead, issued by the last step, have served its forward)
        quiet = self.bytes_sent()
        held["sent"] = quiet - (before if self._quiet is None else self._quiet)
        self._quiet = quiet
        with region("optimizer"):
            if self.zero:
                self.zero.step()
                self.zero.zero_grad()
            else:
                self.optimizer.step()
                self.optimizer.zero_grad()
        total = loss.detach().double().reshape(1)
        for group in self.loss_groups:  # the ranks that saw different data (dp, ep)
            group.all_reduce(total, op="avg")
        return float(total), held


def _bar(done: int, total: int, width: int = 20) -> str:
    filled = round(width * done / total)
    return "[" + "#" * filled + "." * (width - filled) + "]"


def _mb(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f}"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.hosts:
        return across_hosts(args, sys.argv[1:] if argv is None else argv,
                            "commlib_strategies.train")
    world = commlib.init()
    try:
        use_device(args.device, world)
        trainer = Trainer(args, world)
        keep_calls(1024)  # (its communicators': a step's calls, for busy_seconds)
        first = _resume(args, trainer)
    except ValueError as e:
        if world.rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    lead = world.rank == 0
    if lead:
        name = "GPT" if args.model == "gpt" else args.model
        print(f"# {name} {trainer.numel:,} parameters; {world.size} ranks as "
              f"{trainer.layout.describe()}{', bf16 + fp32 master' if args.bf16 else ''} on "
              f"{args.device}; "
              f"global batch {args.batch} x {args.seq_len} tokens", flush=True)
    if lead and first:
        print(f"# resumed at step {first}", flush=True)
    records, tokens = [], args.batch * args.seq_len
    for step in range(first, args.steps):
        world.barrier()
        start, cpu, own = time.monotonic(), time.process_time(), own_cpu_seconds()
        loss, held = trainer.step(step)
        end = time.monotonic()
        # compute: the CPU the step's own threads spent (not commlib's); communication:
        # while some call of the step was running; the slowest rank's of each
        parts = torch.tensor([end - start, time.process_time() - cpu - (own_cpu_seconds() - own),
                              busy_seconds(start, end)], dtype=torch.float64)
        world.all_reduce(parts, op="max")
        seconds, compute, communication = parts.tolist()
        most = {k: max(v) for k, v in _gather_held(world, held).items()}
        records.append({"step": step, "loss": loss, "seconds": seconds,
                        "compute_seconds": compute, "communication_seconds": communication,
                        "tokens_per_s": tokens / seconds, "bytes_held_max": most})
        if lead and not args.quiet:
            print(f"step {step + 1:4d}/{args.steps} {_bar(step + 1, args.steps)} loss {loss:.6f}"
                  f"  {tokens / seconds:9.0f} tok/s  {seconds * 1e3:.0f} ms (compute "
                  f"{compute * 1e3:.0f}, comm {communication * 1e3:.0f})  MB/rank: params "
                  f"{_mb(most['parameters'])} grads {_mb(most['gradients'])} optim "
                  f"{_mb(most['optimizer'])} sent {_mb(most['sent'])}", flush=True)
        done = step + 1
        if args.save_dir and (done == args.steps
                              or args.save_every and done % args.save_every == 0):
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
    timed = records[1:] or records  # (the first step sets buffers up)
    step, compute, communication = (statistics.median(r[k] for r in timed) for k in (
        "seconds", "compute_seconds", "communication_seconds"))
    print(f"# median step {step * 1e3:.1f} ms: compute {compute * 1e3:.1f} ms (CPU of the "
          f"step's own threads), communication {communication * 1e3:.1f} ms (calls running); "
          f"step / max(compute, communication) {step / max(compute, communication, 1e-9):.2f}, "
          f"hidden {_hidden(step, compute, communication):.0%} of the shorter")
    dp = trainer.mesh.size("dp")
    want["sent"] = accounting.traffic_theory(trainer.numel, dtype, dp, args.zero)
    print("# per-rank MB, measured vs the seeds' figures (Φ/tp parameters per rank; "
          "sent: gradient and parameter traffic of data parallelism, without tp's):")
    layout = trainer.layout
    # the figures are data parallelism's (with ZeRO) over tp slices; other dimensions
    # place parameters and traffic differently
    dp_tp_only = layout.pp == layout.cp == layout.ep == 1 and not layout.experts
    for k in HELD:
        shown = dp_tp_only and (k != "sent" or layout.tp == 1)
        print(f"#   {k:10s} {_mb(got[k]):>10s} {_mb(want[k]) if shown else '-':>10s}")


def _hidden(step: float, compute: float, communication: float) -> float:
    """The share of the shorter of compute and communication that ran beside the other:
    1 where the step took the longer alone, 0 where it took their sum."""
    shorter = min(compute, communication)
    if shorter <= 0:
        return 1.0
    return min(1.0, max(0.0, (compute + communication - step) / shorter))


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
