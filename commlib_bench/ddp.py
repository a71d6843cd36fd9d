"""DDP (and FSDP2) step time, commlib backend vs gloo, in one run on the same data.

    mpiexec -n 2 python -m commlib_bench.ddp [--rounds 5] [--steps 10] [--batch 32] [--fsdp]
                                             [--compress int8,bf16]
    python -m commlib_bench.ddp --hosts 2 --link 1gbit      # across 2 namespace hosts (root)

A ~25M-parameter MLP is wrapped three times from the same initial weights: commlib, gloo,
and commlib with its zero-copy hook (commlib/torch/hooks.py: buckets all-reduced in shared
memory); with ``--fsdp`` twice more, by FSDP2 (``fully_shard`` per layer) on each backend.
Two references: DDP with a hook that communicates nothing (what no backend can go below:
commlib / gloo cannot beat its ratio to gloo), and the step without DDP.
Rounds alternate between them (commlib, gloo, hooked, ...) so that drifts of the machine hit
both alike; each step is forward, backward (with DDP's bucket all-reduces) and an SGD
update. Step time is the slowest rank's, as DDP waits for all; we report the median.
Last, DDP's buckets as it built them are all-reduced alone on each backend, each just
written: added to the step that communicates nothing, they foretell the ratio (where it
misses, the communication is what to look at, not the overlap). ``--compress`` adds DDP
through commlib's compressed hook (commlib/torch/compression.py) in each format, and
torch's own fp16 and PowerSGD hooks on gloo, with the bytes a step sends; with ``--fsdp``
too, FSDP2 on commlib with each layer's reduce-scatter in each format, and with its
parameters' all-gathers in it as well.
"""
import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import commlib.torch.backend as tb
from commlib.testing import across_hosts, add_host_arguments
from commlib.trace import busy_seconds, keep_calls
from commlib.torch.hooks import RegisteredBuckets, zero_copy_hook


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2048, 4096), nn.ReLU(), nn.Linear(4096, 2048), nn.ReLU(),
                         nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                         nn.Linear(2048, 10))


