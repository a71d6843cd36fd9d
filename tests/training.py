"""The training CLI (commlib_strategies.train) from the tests: several runs in one launch
(tests/mpi/train_many.py: a launch costs seconds of start-up on 2 cores, more than a run),
and the one-process losses the layouts are compared with, all in one launch a session."""
import importlib.util
import itertools
import json
import shlex
from pathlib import Path

from mpirun import run_shared

RUN = ("--steps", "4", "--quiet")
SMALL = (*RUN, "--layers", "2", "--d-model", "32", "--seq-len", "16")  # test_checkpoint's
_launches = itertools.count()


def train_many(n: int, tmp_path, *runs, timeout: float = 300) -> tuple[list, str]:
    """Each of ``runs`` (the CLI's arguments) on ``n`` ranks, one after another in one
    launch; returns their logs (a record per step) and the launch's output."""
    where = tmp_path / f"runs-{next(_launches)}"
    where.mkdir(parents=True)
    code, out = run_shared(n, "tests/mpi/train_many.py", str(where), *map(shlex.join, runs),
                           timeout=timeout)
    assert code == 0, out[-4000:]
    return [json.loads((where / f"{i}.json").read_text()) for i in range(len(runs))], out


def losses(log: list) -> list:
    return [record["loss"] for record in log]


# a user's config.json of a model the project names nowhere else
USERS_CONFIG = str(Path(__file__).with_name("data") / "mistral_config.json")
# Granite's multipliers as its real configs set them (transformers' defaults are 1.0), its
# LM head tied to its embedding, a padding token in the vocabulary
GRANITE_CONFIG = str(Path(__file__).with_name("data") / "granite_config.json")
# transformers' models by a model_type the project names nowhere else, and by that config
ANY_MODEL = [(*SMALL, "--model", "qwen2"), (*SMALL, "--model", "qwen3_moe"),
             (*RUN, "--seq-len", "16", "--config", USERS_CONFIG), (*SMALL, "--model", "cohere"),
             (*SMALL, "--model", "lara_mini"), (*SMALL, "--model", "minicpm3"),
             (*RUN, "--seq-len", "16", "--config", GRANITE_CONFIG),
             (*SMALL, "--model", "granite_swa"), (*SMALL, "--model", "inkling_text"),
             (*SMALL, "--model", "glm_moe_dsa"), (*SMALL, "--model", "gemma2"),
             (*SMALL, "--model", "gpt_oss"), (*SMALL, "--model", "jamba")]

# the one-process runs the tests compare layouts with (transformers' models where it is in)
ONE_PROCESS = [RUN, (*RUN, "--experts", "4")]
if importlib.util.find_spec("transformers"):
    ONE_PROCESS += [(*RUN, "--model", "gpt2", "--layers", "4"), (*RUN, "--model", "mixtral"),
                    (*SMALL, "--model", "gpt2"), (*SMALL, "--model", "llama"),
                    (*SMALL, "--model", "mixtral"), *ANY_MODEL]


def one_process_losses(tmp_path) -> dict:
    """{the arguments of each ONE_PROCESS run: its losses}, from one launch of one rank."""
    logs, _ = train_many(1, tmp_path, *ONE_PROCESS)
    return {tuple(args): losses(log) for args, log in zip(ONE_PROCESS, logs)}
