"""Every causal-LM family of the installed transformers whose config carries a tensor
parallel plan, trained by commlib_strategies in each layout against one process.

    mpiexec -n 2 python -m commlib_bench.families [--only qwen2 mistral] [--layouts tp=2]
                                                  [--json out.json]

Each family is transformers' own default config shrunk to the CLI's small sizes
(families.build: 2 layers, width 32, 4 heads, 16 tokens), planned by its config
(config_plans.from_config). Layouts: tp=2, cp=2 (ring attention), ep=2 where it has
experts, pp=2 (1F1B; and zero-bubble ZB-H1, its backward split into the inputs' and the
weights' parts, on 4 micro-batches), ZeRO-3 over dp=2; each runs 3 optimizer steps of
commlib-train's trainer on the same global batches as one process, and reports the
largest relative difference of its losses from the one process's, or what refused it
(the error's words). A family that one process cannot build or train says so once.
"""
import argparse
import json
import os
import signal
import sys
import traceback

import numpy as np

import commlib

LAYOUTS = {"tp=2": ["--tp", "2"], "cp=2 ring": ["--cp", "2", "--sp", "ring"],
           "ep=2": ["--ep", "2"], "pp=2": ["--pp", "2"],
           "pp=2 zb-h1": ["--pp", "2", "--schedule", "zb-h1", "--micro-batches", "4"],
           "ZeRO-3": ["--zero", "3"]}
SMALL = ["--steps", "3", "--layers", "2", "--d-model", "32", "--heads", "4", "--seq-len", "16",
         "--batch", "8", "--quiet"]
AGREE = 1e-4  # relative loss difference counted as the same training
REFERENCE_SECONDS = 90  # for one process's 3 steps: beyond, the family is too slow to run
                        # here at the sizes the CLI sets (sizes of its own it keeps large)


def _too_slow(signum, frame):
    raise TimeoutError(f"one process's {SMALL[1]} steps took over {REFERENCE_SECONDS} s at "
                       "the CLI's sizes (sizes of its own stay large)")


def planned_families() -> list[str]:
    """The causal-LM model_types whose default config carries base_model_tp_plan."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    found = []
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            config = CONFIG_MAPPING[model_type]()
        except Exception:  # noqa: BLE001 - a config that cannot be built has no plan to try
            continue
        if getattr(config, "base_model_tp_plan", None):
            found.append(model_type)
    return found


def losses(world, model_type: str, layout: list[str]) -> list[float]:
    """commlib-train's losses for ``model_type`` in ``layout`` on ``world``."""
    from commlib_strategies.train import Trainer, parse_args
    args = parse_args(["--model", model_type, *SMALL, *layout])
    trainer = Trainer(args, world)
    try:
        return [trainer.step(step)[0] for step in range(args.steps)]
    finally:
        trainer.mesh.free()


def reason(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:300]}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="*", help="these model_types only")
    p.add_argument("--layouts", nargs="*", choices=list(LAYOUTS), default=list(LAYOUTS),
                   help="these layouts only")
    p.add_argument("--json", help="write the results here (rank 0)")
    args = p.parse_args(argv)
    os.environ.setdefault("COMMLIB_TIMEOUT", "60")
    import torch
    from transformers.utils import logging
    logging.set_verbosity_error()
    from commlib_strategies.families import has_experts
    torch.set_num_threads(1)
    world = commlib.init()
    if world.size != 2:
        raise SystemExit("run on 2 ranks: mpiexec -n 2 python -m commlib_bench.families")
    alone = world.split(world.rank)  # one process's reference, on each rank
    signal.signal(signal.SIGALRM, _too_slow)
    results = []
    for model_type in args.only or planned_families():
        row = {"model_type": model_type}
        signal.alarm(REFERENCE_SECONDS)
        try:
            want = losses(alone, model_type, [])
        except Exception as e:  # noqa: BLE001 - the table says what one process cannot do
            row["one process"] = reason(e)
            want = None
        finally:
            signal.alarm(0)
        agreed = np.array([want is not None], np.int32)  # (both ranks go on, or neither)
        world.all_reduce(agreed, op="min")
        if want is not None and not agreed[0]:
            row["one process"] = "TimeoutError: the other rank's one process took too long"
            want = None
        for name in args.layouts if want is not None else ():
            layout = LAYOUTS[name]
            if name == "ep=2" and not has_experts(model_type):
                continue
            try:
                got = losses(world, model_type, layout)
                row[name] = max(abs(g - w) / abs(w) for g, w in zip(got, want))
            except Exception as e:  # noqa: BLE001 - refused or failed: the table says which
                row[name] = reason(e)
                if not isinstance(e, (ValueError, TypeError, NotImplementedError)):
                    traceback.print_exc()
            # in step before the next layout; a rank whose peer failed alone waits in a
            # receive until its timeout (60 s), so this waits longer
            world.barrier(timeout=180)
        results.append(row)
        if world.rank == 0:
            print(json.dumps(row), flush=True)
    if world.rank == 0:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
        print(table(results))
    return 0


def table(results: list[dict]) -> str:
    """Markdown: a row per family, a cell per layout (the difference, or "refused")."""
    lines = ["| family | " + " | ".join(LAYOUTS) + " |", "|---" * (len(LAYOUTS) + 1) + "|"]
    for row in results:
        if "one process" in row:
            cells = ["one process: " + row["one process"][:80]] + [""] * (len(LAYOUTS) - 1)
        else:
            cells = [_cell(row.get(name)) for name in LAYOUTS]
        lines.append(f"| {row['model_type']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.1e}" if value <= AGREE else f"**{value:.1e}**"
    return "refused: " + value[:60]


if __name__ == "__main__":
    sys.exit(main())