def _as_it_is(buckets: dict, bucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP comm hook that communicates nothing: the bucket as this rank has it (its
    elements noted in ``buckets`` by its index)."""
    buckets[bucket.index()] = bucket.buffer().numel()
    done = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


def fsdp2(model: nn.Module, group, wire=None, gathered=False) -> nn.Module:
    """``model`` sharded by FSDP2 over ``group``: each Linear, then the whole; each layer's
    all-gather prefetched while the layer before it (in forward; after it, in backward)
    computes (FSDP2's explicit prefetching: on the CPU there are no streams to overlap on).
    With ``wire``, each layer's gradients reduce-scattered in it (CompressedReduceScatter)
    and, where ``gathered``, its parameters all-gathered in it (CompressedAllGather): kept
    as the model's ``compressed`` (bytes counted)."""
    from commlib.torch.compression import CompressedAllGather, CompressedReduceScatter
    mesh = DeviceMesh.from_group(group, "cpu")
    layers = [layer for layer in model if isinstance(layer, nn.Linear)]
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    for before, after in zip(layers, layers[1:]):
        before.set_modules_to_forward_prefetch([after])
        after.set_modules_to_backward_prefetch([before])
    root = fully_shard(model, mesh=mesh)
    root.compressed = []
    for layer in layers if wire else []:
        root.compressed.append(CompressedReduceScatter(wire))
        layer.set_custom_reduce_scatter(root.compressed[-1])
        if gathered:
            root.compressed.append(CompressedAllGather(wire))
            layer.set_custom_all_gather(root.compressed[-1])
    return root


def add_compressed(models: dict, groups: dict, formats: list) -> dict:
    """DDP through commlib's compressed hook in each of ``formats``, and torch's fp16 and
    PowerSGD hooks on gloo beside them, added to ``models``; returns the hooks' states."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    from commlib.torch.compression import CompressedBuckets, compressed_hook
    states = {}
    for fmt in formats:
        name = f"commlib {fmt}+ef"
        groups[name] = groups["commlib"]
        ddp = DDP(mlp(), process_group=groups[name])
        states[name] = CompressedBuckets(groups[name], fmt)
        ddp.register_comm_hook(states[name], compressed_hook)
        models[name] = (ddp, torch.optim.SGD(ddp.parameters(), lr=1e-3))
    if formats:
        gloo = groups["gloo"]
        # (PowerSGD in one bucket: its second all-reduce, issued from the first's callback
        # on gloo's threads, went out in another order on each rank with several buckets,
        # and gloo aborted on the mismatch)
        for name, state, hook, cap in [
                ("torch fp16 (gloo)", gloo, default_hooks.fp16_compress_hook, 25),
                ("torch powersgd (gloo)", powerSGD_hook.PowerSGDState(
                    process_group=gloo, matrix_approximation_rank=4, start_powerSGD_iter=2),
                 powerSGD_hook.powerSGD_hook, 1024)]:
            groups[name] = gloo
            ddp = DDP(mlp(), process_group=gloo, bucket_cap_mb=cap)
            ddp.register_comm_hook(state, hook)
            models[name] = (ddp, torch.optim.SGD(ddp.parameters(), lr=1e-3))
    return states


def buckets_alone(sizes, group, rounds) -> float:
    """Seconds a step that all-reduces buckets of ``sizes`` elements one after another,
    each just written (as the backward pass writes it) and after a barrier (no rank waits
    for a late peer), spends in them: the slowest rank's, the median over ``rounds``."""
    buckets = [torch.empty(n) for n in sizes]
    times = []
    for _ in range(rounds):
        spent = 0.0
        for b in buckets:
            b.fill_(1.0)
            dist.barrier(group=group)
            start = time.perf_counter()
            dist.all_reduce(b, group=group)
            spent += time.perf_counter() - start
        times.append(slowest(spent, group))
    return statistics.median(times)


def slowest(seconds: float, group) -> float:
    """The slowest rank's ``seconds`` (collective): what a step waiting for all takes."""
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, dist.ReduceOp.MAX, group=group)
    return t.item()


def timed_steps(model, opt, x, y, steps, group) -> list:
    times = []
    for _ in range(steps):
        dist.barrier(group=group)
        start = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        times.append(slowest(time.perf_counter() - start, group))
    return times


def where_the_step_goes(model, opt, x, y, group, steps: int) -> tuple:
    """(before the first bucket's call, the calls' busy time, after the last, step), ms,
    medians over ``steps``: where DDP's step on the commlib backend goes (its calls from
    the communicator's flight recorder, on time.monotonic's clock). Before the first call
    the step computes its forward and the first bucket's backward: communication cannot
    start earlier; after the last come the copy back and the optimizer step."""
    comm = group.comm
    parts = []
    for _ in range(steps):
        dist.barrier(group=group)
        start = time.monotonic()
        opt.zero_grad(set_to_none=False)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        end = time.monotonic()
        calls = [r for r in comm.flight_record() if r["issued"] >= start and r["finished"]
                 and r["collective"] == "all_reduce"]
        if not calls:
            continue
        first = min(r["started"] for r in calls)
        last = max(r["finished"] for r in calls)
        busy = busy_seconds(start, end)
        parts.append([first - start, busy, end - last, end - start])
    return tuple(statistics.median(p[i] for p in parts) * 1e3 for i in range(4))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 on both backends too")
    parser.add_argument("--compress", default="", metavar="FORMATS",
                        help="wire formats (commlib/compressed.py: bf16, fp16, int8, fp8_e4m3, "
                             "fp8_e5m2), comma-separated: DDP through commlib's compressed "
                             "hook with error feedback in each, beside torch's fp16 and "
                             "PowerSGD (rank 4, error feedback) hooks on gloo")
    add_host_arguments(parser)
    args = parser.parse_args()
    if args.hosts:
        return across_hosts(args, sys.argv[1:], "commlib_bench.ddp")
    torch.set_num_threads(args.threads)

    tb.init_process_group()
    rank, size = dist.get_rank(), dist.get_world_size()
    groups = {"commlib": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    groups["hooked"] = groups["commlib"]  # commlib with its zero-copy hook
    models = {}
    for name, group in groups.items():
        ddp = DDP(mlp(), process_group=group)
        if name == "hooked":
            ddp.register_comm_hook(RegisteredBuckets(group), zero_copy_hook)
        models[name] = (ddp, torch.optim.SGD(ddp.parameters(), lr=1e-3))
    compressed = add_compressed(models, groups, [f for f in args.compress.split(",") if f])
    formats = [f for f in args.compress.split(",") if f]
    for backend, wire, gathered in [("commlib", None, False), ("gloo", None, False)] + [
            ("commlib", f, g) for f in formats for g in (False, True)] if args.fsdp else ():
        name = f"fsdp2 {backend}" + (f" {wire}+ef" if wire else "") + (
            f", gathers {wire}" if gathered else "")
        groups[name] = groups[backend]
        model = fsdp2(mlp(), groups[backend], wire, gathered)
        models[name] = (model, torch.optim.SGD(model.parameters(), lr=1e-3))
    # References, timed with the others: DDP whose hook communicates nothing (its buckets'
    # copies and hooks alone: the least any backend's step can take), and the same step
    # without DDP.
    groups["ddp, no comm"] = groups["no comm"] = groups["commlib"]
    silent = DDP(mlp(), process_group=groups["commlib"])
    buckets: dict = {}  # its buckets' elements by index, as DDP last built them
    silent.register_comm_hook(buckets, _as_it_is)
    models["ddp, no comm"] = (silent, torch.optim.SGD(silent.parameters(), lr=1e-3))
    local = mlp()
    models["no comm"] = (local, torch.optim.SGD(local.parameters(), lr=1e-3))
    keep_calls(4096)  # (where_the_step_goes reads a step's calls)
    params = sum(p.numel() for p in models["commlib"][0].parameters())
    g = torch.Generator().manual_seed(rank)
    x, y = (torch.randn(args.batch, 2048, generator=g),
            torch.randint(0, 10, (args.batch,), generator=g))

    for name, (ddp, opt) in models.items():  # warm up: DDP rebuilds its buckets after step 1
        timed_steps(ddp, opt, x, y, 3, groups[name])
    times = {name: [] for name in models}
    for _ in range(args.rounds):
        for name, (ddp, opt) in models.items():
            times[name] += timed_steps(ddp, opt, x, y, args.steps, groups[name])

    # Same data and weights: after the same steps the models must hold the same weights,
    # to the rounding of sums added in another order (the backends' algorithms differ from
    # 3 ranks on)
    with torch.no_grad():
        apart = max(float((o - g).abs().max() / g.abs().max().clamp_min(1e-30))
                    for name in ("commlib", "hooked")
                    for o, g in zip(models[name][0].parameters(),
                                    models["gloo"][0].parameters()))
    same = f"{'yes' if apart <= 1e-5 else 'NO'} (apart by {apart:.1e} of the largest weight)"
    # Where the commlib step's time goes: compute before the first bucket, the calls, after
    before, busy, after, step = where_the_step_goes(*models["commlib"], x, y,
                                                    groups["commlib"], args.steps)
    # Where the step's communication goes: the same buckets all-reduced alone
    sizes = [buckets[i] for i in sorted(buckets)]
    alone = {name: buckets_alone(sizes, groups[name], args.rounds * args.steps)
             for name in ("commlib", "gloo")}

    if rank == 0:
        med = {name: statistics.median(t) for name, t in times.items()}
        print(f"DDP {params / 1e6:.1f}M-parameter MLP, {size} ranks, batch {args.batch}, "
              f"{args.threads} thread(s)/rank, {args.rounds} rounds x {args.steps} steps, "
              f"alternating")
        for name, t in times.items():
            print(f"  {name:13s} median step {med[name] * 1e3:7.1f} ms   "
                  f"(min {min(t) * 1e3:.1f}, max {max(t) * 1e3:.1f})")
        print(f"  commlib / gloo step time: {med['commlib'] / med['gloo']:.2f}, with the "
              f"zero-copy hook {med['hooked'] / med['gloo']:.2f}   (target <= 0.80)   "
              f"same weights after training: {same}")
        print(f"  the least it could be (DDP communicating nothing / gloo): "
              f"{med['ddp, no comm'] / med['gloo']:.2f}")
        floor = med["ddp, no comm"]  # (what explains the ratio: the step's communication)
        print(f"  its {len(sizes)} buckets ({', '.join(f'{4 * n / 2**20:.1f}' for n in sizes)}"
              f" MiB) all-reduced alone, each just written: commlib {alone['commlib'] * 1e3:.1f}"
              f" ms a step, gloo {alone['gloo'] * 1e3:.1f} ms; DDP communicating nothing plus"
              f" those: {(floor + alone['commlib']) / (floor + alone['gloo']):.2f}")
        print(f"  commlib's step ({step:.1f} ms): {before:.1f} ms before its first bucket's "
              f"call (forward, the first bucket's backward), calls running {busy:.1f} ms, "
              f"{after:.1f} ms after the last; the least such a step takes: "
              f"{before + busy + after:.1f} ms")
        if args.fsdp:
            print(f"  FSDP2 commlib / gloo step time: "
                  f"{med['fsdp2 commlib'] / med['fsdp2 gloo']:.2f}")
            for name, (model, _) in models.items():
                if getattr(model, "compressed", None):
                    sent = sum(c.bytes_sent for c in model.compressed)
                    print(f"  {name}: / FSDP2 gloo {med[name] / med['fsdp2 gloo']:.2f}, "
                          f"/ FSDP2 commlib {med[name] / med['fsdp2 commlib']:.2f}; "
                          f"{sent / (3 + args.rounds * args.steps) / 2**20:.2f} MiB sent "
                          f"compressed a step by rank 0")
        steps = 3 + args.rounds * args.steps
        for name, state in compressed.items():
            print(f"  {name}: step / DDP communicating nothing "
                  f"{med[name] / med['ddp, no comm']:.2f}, / gloo {med[name] / med['gloo']:.2f}"
                  f"; {state.bytes_sent / steps / 2**20:.2f} MiB sent a step by rank 0 "
                  f"(uncompressed {4 * params / 2**20:.1f} MiB of gradients)")
        for name in ("torch fp16 (gloo)", "torch powersgd (gloo)"):
            if name in med:
                print(f"  {name}: step / DDP communicating nothing "
                      f"{med[name] / med['ddp, no comm']:.2f}, / gloo "
                      f"{med[name] / med['gloo']:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
