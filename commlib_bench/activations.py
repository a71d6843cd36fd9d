"""Activation memory per transformer layer: the bytes a layer saves for backward, measured,
next to the seed's formulas (Korthikanti et al., 16-bit activations, 1-byte dropout masks):

    no parallelism           sbh(34 + 5as/h)
    tensor parallel          sbh(10 + 24/t + 5as/(ht))
    tensor + sequence par.   sbh(34/t + 5as/(ht))

    mpiexec -n 2 python -m commlib_bench.activations [--batch 4] [--seq-len 64] [--d-model 64]
        [--heads 4]

s: sequence length, b: batch, h: width, a: heads, t: ranks (the world's size). Measured: the
first block's forward on its input under torch.autograd.graph.saved_tensors_hooks, each
distinct storage counted once (a view keeps its whole storage alive), parameters excluded;
attention runs on PyTorch's math kernel, which keeps the s x s softmax as the formula does
(the flash kernel would keep the output and a log-sum-exp instead).

Our model has no dropout, so it saves neither the masks (sbh: one after attention, one after
the MLP; as²b after the softmax) nor the softmax's dropped-out copy (2as²b): the comparable
formula is 34 -> 32 and 5as/h -> 2as/h (and 10 -> 8 under tp). It does save what the formula
neglects: each LayerNorm's mean and 1/std (2 floats per token, 8/h in the units above). So,
per layer, in elements (w bytes each), where 16sbh is: the two LayerNorms' inputs (2), their
outputs as the inputs of q/k/v and fc1 (2), the scaled q and k (2), v (1), proj's input (1),
GELU's input (4) and fc2's (4); under tp the first four stay whole, under tp + sp they are
shards (the gathered LayerNorm outputs are gathered again in backward, not kept):

    none        16sbh + as²b + 4sb
    tp          4sbh + 4sb + (12sbh + as²b)/t
    tp + sp     (16sbh + as²b + 4sb)/t
    ulysses     as tp + sp, with t = cp
    ring        (16sbh + asb + 4sb)/cp: the ring keeps q, k, v, its output (which is also
                proj's input) and a log-sum-exp per query; no s x s scores

The table gives each as c in "c·sbh bytes at 16 bits" (measured bytes / (sbh·w/2)).
"""
from __future__ import annotations

import argparse

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import commlib
from commlib_strategies.mesh import Mesh
from commlib_strategies.model import GPT, GPTConfig
from commlib_strategies.parallelize import parallelize
from commlib_strategies.plans import PLANS

LAYOUTS = ("none", "tp", "tp+sp", "ulysses", "ring")


def saved_bytes(fn, *args, exclude=()) -> int:
    """Bytes of the distinct storages that ``fn(*args)`` saves for backward, leaving out
    the storages of the tensors in ``exclude`` (the parameters)."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with sdpa_kernel([SDPBackend.MATH]), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(saved.values())


def layer_bytes(config: GPTConfig, batch: int, layout: str, group: commlib.Communicator) -> int:
    """Measured bytes one block saves in ``layout`` over ``group`` (t = its size), fp32."""
    dim, sp = {"none": ("tp", None), "tp": ("tp", None), "tp+sp": ("tp", "megatron"),
               "ulysses": ("cp", "ulysses"), "ring": ("cp", "ring")}[layout]
    mesh = Mesh(group, **({"dp": group.size} if layout == "none" else {dim: group.size}))
    model = parallelize(GPT(config, seed=0), mesh, PLANS["gpt"], sp)
    # the first block takes whole sequences (under Megatron SP it shards them itself), or
    # under context parallelism this rank's shard
    time = config.seq_len // group.size if dim == "cp" else config.seq_len
    x = torch.randn(batch, time, config.d_model, generator=torch.Generator().manual_seed(0))
    saved = saved_bytes(model.blocks[0], x.requires_grad_(), exclude=list(model.parameters()))
    mesh.free()
    return saved


def accounted_bytes(layout: str, s: int, b: int, h: int, a: int, t: int, width: int = 4) -> float:
    """What the module docstring's accounting predicts (the seed's formula without dropout,
    plus the LayerNorm statistics), in bytes at ``width`` bytes per element."""
    sbh, sb = s * b * h, s * b
    elements = {"none": 16 * sbh + a * s * s * b + 4 * sb,
                "tp": 4 * sbh + 4 * sb + (12 * sbh + a * s * s * b) / t,
                "tp+sp": (16 * sbh + a * s * s * b + 4 * sb) / t,
                "ulysses": (16 * sbh + a * s * s * b + 4 * sb) / t,
                "ring": (16 * sbh + a * s * b + 4 * sb) / t}[layout]
    return elements * width


def seed_coefficient(layout: str, s: int, h: int, a: int, t: int, dropout: bool = True):
    """c in the seed's sbh·c bytes (16-bit); without ``dropout``: its terms removed.
    None where the seed gives no formula (ring)."""
    linear, quadratic, replicated = (34, 5, 10) if dropout else (32, 2, 8)
    attention = quadratic * a * s / h
    return {"none": linear + attention,
            "tp": replicated + (linear - replicated) / t + attention / t,
            "tp+sp": (linear + attention) / t,
            "ulysses": (linear + attention) / t,
            "ring": None}[layout]


def table(config: GPTConfig, batch: int, group: commlib.Communicator) -> list[dict]:
    """One row per layout, measured at t = the group's size (collective)."""
    s, b, h, a, t = config.seq_len, batch, config.d_model, config.n_heads, group.size
    unit = s * b * h * 4 / 2  # sbh bytes at 16 bits, in fp32 bytes
    rows = []
    for layout in LAYOUTS:
        measured = layer_bytes(config, batch, layout, group)
        rows.append({"layout": layout, "measured": measured,
                     "accounted": accounted_bytes(layout, s, b, h, a, t),
                     "c_measured": measured / unit,
                     "c_seed": seed_coefficient(layout, s, h, a, t),
                     "c_seed_no_dropout": seed_coefficient(layout, s, h, a, t, dropout=False)})
    return rows


def format_table(rows: list[dict], config: GPTConfig, batch: int, t: int) -> str:
    def c(x):
        return "-" if x is None else f"{x:.2f}"
    lines = [f"# activation bytes saved per layer, fp32: s={config.seq_len} b={batch} "
             f"h={config.d_model} a={config.n_heads} t={t} (cp = t for ulysses and ring)",
             f"# {'layout':<8} {'measured':>10} {'accounted':>10} {'c measured':>11} "
             f"{'c seed':>8} {'c seed, no dropout':>19}"]
    for r in rows:
        lines.append(f"  {r['layout']:<8} {r['measured']:>10} {r['accounted']:>10.0f} "
                     f"{c(r['c_measured']):>11} {c(r['c_seed']):>8} "
                     f"{c(r['c_seed_no_dropout']):>19}")
    lines.append("# c: bytes / (sbh bytes at 16 bits). c measured - c seed, no dropout = 8/h "
                 "(LayerNorm statistics), /t where sharded; ring: no s x s term")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m commlib_bench.activations", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    world = commlib.init()
    config = GPTConfig(vocab_size=13, seq_len=args.seq_len, d_model=args.d_model,
                       n_heads=args.heads, n_layers=1)
    rows = table(config, args.batch, world)
    if world.rank == 0:
        print(format_table(rows, config, args.batch, world.size), flush=True)


if __name__ == "__main__":
    main()
