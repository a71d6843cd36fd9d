"""Compressed gradients' quality: commlib-train with each compression against the
uncompressed run, the same model, data and seed, at each rank count.

    python -m commlib_bench.compression [--ranks 2,4] [--models gpt,qwen3] [--steps 300]
                                        [--seeds 3] [--runs none,int8,...]
                                        [--plot docs/compression.png]

Each run is `commlib-train --dp N --steps S --model M --seed K [--compress C
[--no-feedback]]` under mpiexec (launched from here, one after the other). A run's loss is
the mean of its last 10% of steps (one step's loss wanders by about 1%). A small model's
trajectory is chaotic: any change to a gradient (a seed's, or a format's rounding) moves
where it ends by about as much as the formats differ, so each compression runs with each
seed and is compared with the uncompressed run of the same seed. The table gives the
mean loss over the seeds, the mean of the paired gaps and their range; the uncompressed
row's range is the seeds' own spread, the noise floor. The bytes are those a rank sent a
step. The plot draws the curves (mean over the seeds, smoothed over 15 steps) side by
side, one panel per model and rank count.
"""
import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from commlib.testing import default_mpiexec

# (name, commlib-train's flags)
RUNS = [("none", []), ("bf16", ["--compress", "bf16"]), ("int8", ["--compress", "int8"]),
        ("fp8_e4m3", ["--compress", "fp8_e4m3"]), ("fp8_e5m2", ["--compress", "fp8_e5m2"]),
        ("int8, no feedback", ["--compress", "int8", "--no-feedback"]),
        ("powersgd r4", ["--compress", "powersgd", "--low-rank", "4"]),
        ("powersgd r4, no feedback", ["--compress", "powersgd", "--no-feedback"])]


def train(ranks: int, model: str, steps: int, seed: int, flags: list, log: Path) -> list:
    """One run's step records (commlib-train's --log)."""
    command = [default_mpiexec(), "-n", str(ranks), sys.executable, "-m",
               "commlib_strategies.train", "--dp", str(ranks), "--model", model, "--steps",
               str(steps), "--seed", str(seed), "--quiet", "--log", str(log), *flags]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}")
    return json.loads(log.read_text())


def tail_loss(records: list) -> float:
    tail = records[-max(1, len(records) // 10):]
    return sum(r["loss"] for r in tail) / len(tail)


def smoothed(values: list, width: int = 15) -> list:
    return [sum(values[max(0, i - width + 1):i + 1]) / len(values[max(0, i - width + 1):i + 1])
            for i in range(len(values))]


def mean_curve(runs: list) -> list:
    """The runs' losses, step by step, averaged over the runs (seeds)."""
    return [sum(r[i]["loss"] for r in runs) / len(runs) for i in range(len(runs[0]))]


def plot(results: dict, path: str) -> None:
    """``results``: (model, ranks, name) -> the runs, one per seed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = sorted({key[:2] for key in results})
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (model, ranks) in zip(axes[0], panels):
        for name, _ in RUNS:
            runs = results.get((model, ranks, name))
            if runs:
                ax.plot(smoothed(mean_curve(runs)), label=name, lw=2 if name == "none" else 1)
        seeds = len(results[(model, ranks, "none")])
        ax.set_title(f"{model}, {ranks} ranks ({seeds} seed{'s' * (seeds > 1)})")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (15-step mean)")
        lowest = min(min(tail_loss(r) for r in runs)
                     for key, runs in results.items() if key[:2] == (model, ranks))
        ax.set_ylim(lowest - 0.05, lowest + 0.8)  # (the curves' ends, where they differ)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", default="2,4", help="rank counts, comma-separated")
    p.add_argument("--models", default="gpt,qwen3",
                   help="commlib-train's --model values, comma-separated")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 for every run")
    p.add_argument("--runs", default=",".join(name for name, _ in RUNS),
                   help="which compressions, comma-separated (default all): " +
                        ", ".join(name for name, _ in RUNS))
    p.add_argument("--plot", default="", help="write the curves to this PNG file")
    args = p.parse_args(argv)
    chosen = args.runs.split(",")
    unknown = sorted(set(chosen) - {name for name, _ in RUNS})
    if unknown or "none" not in chosen:
        p.error(f"--runs: {', '.join(unknown) or 'none missing'}; choose among "
                f"{', '.join(name for name, _ in RUNS)}, none among them (the reference)")
    results = {}
    print(f"{'model':<6} {'ranks':>5} | {'compression':<26} | {'loss (last 10%)':>15} | "
          f"{'vs none':>8} | {'range':>17} | {'MB sent/step':>12}")
    with tempfile.TemporaryDirectory() as tmp:
        for ranks in (int(r) for r in args.ranks.split(",")):
            for model in args.models.split(","):
                for name, flags in [(n, f) for n, f in RUNS if n in chosen]:
                    runs = results[(model, ranks, name)] = [
                        train(ranks, model, args.steps, seed, flags,
                              Path(tmp) / f"{model}-{ranks}-{len(results)}-{seed}.json")
                        for seed in range(args.seeds)]
                    losses = [tail_loss(r) for r in runs]
                    base = [tail_loss(r) for r in results[(model, ranks, "none")]]
                    mean = sum(losses) / len(losses)
                    # paired by seed; the uncompressed row: each seed against their mean
                    gaps = [100 * (x / b - 1) for x, b in zip(losses, base)] \
                        if name != "none" else [100 * (x / mean - 1) for x in losses]
                    sent = runs[0][-1]["bytes_held_max"]["sent"] / 1e6
                    print(f"{model:<6} {ranks:>5} | {name:<26} | {mean:15.4f} | "
                          f"{sum(gaps) / len(gaps):+7.2f}% | "
                          f"{min(gaps):+7.2f}..{max(gaps):+6.2f}% | {sent:12.3f}", flush=True)
    if args.plot:
        plot(results, args.plot)
        print(f"curves: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
