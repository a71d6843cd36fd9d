"""Which parallel layout a training run uses, validated before anything is built.

A layout is the mesh's sizes (dp, tp, pp, cp, ep) plus how each dimension is used: ZeRO's
stage on dp, Megatron sequence parallelism on tp (``sp="megatron"``), Ulysses or ring
attention on cp (``sp="ulysses"|"ring"``), a pipeline schedule on pp, mixture-of-experts
layers on ep. ``check`` refuses the combinations the strategies do not compose, naming the
dimension at fault and what to change; everything it accepts trains like the single-process
reference. The ones that compose:

    dp x tp             with ZeRO 0-3 on dp, and Megatron SP on tp
    dp x tp x cp x pp   Ulysses or ring attention on cp (under tp: of each tp rank's heads),
                        ZeRO 0-3 on dp; pipeline stages (any schedule) of the
                        context-parallel model pass each cp rank's sequence shard
    dp x tp x pp        any schedule, ZeRO 0-3 on each stage's dp group (0: the pipeline
                        averages the gradients; 1: ZeRO reduce-scatters them in its step;
                        2, 3: as each chunk's are final, during the schedule); Megatron SP
                        on tp with every schedule
    dp x ep x pp        mixture of experts (E+D); ZeRO 0-3 (dense parameters sharded over
                        dp x ep, each expert over its replicas, the dp ranks); pipeline
                        stages (any schedule) whose blocks hold the expert-parallel layers,
                        the ep group within a stage, each stage adding its layers' aux
                        losses to the loss
    dp x ep x tp        experts split over tp like the dense MLP (expert tensor
                        parallelism: the ep all-to-all among the ranks of one tp index,
                        the layer's output summed over tp once), Megatron SP on tp, ZeRO 0-3
    dp x ep x cp        Ulysses or ring attention on cp; a routing group spans the cp ranks,
                        which all route it whole (the probabilities gathered over cp) and
                        dispatch their own tokens; ZeRO 0-3
    dp x ep x tp x cp   both: experts split over tp take cp's sequence shards; ZeRO 0-3
    ... x pp            each of the expert layouts above cut into pipeline stages, the ep,
                        tp and cp groups within a stage; any schedule, but experts split
                        over tp apply their weights inside one function, so not zb-h1,
                        whose split backward needs modules' outputs
"""
from __future__ import annotations

from dataclasses import dataclass

from commlib_strategies.mesh import check_sizes
from commlib_strategies.pipeline_schedules import SCHEDULES

SEQUENCE_KINDS = ("megatron", "ulysses", "ring")


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    sp: str | None = None
    schedule: str = "1f1b"
    microbatches: int = 1
    virtual: int = 1
    experts: int = 0  # 0: dense MLPs
    topk: int = 2

    @property
    def sizes(self) -> dict:
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp, "cp": self.cp, "ep": self.ep}

    def describe(self) -> str:
        used = [f"{d}={s}" for d, s in self.sizes.items() if s > 1 or d == "dp"]
        if self.zero:
            used.append(f"zero={self.zero}")
        if self.sp:
            used.append(f"sp={self.sp}")
        if self.pp > 1:
            used.append(f"{self.schedule} x{self.microbatches} microbatches"
                        + (f", {self.virtual} chunks per stage" if self.virtual > 1 else ""))
        if self.experts:
            used.append(f"{self.experts} experts, top-{self.topk}")
        return " ".join(used)


def check(layout: Layout, world_size: int, batch: int, seq_len: int, heads: int,
          layers: int, experts_split_over_tp: bool = True) -> Layout:
    """``layout`` if it composes and fits the world and the model; else ValueError.
    ``experts_split_over_tp``: the model's experts are split over tp (the project's MoE
    layers; transformers' Mixtral keeps them whole)."""
    check_sizes(layout.sizes, world_size)
    tp, pp, cp, ep, sp = layout.tp, layout.pp, layout.cp, layout.ep, layout.sp
    if sp is not None and sp not in SEQUENCE_KINDS:
        raise ValueError(f"--sp {sp!r}: choose one of {', '.join(SEQUENCE_KINDS)}")
    if sp == "megatron" and tp == 1:
        raise ValueError("--sp megatron shards tensor parallelism's activations along the "
                         "sequence: add --tp 2 or more")
    if sp in ("ulysses", "ring") and cp == 1:
        raise ValueError(f"--sp {sp} splits each sequence over the cp ranks: add --cp 2 or more")
    if cp > 1:
        if sp not in ("ulysses", "ring"):
            raise ValueError(f"--cp {cp} needs the attention that works on sequence shards: "
                             "add --sp ulysses or --sp ring")
        if sp == "ulysses" and heads % tp == 0 and (heads // tp) % cp:
            raise ValueError(f"--sp ulysses: each of the --cp {cp} ranks attends whole heads of "
                             f"the {heads // tp} that --heads {heads} over --tp {tp} leaves a "
                             f"rank; choose --cp dividing {heads // tp}, or --sp ring")
        if seq_len % cp:
            raise ValueError(f"--seq-len {seq_len} does not divide into --cp {cp} shards; "
                             f"use a multiple of {cp}")
    if sp == "megatron" and seq_len % tp:
        raise ValueError(f"--sp megatron: --seq-len {seq_len} does not divide into --tp {tp} "
                         f"shards; use a multiple of {tp}")
    if layout.experts or ep > 1:
        if layout.experts < 1:
            raise ValueError(f"--ep {ep} splits the experts of mixture-of-experts layers: add "
                             "--experts N (a multiple of --ep)")
        if layout.experts % ep:
            raise ValueError(f"--experts {layout.experts} does not divide over --ep {ep}; use "
                             f"a multiple of {ep}")
        if not 1 <= layout.topk <= layout.experts:
            raise ValueError(f"--topk {layout.topk}: choose 1 to --experts ({layout.experts})")
        if tp > 1 and pp > 1 and layout.schedule == "zb-h1" and experts_split_over_tp:
            raise ValueError(f"--schedule zb-h1 splits backward at modules' outputs, which "
                             f"experts split over --tp {tp} do not have (each applies its "
                             f"weights itself); choose gpipe, 1f1b or interleaved-1f1b")
    if pp > 1:
        if layout.schedule not in SCHEDULES:
            raise ValueError(f"--schedule {layout.schedule!r}: choose one of "
                             f"{', '.join(SCHEDULES)}")
        if layers < pp * layout.virtual:
            raise ValueError(f"--pp {pp} x {layout.virtual} chunks per stage needs at least "
                             f"{pp * layout.virtual} layers, the model has --layers {layers}")
        per_replica = batch // (layout.dp * ep)
        if per_replica % layout.microbatches:
            raise ValueError(f"--micro-batches {layout.microbatches} does not divide the "
                             f"{per_replica} sequences each pipeline gets; choose a divisor")
    shards = layout.dp * ep
    if batch % shards:
        raise ValueError(f"--batch {batch} does not divide over the {shards} data-parallel "
                         f"ranks (dp{' x ep' if ep > 1 else ''}); use a multiple of {shards}")
    if tp > 1 and heads % tp:
        raise ValueError(f"--tp {tp} splits the attention heads: --heads {heads} must be a "
                         f"multiple of {tp}")
    return layout
