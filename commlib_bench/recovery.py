"""Time from a rank's death to the survivors' first collective on their shrunk communicator
(Communicator.shrink), one host.

    python -m commlib_bench.recovery [-n 4] [--rounds 10] [--bytes 4M]

Each round starts ``n`` processes that meet through a FileStore, all-reduce a few times,
then the last rank SIGKILLs itself as the others wait for it in an all_reduce of
``--bytes``; the survivors raise, shrink and all-reduce again. A round's time is the
slowest survivor's, from the death (the victim's clock reading just before it) to that
first call returning, split into
seeing the death (the error raised), shrinking, and the call; we report medians over the
rounds. Process start-up is not timed.
"""
import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def worker(rank: int, size: int, directory: str, nbytes: int) -> None:
    import numpy as np
    import torch.distributed as dist

    import commlib
    commlib.abort.unlink_mpich_segments()  # (each process is an MPI singleton)
    store = dist.FileStore(os.path.join(directory, "store"), size)
    comm = commlib.Communicator.from_store(store, rank, size)
    data = np.ones(max(nbytes // 4, 1), np.float32)
    for _ in range(3):
        comm.all_reduce(data)
    if rank == size - 1:  # dies as the others wait for it inside the call
        store.set("died", repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        comm.all_reduce(data)
        raise SystemExit("the call returned with a dead peer")
    except commlib.CommError:
        seen = time.time()
    comm = comm.shrink()
    shrunk = time.time()
    comm.all_reduce(np.ones(1000, np.float32))
    done = time.time()
    died = float(store.get("died"))
    Path(directory, f"rank-{rank}.json").write_text(json.dumps(
        {"seen": seen - died, "shrunk": shrunk - died, "first_call": done - died}))
    comm.free()


def one_round(n: int, nbytes: int) -> dict:
    with tempfile.TemporaryDirectory() as directory:
        procs = [subprocess.Popen([sys.executable, "-m", "commlib_bench.recovery", "--rank",
                                   str(r), "-n", str(n), "--dir", directory,
                                   "--bytes", str(nbytes)]) for r in range(n)]
        codes = [p.wait(timeout=120) for p in procs]
        if codes[:-1] != [0] * (n - 1) or codes[-1] != -signal.SIGKILL:
            raise SystemExit(f"a round ended with exit codes {codes}")
        times = [json.loads(Path(directory, f"rank-{r}.json").read_text())
                 for r in range(n - 1)]
    return {k: max(t[k] for t in times) for k in times[0]}


def size_arg(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=4, help="ranks before the death")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--bytes", type=size_arg, default=4 << 20,
                        help="the all_reduce the survivors wait in")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.n < 2:
        parser.error("-n must be at least 2 (a survivor)")
    if args.rank is not None:
        return worker(args.rank, args.n, args.dir, args.bytes)
    os.environ.setdefault("COMMLIB_TUNING", "off")  # (a shrunk communicator measures none)
    rounds = [one_round(args.n, args.bytes) for _ in range(args.rounds)]
    print(f"recovery, {args.n} ranks, one host, {args.rounds} rounds (median [min, max], ms):")
    for key, what in (("seen", "the death seen (error raised)"), ("shrunk", "shrunk"),
                      ("first_call", "first collective on the shrunk communicator done")):
        values = [r[key] * 1e3 for r in rounds]
        print(f"  {what:<50} {statistics.median(values):8.1f} "
              f"[{min(values):.1f}, {max(values):.1f}]")


if __name__ == "__main__":
    main()
