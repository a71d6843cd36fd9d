"""commlib_strategies/checkpoint.py under mpiexec: resume bit-identical in every layout, resharding
to other layouts and world sizes, checksums and errors, a crash in the middle of a save,
and the training CLI's --save-dir / --resume across two launches."""
import json
from pathlib import Path

import pytest

from mpirun import checkout_env, mpirun, run_checked, sizes
from training import SMALL, losses, train_many

pytest.importorskip("torch")

ENV = checkout_env()
SCRIPT = "tests/mpi/strategies_checkpoint.py"


@pytest.mark.parametrize("n", sizes(1, 2, 3, 4, long=(2, 4)))
def test_resume_reshard_and_errors(n, tmp_path):
    run_checked(n, SCRIPT, str(tmp_path))


def test_reshard_to_other_world_sizes(tmp_path):
    run_checked(2, SCRIPT, "save", str(tmp_path), "--zero", "2")
    run_checked(1, SCRIPT, "load", str(tmp_path), "--zero", "3")
    run_checked(3, SCRIPT, "load", str(tmp_path), "--tp", "3")


def _leaked_segments(before: set) -> list:
    """MPICH segments created since ``before`` that no live process maps any more (those of
    jobs still running on this machine are theirs, not leaks)."""
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            mapped |= {line.rsplit("/", 1)[-1].strip() for line in maps.read_text().splitlines()
                       if "/dev/shm/mpich_shm_" in line}
        except OSError:
            continue
    return [p.name for p in set(Path("/dev/shm").glob("mpich_shm_*")) - before
            if p.name not in mapped]


@pytest.mark.parametrize("point", ["shard", "commit"])
def test_crash_during_save_leaves_the_previous_checkpoint(tmp_path, point):
    """A rank dies in the save of step 3 (the last rank with its shard half written, or rank
    0 after renaming the manifest, before renaming the directory): the job fails; the next
    job finds step 2, ignores the debris, and saves step 3 over it."""
    before = set(Path("/dev/shm").glob("mpich_shm_*"))
    code, out = mpirun(2, SCRIPT, "crash", str(tmp_path), point, timeout=120, env=ENV)
    assert code not in (None, 0) and "crashing during the save" in out, out[-3000:]
    assert "NOT REACHED" not in out, out[-3000:]
    assert not _leaked_segments(before), _leaked_segments(before)
    run_checked(2, SCRIPT, "after-crash", str(tmp_path))


def _train(tmp_path, n, name, *args):
    """The training CLI in a launch of its own."""
    log = tmp_path / f"{name}.json"
    code, out = mpirun(n, "-m", "commlib_strategies.train", "--zero", "3", *SMALL, "--log",
                       str(log), *args, timeout=120, env=ENV)
    assert code == 0, out[-4000:]
    return _steps(json.loads(log.read_text())), out


@pytest.mark.long
def test_training_cli_resumes_bit_identical_in_a_new_launch(tmp_path):
    root = tmp_path / "ckpt"
    full, _ = _train(tmp_path, 2, "full", "--save-dir", str(root), "--save-every", "2")
    assert sorted(p.name for p in root.iterdir()) == ["step-00000002", "step-00000004"]
    resumed, out = _train(tmp_path, 2, "resumed", "--resume", str(root / "step-00000002"))
    assert "# resumed at step 2" in out
    assert resumed == full[2:]  # exactly: floats compared with ==
    # --resume without PATH: the newest in --save-dir (here step 4 of 4), in any layout
    done, out = _train(tmp_path, 1, "done", "--save-dir", str(root), "--resume")
    assert done == [] and "nothing to do: the run is at step 4 of 4" in out, out[-2000:]
    code, out = mpirun(1, "-m", "commlib_strategies.train", "--steps", "1", "--resume",
                       str(tmp_path / "missing"), env=ENV)
    assert code != 0 and "no checkpoint at" in out, out[-2000:]


def _steps(log: list) -> list:
    return [(r["step"], r["loss"]) for r in log]


@pytest.mark.parametrize("saved,resharded", [
    (["--pp", "2", "--schedule", "zb-h1"], ["--tp", "2"]),
    (["--ep", "2", "--experts", "4"], ["--dp", "2", "--experts", "4"]),
])
def test_pipeline_and_expert_checkpoints(tmp_path, saved, resharded):
    """A stage, or an expert-parallel rank, saves and loads the parameters it holds: resumed
    in the same layout the losses are bit-identical, in another one equal to fp32 rounding.
    (One launch: each run builds its trainer from the files alone.)"""
    root = tmp_path / "ckpt"
    step2 = str(root / "step-00000002")
    logs, _ = train_many(2, tmp_path,
                         (*saved, *SMALL, "--save-dir", str(root), "--save-every", "2"),
                         (*saved, *SMALL, "--resume", step2),
                         (*resharded, *SMALL, "--resume", step2))
    full, same, other = map(_steps, logs)
    assert same == full[2:]
    assert [s for s, _ in other] == [2, 3]
    assert [loss for _, loss in other] == pytest.approx([loss for _, loss in full[2:]], rel=1e-5)


