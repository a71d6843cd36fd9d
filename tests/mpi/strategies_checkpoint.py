"""commlib_strategies.checkpoint under mpiexec.

    strategies_checkpoint.py [DIR]          the cases below, at this world size
    strategies_checkpoint.py save DIR ARGS  train 2 steps in layout ARGS, save in DIR/ckpt, and
                                            write the full state by other means to DIR/ref.pt
    strategies_checkpoint.py load DIR ARGS  load DIR/ckpt in layout ARGS (another world size):
                                            the full state must equal DIR/ref.pt exactly
    strategies_checkpoint.py crash DIR POINT  save step 2, then die in the save of step 3
    strategies_checkpoint.py after-crash DIR  the step-2 checkpoint is what loads

The full state (parameters, optimizer states, step) is gathered here from each layout's own
structures (ZeRO's master shards, tensor-parallel slices), independently of checkpoint.py.
"""
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

import commlib
from harness import Checker, raises
from commlib_strategies import checkpoint
from commlib_strategies.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from commlib_strategies.mappings import gather_along
from commlib_strategies.train import Trainer, parse_args

torch.set_num_threads(1)
world = commlib.init()
n, rank = world.size, world.rank
check = Checker()
# tiny, and divisible everywhere: 12 heads for tp 1-4, batch 12 for dp 1-4 (vocab 13 is padded)
MODEL = ["--layers", "1", "--d-model", "48", "--heads", "12", "--seq-len", "16", "--batch", "12"]


def make(layout: str, *extra: str) -> Trainer:
    return Trainer(parse_args(MODEL + layout.split() + list(extra)), world)


def train(trainer, start, stop) -> list:
    return [trainer.step(step)[0] for step in range(start, stop)]


def shared_dir(base: Path, name: str) -> Path:
    """A fresh directory every rank sees (made by rank 0)."""
    path = base / name
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
    world.barrier()
    return path


@torch.no_grad()
def full_state(trainer) -> dict:
    """(name, kind) -> the whole tensor; ("step", kind) -> the optimizer's step. Collective."""
    zero, opt, tp = trainer.zero, trainer.optimizer, trainer.mesh.group("tp")
    local = {}
    named = list(trainer.named_parameters())  # the reference's names (a stage: its own)
    if zero:  # each unit's flat vector, all-gathered from the master shards
        state = opt.state[zero.master]
        names = {p: name for name, p in named}
        flat_kinds = {"param": zero.master.data,
                      **{k: v for k, v in state.items() if v.dim() == 1}}
        for kind, master in flat_kinds.items():
            for u in zero.units:
                flat = torch.empty(u.padded)
                u.group.all_gather(flat, master[u.master_offset:][:u.shard_numel].clone())
                for p, view in zip(u.params, u.views(flat)):
                    local[names[p], kind] = (p, view)
        steps = [state["step"]]
    else:
        for name, p in named:
            local[name, "param"] = (p, p.detach())
            for kind, v in opt.state[p].items():
                if v.dim():
                    local[name, kind] = (p, v)
        steps = [opt.state[p]["step"] for _, p in named]
    assert len({float(s) for s in steps}) == 1, steps
    out = {("step", "step"): steps[0].clone()}
    for key, (p, t) in local.items():
        dim = getattr(p, "tp_split_dim", None)
        if dim is not None:
            t = gather_along(t.contiguous(), tp, dim).narrow(dim, 0, p.tp_full_size)
        out[key] = t.clone()
    if trainer.pipeline is not None or trainer.layout.experts:  # a stage's, a rank's experts
        for held in world.mpi.allgather(out):
            out.update(held)
    return out


def assert_same_state(got: dict, want: dict) -> None:
    assert got.keys() == want.keys(), sorted(got.keys() ^ want.keys())[:4]
    for key, w in want.items():
        g = got[key]
        assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w), \
            f"{key}: {g.dtype}{tuple(g.shape)} vs {w.dtype}{tuple(w.shape)}, " \
            f"max diff {(g.double() - w.double()).abs().max() if g.shape == w.shape else '-'}"


