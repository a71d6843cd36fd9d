"""commlib's benchmarks. Run under mpiexec; rank 0 prints.

    mpiexec -n 2 commlib-bench compare                 # every implementation side by side
    mpiexec -n 2 commlib-bench all_reduce --algo all   # nccl-tests style sweep
    mpiexec -n 2 commlib-bench latency|bandwidth|bibw  # OSU point-to-point
    mpiexec -n 2 commlib-bench overlap                 # OSU osu_iallreduce overlap
    mpiexec -n 2 commlib-bench gpu-overlap             # a matmul with an all_reduce beside it
    mpiexec -n 2 commlib-bench gpu-steps               # a meeting's cost through CUDA IPC
    mpiexec -n 2 commlib-bench calibrate               # fit the cost model, write tuning file
    mpiexec -n 2 commlib-bench user-ops                # a user-defined op vs built-in, mpi4py
    mpiexec -n 2 commlib-bench torch-latency           # through PyTorch: ours, gloo, DeepSpeed
    commlib-bench kernels                              # reduce kernel vs numpy and memcpy
    commlib-bench gpu-kernels                          # GPU kernels vs a device copy
    commlib-bench compare --hosts 2 --per-host 1       # across 2 namespace hosts (as root)

``--hosts N`` (any command that runs on ranks; not under mpiexec) brings up N namespace
hosts on this machine (commlib/testing.py: own network stack, hostname and /dev/shm each,
joined over TCP), runs the command across them under mpiexec, and tears them down.
"""
import argparse
import os
import sys

from . import (calibrate, collective, compare, gpu_kernels, gpu_overlap, gpu_steps, kernels,
               overlap, p2p, torch_latency, user_ops)
from .specs import SPECS

COMMANDS = {**{name: collective for name in SPECS}, "latency": p2p, "bandwidth": p2p,
            "bibw": p2p, "overlap": overlap, "compare": compare, "calibrate": calibrate,
            "kernels": kernels, "gpu-kernels": gpu_kernels, "gpu-overlap": gpu_overlap,
            "gpu-steps": gpu_steps, "user-ops": user_ops, "torch-latency": torch_latency}
ONE_PROCESS = ("kernels", "gpu-kernels")  # no communicator


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="commlib-bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in COMMANDS.items():
        p = sub.add_parser(name, help=module.__doc__.strip().splitlines()[0])
        module.add_arguments(p)
        if name not in ONE_PROCESS:
            add_host_arguments(p)
    args = parser.parse_args(argv)
    if args.command in ONE_PROCESS:
        return COMMANDS[args.command].main(args) or 0
    if args.hosts:
        return across_hosts(args, sys.argv[1:] if argv is None else argv)
    import commlib
    return COMMANDS[args.command].main(args, commlib.init()) or 0


def add_host_arguments(p) -> argparse.ArgumentParser:
    p.add_argument("--hosts", type=int, default=0, metavar="N",
                   help="run across N namespace hosts on this machine (root; not under mpiexec)")
    p.add_argument("--per-host", type=int, default=1, metavar="K", help="ranks per host "
                   "with --hosts (default 1)")
    p.add_argument("--link", metavar="RATE[:BURST]", help="with --hosts: every host's eth0 "
                   "shaped to RATE (tc's tbf: 1gbit, 100mbit:64kb; default unshaped)")
    return p


def across_hosts(args, argv: list, module: str = "commlib_bench") -> int:
    """Run ``python -m module`` with ``argv`` less --hosts/--per-host/--link on
    ``args.per_host`` ranks on each of ``args.hosts`` namespace hosts, their links shaped
    to ``args.link``; returns mpiexec's exit code."""
    from commlib.testing import NamespaceHosts, shaping, usable
    if usable():
        raise SystemExit(f"{module} --hosts: {usable()}")
    if args.hosts < 1 or args.per_host < 1:
        raise SystemExit(f"{module}: --hosts and --per-host take positive counts")
    try:
        shaping(args.link)
    except ValueError as e:
        raise SystemExit(f"{module} --link: {e}") from None
    _, rest = add_host_arguments(argparse.ArgumentParser(add_help=False)).parse_known_args(argv)
    with NamespaceHosts(args.hosts, link=args.link) as h:
        print(f"{module}: {args.hosts} namespace hosts x {args.per_host} ranks"
              f"{f', links {args.link}' if args.link else ''}: {' '.join(rest)}", flush=True)
        job = h.popen(h.command([args.per_host] * args.hosts,
                                [sys.executable, "-m", module, *rest]), cwd=os.getcwd())
        return job.wait()


if __name__ == "__main__":
    sys.exit(main())
