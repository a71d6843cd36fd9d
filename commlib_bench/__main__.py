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
import sys

from commlib.testing import add_host_arguments, across_hosts

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


if __name__ == "__main__":
    sys.exit(main())