def resume_case(layout: str, base: Path):
    """Train 4 steps saving after 2; a fresh Trainer loads step 2 and trains steps 2 and 3:
    the same losses and final state, bit for bit."""
    def case():
        root = shared_dir(base, "resume-" + layout.replace(" ", "").replace("-", ""))
        first = make(layout)
        losses = train(first, 0, 2)
        save_checkpoint(root, 2, first)
        losses += train(first, 2, 4)
        want = full_state(first)
        second = make(layout)
        assert load_checkpoint(root, second) == 2
        resumed = train(second, 2, 4)
        assert resumed == losses[2:], (resumed, losses[2:])
        assert_same_state(full_state(second), want)
        first.mesh.free()
        second.mesh.free()
    return case


def reshard_case(saved: str, loaded: str, base: Path):
    """Save in one layout, load in another at this world size: the same state exactly, and
    training goes on (the same losses up to rounding: reductions run in another order)."""
    def case():
        root = shared_dir(base, "reshard")
        first = make(saved)
        train(first, 0, 2)
        save_checkpoint(root, 2, first)
        want, go_on = full_state(first), train(first, 2, 3)
        second = make(loaded)
        load_checkpoint(root, second)
        assert_same_state(full_state(second), want)
        got = train(second, 2, 3)
        assert abs(got[0] - go_on[0]) <= 1e-5 * abs(go_on[0]), (got, go_on)
        first.mesh.free()
        second.mesh.free()
    return case


LAYOUTS = {1: ["--zero 0", "--zero 3"],
           2: ["--zero 0", "--zero 1", "--zero 2", "--zero 3", "--tp 2", "--tp 2 --zero 2",
               "--zero 3 --bf16", "--ep 2 --experts 4 --zero 2"],
           3: ["--zero 0", "--zero 3", "--tp 3"],
           4: ["--dp 2 --tp 2 --zero 1", "--dp 2 --pp 2 --zero 2 --layers 2",
               "--pp 2 --ep 2 --experts 4 --layers 2"]}
RESHARD = {1: [("--zero 2", "--zero 0")],
           2: [("--zero 2", "--zero 3"), ("--zero 3", "--zero 0"), ("--zero 0", "--tp 2"),
               ("--tp 2", "--zero 1"), ("--ep 2 --experts 4 --zero 1", "--experts 4 --zero 2")],
           3: [("--zero 2", "--tp 3"), ("--tp 3", "--zero 1")],
           4: [("--dp 2 --tp 2 --zero 1", "--zero 3"), ("--zero 2", "--tp 4"),
               ("--dp 2 --pp 2 --zero 3 --layers 2", "--tp 2 --pp 2 --sp megatron --layers 2"),
               ("--cp 2 --tp 2 --sp ring", "--dp 2 --tp 2 --zero 2"),
               ("--pp 2 --ep 2 --experts 4 --zero 2 --layers 2",
                "--dp 2 --ep 2 --experts 4 --zero 1 --layers 2"),
               ("--pp 2 --cp 2 --sp ulysses --zero 1 --layers 2", "--zero 2 --layers 2")]}


