"""commlib's benchmarks. Run under mpiexec; rank 0 prints.

    mpiexec -n 2 commlib-bench compare                 # every implementation side by side
    mpiexec -n 2 commlib-bench all_reduce --algo all   # nccl-tests style sweep
    mpiexec -n 2 commlib-bench latency|bandwidth|bibw  # OSU point-to-point
    mpiexec -n 2 commlib-bench overlap                 # OSU osu_iallreduce overlap
    mpiexec -n 2 commlib-bench gpu-overlap             # a matmul with an all_reduce beside it
    mpiexec -n 2 commlib-bench calibrate               # fit the cost model, write tuning file
    commlib-bench kernels                              # reduce kernel vs numpy and memcpy
    commlib-bench gpu-kernels                          # GPU kernels vs a device copy
"""
import argparse
import sys

from . import (calibrate, collective, compare, gpu_kernels, gpu_overlap, kernels, overlap,
               p2p)
from .specs import SPECS

COMMANDS = {**{name: collective for name in SPECS}, "latency": p2p, "bandwidth": p2p,
            "bibw": p2p, "overlap": overlap, "compare": compare, "calibrate": calibrate,
            "kernels": kernels, "gpu-kernels": gpu_kernels, "gpu-overlap": gpu_overlap}
ONE_PROCESS = ("kernels", "gpu-kernels")  # no communicator


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="commlib-bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in COMMANDS.items():
        module.add_arguments(sub.add_parser(name, help=module.__doc__.strip().splitlines()[0]))
    args = parser.parse_args(argv)
    if args.command in ONE_PROCESS:
        return COMMANDS[args.command].main(args) or 0
    import commlib
    return COMMANDS[args.command].main(args, commlib.init()) or 0


if __name__ == "__main__":
    sys.exit(main())