@pytest.mark.parametrize("compress", [["--compress", "int8"], ["--compress", "powersgd"],
                                      ["--compress", "fp8_e4m3", "--zero", "2"]], ids=str)
def test_compressed_runs_resume_with_their_residuals(tmp_path, compress):
    """The compressed calls' residuals (and PowerSGD's queries) are saved per rank: resumed
    in the same layout the losses are bit-identical (afresh they are not); in another
    layout they start afresh."""
    root = tmp_path / "ckpt"
    step2 = str(root / "step-00000002")
    run = (*compress, *SMALL, "--steps", "5")
    logs, _ = train_many(2, tmp_path, (*run, "--save-dir", str(root), "--save-every", "2"),
                         (*run, "--resume", step2),
                         (*run, "--bucket-mb", "0.01", "--resume", step2))  # other buckets
    full, same, other = map(_steps, logs)
    assert same == full[2:]
    assert [s for s, _ in other] == [2, 3, 4]
    files = sorted(p.name for p in Path(step2).iterdir())
    assert files == ["compression-00000.bin", "compression-00001.bin", "manifest.json",
                     "shard-00000.bin", "shard-00001.bin"], files


@pytest.mark.long
def test_a_model_nobody_here_wrote_trains_saves_and_resumes(tmp_path, one_process):
    """transformers' GPT-2 (tied lm_head) through the CLI: ZeRO-3 on 2 ranks gives the
    losses of one process; a checkpoint resumes, to fp32 rounding, in another layout
    (ZeRO-3 to pp x tp, and back)."""
    pytest.importorskip("transformers")
    model = (*SMALL, "--model", "gpt2")
    one = one_process[model]
    root = tmp_path / "ckpt"
    (full,), _ = train_many(2, tmp_path, ("--zero", "3", *model, "--save-dir", str(root),
                                          "--save-every", "2"))
    assert losses(full) == pytest.approx(one, rel=1e-5)
    # pipeline x tensor parallel: the first and last stages each hold a copy of the LM head
    # tied to the embedding (their gradients summed), GPT-2's fused q|k|v split part by
    # part; the checkpoint holds the tied weight once, half from each stage; both ways
    staged, pp_root = ("--pp", "2", "--tp", "2"), tmp_path / "pp"
    (pp, _), _ = train_many(4, tmp_path, (*staged, *model, "--resume", str(root / "step-00000002")),
                            (*staged, *model, "--save-dir", str(pp_root), "--save-every", "2"))
    assert losses(pp) == pytest.approx(one[2:], rel=1e-5)
    (back,), _ = train_many(2, tmp_path, ("--zero", "3", *model, "--resume",
                                          str(pp_root / "step-00000002")))
    assert losses(back) == pytest.approx(one[2:], rel=1e-5)


def test_llama_checkpoints_reshard_across_world_sizes(tmp_path, one_process):
    """Llama saved under pp x tp (Megatron SP) on 4 ranks resumes, to fp32 rounding, under
    cp (Ulysses) on 2 ranks."""
    pytest.importorskip("transformers")
    model = (*SMALL, "--model", "llama")
    one = one_process[model]
    root = tmp_path / "ckpt"
    saved = ("--pp", "2", "--tp", "2", "--sp", "megatron", "--zero", "1")
    (full,), _ = train_many(4, tmp_path, (*saved, *model, "--save-dir", str(root),
                                          "--save-every", "2"))
    assert losses(full) == pytest.approx(one, rel=1e-5)
    (got,), _ = train_many(2, tmp_path, ("--cp", "2", "--sp", "ulysses", *model, "--resume",
                                         str(root / "step-00000002")))
    assert losses(got) == pytest.approx(one[2:], rel=1e-5)


def test_expert_parallel_mixtral_checkpoints_reshard(tmp_path, one_process):
    """Mixtral split over ep (each rank holds its experts' slice of the stacked weights)
    saves a checkpoint that resumes, to fp32 rounding, under ZeRO-3 without ep."""
    pytest.importorskip("transformers")
    model = (*SMALL, "--model", "mixtral")
    one = one_process[model]
    root = tmp_path / "ckpt"
    (ep, other), _ = train_many(2, tmp_path, ("--ep", "2", *model, "--save-dir", str(root),
                                              "--save-every", "2"),
                                ("--zero", "3", *model, "--resume", str(root / "step-00000002")))
    assert losses(ep) == pytest.approx(one, rel=1e-5)
    assert losses(other) == pytest.approx(one[2:], rel=1e-5)