def errors_case(base: Path):
    def case():
        root = shared_dir(base, "errors")
        trainer = make("--zero 2")
        train(trainer, 0, 1)
        save_checkpoint(root, 1, trainer)
        save_checkpoint(root, 1, trainer)  # the same step again replaces it
        listed = sorted(p.name for p in root.iterdir())
        assert listed == ["step-00000001"], listed
        world.barrier()  # every rank has looked before rank 0 changes the directory below
        raises(ValueError, "not a directory", lambda: load_checkpoint(root / "nothing", trainer))
        raises(ValueError, "no complete checkpoint", lambda: load_checkpoint(base, trainer))
        if rank == 0:  # a step directory without its manifest: a save that did not finish
            shutil.copytree(root / "step-00000001", root / "step-00000002")
            (root / "step-00000002" / "manifest.json").unlink()
        world.barrier()
        assert latest_checkpoint(root).name == "step-00000001", latest_checkpoint(root)
        raises(ValueError, "incomplete checkpoint",
               lambda: load_checkpoint(root / "step-00000002", trainer))
        other = make("--zero 2", "--d-model", "24")
        raises(ValueError, "d_model=48 (here 24)", lambda: load_checkpoint(root, other))
        other.mesh.free()
        other = make("--zero 2", "--seed", "5")
        raises(ValueError, "--seed 0 (here 5)", lambda: load_checkpoint(root, other))
        other.mesh.free()
        shard = root / "step-00000001" / f"shard-{n - 1:05d}.bin"
        world.barrier()
        if rank == 0:  # flip one byte
            data = bytearray(shard.read_bytes())
            data[len(data) // 2] ^= 1
            shard.write_bytes(bytes(data))
        world.barrier()
        raises(ValueError, f"{shard} fails its sha256 check",
               lambda: load_checkpoint(root, trainer))
        trainer.mesh.free()
    return case


# ------------------------------------------------------------------------------ crash test
CRASHES = {  # where the crashing rank dies: (rank, its n-th fsync)
    # the last rank, its shard half written (the file is truncated to half first)
    "shard": (n - 1, 1),
    # rank 0, after renaming the manifest into place but before renaming the directory
    # (its fsyncs: its shard, the directory, the manifest, the directory again, the root)
    "commit": (0, 4),
}


def crash(base: Path, point: str) -> None:
    who, nth = CRASHES[point]
    trainer = make("--zero 2")
    train(trainer, 0, 2)
    save_checkpoint(base, 2, trainer)
    train(trainer, 2, 3)
    calls = []

    def dying_fsync(fd):
        calls.append(fd)
        if rank == who and len(calls) == nth:
            if point == "shard":
                os.ftruncate(fd, os.fstat(fd).st_size // 2)
            print(f"rank {rank}: crashing during the save ({point})", flush=True)
            # nothing is left in /dev/shm: commlib.init() unlinked MPICH's node segment
            os._exit(3)
        os.fsync(fd)
    checkpoint._fsync = dying_fsync
    save_checkpoint(base, 3, trainer)
    print("NOT REACHED: the save finished", flush=True)


def after_crash(base: Path) -> None:
    def case():
        assert sorted(p.name for p in base.iterdir()) == [".tmp-step-00000003", "step-00000002"]
        assert latest_checkpoint(base).name == "step-00000002"
        trainer = make("--zero 2")
        raises(ValueError, "incomplete checkpoint",
               lambda: load_checkpoint(base / ".tmp-step-00000003", trainer))
        # the checkpoint is step 2 of a deterministic run: the same run again is the reference
        reference = make("--zero 2")
        losses = train(reference, 0, 3)
        assert load_checkpoint(base, trainer) == 2
        assert train(trainer, 2, 3) == losses[2:]
        # saving step 3 again clears the debris of the crashed save
        save_checkpoint(base, 3, trainer)
        assert sorted(p.name for p in base.iterdir()) == ["step-00000002", "step-00000003"]
        other = make("--zero 1")
        assert load_checkpoint(base, other) == 3
        assert_same_state(full_state(other), full_state(reference))
    check.check("after_crash", case)
    check.finish()


# ------------------------------------------------------------------------------ main
def main(argv) -> None:
    mode = argv[0] if argv and argv[0] in ("save", "load", "crash", "after-crash") else "cases"
    if mode == "crash":
        crash(Path(argv[1]), argv[2])
    elif mode == "after-crash":
        after_crash(Path(argv[1]))
    elif mode in ("save", "load"):
        base, layout = Path(argv[1]), " ".join(argv[2:])

        def case():
            trainer = make(layout)
            if mode == "save":
                train(trainer, 0, 2)
                save_checkpoint(base / "ckpt", 2, trainer)
                state, more = full_state(trainer), train(trainer, 2, 3)
                if rank == 0:  # the test's own reference data, read back with weights_only
                    torch.save({"state": state, "loss": more[0]}, base / "ref.pt")
            else:
                ref = torch.load(base / "ref.pt", weights_only=True)
                assert load_checkpoint(base / "ckpt", trainer) == 2
                assert_same_state(full_state(trainer), ref["state"])
                got = train(trainer, 2, 3)[0]
                assert abs(got - ref["loss"]) <= 1e-5 * ref["loss"], (got, ref["loss"])
        check.check(f"{mode} {layout}", case)
        check.finish()
    else:
        temporary = not argv
        base = Path(argv[0]) if argv else Path(world.mpi.bcast(tempfile.mkdtemp() if rank == 0
                                                                 else None))
        for layout in LAYOUTS[n]:
            check.check(f"resume {layout}", resume_case(layout, base))
        for saved, loaded in RESHARD[n]:
            check.check(f"reshard {saved} -> {loaded}", reshard_case(saved, loaded, base))
        check.check("errors", errors_case(base))
        world.barrier()
        if temporary and rank == 0:
            shutil.rmtree(base)
        check.finish()


main(sys.argv[1:])
