"""Pipeline parallelism: a model cut into pieces over the stages of a pipeline group (the
mesh's "pp" group), and a runtime that executes a schedule on them.

Vocabulary and schedules as in ``commlib_strategies.pipeline_schedules``: p stages, v chunks per
stage, p * v *pieces* (chunk c of stage s is piece c * p + s), m microbatches, and the
actions F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B.

    PipelineStage(model, plan, group, virtual=1)
        this stage's pieces of a model.LanguageModel (parallelized or not: parallelize.py),
        cut where its plan says (``plan.pipeline``: the embeddings, the blocks' list, the
        final modules). Each piece is a copy of the model that keeps only its run of blocks
        (in their places, the others passing their input on, so parameter names and a
        block's index stay the model's), the embeddings on
        the first piece, the final norm and LM head on the last. The model's own ``run``
        goes on every piece: the first takes token ids, the others the hidden states before
        them, which replace what reaches their first block (they run the model on
        placeholder ids; the embeddings they lack give zeros: whatever a model does
        between its embeddings and its blocks, Granite's embedding_multiplier, is done
        once, on the first piece), and every piece but
        the last returns hidden states (its final modules are identities, and what passed
        through them is the piece's output: what a model does to its logits after its LM
        head, a scale or a soft cap, is not done to hidden states), so masks and
        positions are the model's own on every stage; the last gives the loss.
    Pipeline(stage, schedule, microbatches, dp_group=None, gradients=None)
        ``step(inputs, targets)`` runs one forward and backward of the batch through the
        schedule and leaves the batch's gradients in the stage's parameters, as
        ``model.loss(inputs, targets).backward()`` would: every microbatch's loss is scaled
        by 1/m, so the accumulated gradients are the whole batch's mean. It returns the
        batch's loss on every stage.

Under Megatron sequence parallelism the stages pass each other sequence shards; under
context parallelism each cp rank's pipeline is given its shards already.

Mixture of experts: a piece whose blocks hold MoE layers adds their weighted aux losses
(model.LanguageModel's ``aux_loss``) to the loss: each microbatch's, scaled by 1/m, is a
second root of the piece's backward, and the batch's loss sums every stage's part. That is
the reference's loss when each microbatch is whole routing groups (the layers'
``group_rows`` divides the microbatch; with ``group_rows`` None a microbatch is one group,
unlike the reference's batch).

Communication is asynchronous: sends are isends, the receives a compute action needs are
posted (irecv) before the compute action ahead of it starts, and a stage waits only where its
schedule receives, so it computes while its neighbours' tensors are in flight, and holds
receive buffers for about one action ahead. Each message is tagged with its direction,
piece and microbatch. A piece's gradients are final as soon as its last backward action has
run; then they are reduced over the data-parallel ranks (async, overlapping the rest of the
schedule): averaged over ``dp_group``, or reduce-scattered to their owners by ``gradients``,
a ``ZeRO`` of the stage built with ``reduce_in_backward=False`` (stages 2 and 3).

The split backward (zero-bubble's I and W): I asks autograd for the gradients of the piece's
input and of the output of every module that holds parameters (keeping the graph); W then
runs, for each such module, backward from its output's gradient to its own parameters only,
which touches just that module's operations. Neither recomputes what the other did. The
parameters of a module that did not run, whose parent applies them itself (Jamba's mixers
multiply by their dt_proj's weight), get their gradients in I. (A module that applies its
children's weights itself, not as their outputs, in a way W cannot follow says so with an
``unsplittable`` attribute, an expert split over tp: its stages take the schedules without
W.)
"""
from __future__ import annotations

import copy
import functools
import time
from dataclasses import dataclass

import torch
from torch import nn

import commlib
from commlib_strategies.megatron_sp import split_before
from commlib_strategies.piece_parts import Final, NoEmbedding, Skipped
from commlib_strategies.plans import Plan, matches, matching
from commlib_strategies.pipeline_schedules import (COMPUTE, Action, schedule as build_schedule,
                                                   simulate)
from commlib_strategies.sequence_parallel import rehook_gradient_sums

_TAG_LIMIT = 32767  # commlib's largest tag


# ------------------------------------------------------------------------------ the model

def partition(n_layers: int, pieces: int) -> list[range]:
    """The blocks of each piece: contiguous, in order, as even as possible."""
    if n_layers < pieces:
        raise ValueError(f"pipeline: {pieces} pieces need at least {pieces} blocks, the model "
                         f"has {n_layers}; use fewer stages or virtual chunks, or more layers")
    return [range(i * n_layers // pieces, (i + 1) * n_layers // pieces) for i in range(pieces)]


def copy_module(module: nn.Module, memo: dict | None = None) -> nn.Module:
    """A deep copy that shares the communicators the modules hold (tensor-parallel layers'
    groups) and keeps the attributes parameters carry (``tp_split_dim``), which copying a
    Parameter drops. ``memo``: id of an object -> what the copy holds in its place (it
    gains id of each object copied -> its copy)."""
    memo = {} if memo is None else memo
    memo.update({id(c): c for m in module.modules() for value in vars(m).values()
                 for c in _communicators(value)})
    new = copy.deepcopy(module, memo)
    for p in module.parameters():
        q = memo.get(id(p))
        if isinstance(q, nn.Parameter) and q is not p:
            q.__dict__.update(p.__dict__)
    return new


def _communicators(value):
    """The communicators ``value`` is or holds as a partial's argument (an attention core's
    group)."""
    if isinstance(value, commlib.Communicator):
        yield value
    elif isinstance(value, functools.partial):
        yield from (v for v in value.keywords.values() if isinstance(v, commlib.Communicator))


class Piece(nn.Module):
    """Piece ``index`` of ``count``: a copy of ``model`` holding its ``blocks`` of the
    plan's blocks' list (and the embeddings, or the final modules, if first or last);
    ``forward`` takes token ids (first piece) or hidden states, and gives hidden states, or
    (last piece, with targets) the mean loss."""

    def __init__(self, model: nn.Module, plan: Plan, index: int, count: int, blocks: range):
        super().__init__()
        self.index, self.first, self.last = index, index == 0, index == count - 1
        embeddings, block_list, finals = plan.pipeline
        (layers,) = matching(model, block_list)
        # what the copy leaves out, never copied: other pieces' blocks (each a stand-in
        # that passes its input on, so that the blocks kept keep their places: a model
        # may look up what block i is, its layer type, by its place in the list), and
        # the ends
        memo = {id(b): Skipped(b) for i, b in enumerate(layers) if i not in blocks}
        # (piece_parts.Final: the piece's output, and whether the blocks ran)
        self._passed, self._blocks_ran = [None], [False]
        for name, m in model.named_modules():
            if not self.first and matches(name, embeddings):
                memo[id(m)] = NoEmbedding(m.weight.shape[1], m.weight.dtype)
            elif not self.last and matches(name, finals):
                memo[id(m)] = Final(name, m, self._passed, self._blocks_ran)
        self.model = copy_module(model, memo)
        # the model's name of each parameter copied here (a tied parameter copied under
        # another module keeps the model's one name)
        self.names = {memo[id(p)]: name for name, p in model.named_parameters()
                      if isinstance(memo.get(id(p)), nn.Parameter)}
        (kept,) = matching(self.model, block_list)
        self._runs = set()  # the places in the blocks' list that ran in this forward
        for place, block in enumerate(kept):
            block.register_forward_hook(functools.partial(
                _ran, self._runs, self._blocks_ran, place, len(kept) - 1))
        # Megatron SP: a model derives its positions and masks (and GPT-2 its output's
        # shape) from its input's length, so stages pass whole sequences (gathered where
        # the final norm would gather), sharded again before a piece's first block
        group = getattr(model, "sequence_group", None)
        if not self.first:
            entry = next(b for b in kept if not isinstance(b, Skipped))
            if group is not None:
                split_before(entry, group)
            self._arriving = [None]  # the hidden states this piece takes, during its forward
            entry.register_forward_pre_hook(functools.partial(_arrives, self._arriving),
                                            with_kwargs=True, prepend=True)

    def aux_loss(self):
        return self.model.aux_loss()

    def named_reference_parameters(self):
        """(the model's name, parameter) of every parameter this piece holds."""
        return [(self.names[p], p) for p in self.model.parameters()]

    def forward(self, x, targets=None):
        self._passed[0], self._blocks_ran[0] = None, False
        self._runs.clear()
        try:
            return self._forward(x, targets)
        finally:
            self._runs.clear()  # (a block recomputed in backward runs once more)

    def _forward(self, x, targets):
        if self.first:
            out = self.model.run(input_ids=x)
        else:  # (placeholder ids of x's batch and length: masks and positions as the first's)
            self._arriving[0] = x
            try:
                out = self.model.run(input_ids=x.new_zeros(x.shape[:2], dtype=torch.long))
            finally:
                self._arriving[0] = None
        if self.last:
            return self.model.loss_of(out, targets)
        out, self._passed[0] = self._passed[0], None
        return out


def _arrives(arriving, block, args, kwargs):
    """The first block of a piece but the first takes the hidden states that arrived (its
    first argument, or ``hidden_states``), not what the model made of placeholder ids."""
    if args:
        return (arriving[0], *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": arriving[0]}


def _ran(runs, blocks_ran, place, last, block, args, out):
    """Block ``place`` of the list ran: once in a forward, else the model loops over its
    blocks (Dory's recurrent depth), which pieces of the list cannot cut; the last one ran:
    final modules pass on from now (piece_parts.Final)."""
    if place in runs:
        raise ValueError(f"pipeline: block {place} of the model's list ran twice in one "
                         "forward: the model loops over its blocks (a recurrent depth), "
                         "which pieces of the list cannot hold; train it without --pp")
    runs.add(place)
    blocks_ran[0] = blocks_ran[0] or place == last


def _held(model: nn.Module, plan: Plan, index: int, count: int, blocks: range) -> list:
    """(the model's name, parameter) of each parameter piece ``index`` holds."""
    embeddings, block_list, finals = plan.pipeline
    (layers,) = matching(model, block_list)
    modules = [layers[i] for i in blocks] + \
        [m for name, m in model.named_modules()
         if index == 0 and matches(name, embeddings) or
         index == count - 1 and matches(name, finals)]
    held = {id(p) for m in modules for p in m.parameters()}
    return [(name, p) for name, p in model.named_parameters() if id(p) in held]


class PipelineStage(nn.Module):
    """This rank's pieces of ``model`` (a model.LanguageModel, parallelized or not) for a
    pipeline of ``group.size`` stages with ``virtual`` chunks each, cut where ``plan``
    says. ``pieces[c]`` is chunk c."""

    def __init__(self, model: nn.Module, plan: Plan, group: commlib.Communicator,
                 virtual: int = 1):
        super().__init__()
        if isinstance(virtual, bool) or not isinstance(virtual, int) or virtual < 1:
            raise ValueError(f"pipeline: virtual must be a positive int, got {virtual!r}")
        if not plan.pipeline:
            raise ValueError(f"pipeline: the plan for {type(model).__name__} names no cut "
                             "(embeddings, blocks, final modules)")
        count = group.size * virtual
        blocks = partition(len(matching(model, plan.pipeline[1])[0]), count)
        # every stage's parameter names and shapes, from the model (pieces of other stages
        # are not built here)
        layout = [[(name, p.shape) for c in range(virtual)
                   for name, p in _held(model, plan, c * group.size + s, count,
                                        blocks[c * group.size + s])]
                  for s in range(group.size)]
        placed = [name for stage in layout for name, _ in stage]
        stray = [name for name, _ in model.named_parameters() if name not in placed]
        if stray:
            raise ValueError(f"pipeline: parameters {stray[:3]} lie outside the plan's cut "
                             "(embeddings, blocks, final modules); name their modules there")
        pieces = [Piece(model, plan, c * group.size + group.rank, count,
                        blocks[c * group.size + group.rank]) for c in range(virtual)]
        # parameters both the first and the last piece hold (GPT-2's LM head tied to its
        # embedding): each keeps a copy, their gradients are summed (Pipeline), and a
        # checkpoint takes half of it from each (``pp_replica``: index, count)
        ends = [dict(_held(model, plan, i, count, blocks[i])) for i in (0, count - 1)]
        self.tied = sorted(set(ends[0]) & set(ends[1])) if count > 1 else []
        for piece in pieces:
            for name, p in piece.named_reference_parameters():
                if name in self.tied:
                    p.pp_replica = (int(piece.last), 2)
        self.config, self.group = model.config, group
        self.stages, self.virtual, self.stage = group.size, virtual, group.rank
        self.pieces = nn.ModuleList(pieces)
        self.layout = layout  # every stage's parameter names and local shapes
        # the copies lost the model's gradient hooks (Megatron SP's, context parallelism's)
        rehook_gradient_sums(self.pieces)
        # zero-bubble's W runs backward from each module's output to its own parameters:
        # not for modules whose weights their parent applies (they say so)
        self.unsplittable = next((m.unsplittable for m in self.pieces.modules()
                                  if getattr(m, "unsplittable", None)), None)
        self._captured = None  # while run_piece captures: [(module, output)]
        # per piece, each module holding trainable parameters -> those (its own): what the
        # split backward's W runs back to, from the module's output
        self.weights = [{m: own for m in piece.modules()
                         if (own := [p for p in m.parameters(recurse=False) if p.requires_grad])}
                        for piece in self.pieces]
        for module in (m for weights in self.weights for m in weights):
            module.register_forward_hook(self._on_module_output)

    @property
    def dtype(self) -> torch.dtype:
        """The parameters' dtype: what travels between stages."""
        return next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        """The parameters' device: where activations arrive."""
        return next(self.parameters()).device

    def _on_module_output(self, module, args, output):
        if self._captured is not None:  # (a module may return several tensors: a router's)
            outputs = output if isinstance(output, (tuple, list)) else (output,)
            self._captured += [(module, t) for t in outputs
                               if isinstance(t, torch.Tensor) and t.requires_grad]

    def run_piece(self, chunk: int, x, targets=None, capture: bool = False):
        """(chunk's output, and with ``capture`` the (module, output tensor) of each of its
        modules that holds parameters, in call order; else None)."""
        self._captured = [] if capture else None
        try:
            return self.pieces[chunk](x, targets), self._captured
        finally:
            self._captured = None

    def named_reference_parameters(self):
        """(the model's name, parameter) for every parameter this stage holds."""
        for piece in self.pieces:
            yield from piece.named_reference_parameters()

    def tied_gradients(self) -> list:
        """The gradients of this stage's copies of tied parameters: the first piece's, then
        the last piece's (one stage may hold both)."""
        return [p.grad for piece in self.pieces if piece.first or piece.last
                for name, p in piece.named_reference_parameters() if name in self.tied]


@torch.no_grad()
def gathered_state(stage: PipelineStage, *, grads: bool = False) -> dict:
    """Reference name -> parameter (or its gradient, with ``grads``) of the whole model, on
    every stage; tensor-parallel parameters stay this tp rank's slices. Collective over the
    pipeline group."""
    mine = dict(stage.named_reference_parameters())
    out = {}
    for s, names in enumerate(stage.layout):
        if s == stage.stage:
            flat = torch.cat([(mine[n].grad if grads else mine[n]).detach().reshape(-1)
                              for n, _ in names])
        else:
            flat = torch.empty(sum(shape.numel() for _, shape in names), dtype=stage.dtype,
                               device=stage.device)
        stage.group.broadcast(flat, root=s)
        for (name, shape), t in zip(names, flat.split([sh.numel() for _, sh in names])):
            out[name] = t.view(shape).clone()
    return out


# ------------------------------------------------------------------------------ the runtime

@dataclass
class StepReport:
    """The last step's timing. ``idle[s]``: the fraction of the step (from the stages'
    common start to the last stage's end) that stage s did not compute; ``costs``: each
    (stage, chunk, kind)'s mean seconds; ``simulated_idle``: ``idle`` as ``simulate`` finds
    it with those costs (and free communication)."""
    seconds: float
    idle: list
    simulated_idle: list
    costs: dict

    @property
    def bubble(self) -> float:
        return sum(self.idle) / len(self.idle)

    @property
    def simulated_bubble(self) -> float:
        return sum(self.simulated_idle) / len(self.simulated_idle)


class Pipeline:
    """Runs ``schedule`` (a name from ``pipeline_schedules.SCHEDULES``, or a schedule built
    for this stage count, chunk count and microbatch count) on ``stage``. Every stage of the
    group calls ``step`` with the same batch. With ``measure``, each step starts with a
    barrier over the pipeline group, and ``report`` holds its measured and simulated idle
    fractions (one small all-gather)."""

    def __init__(self, stage: PipelineStage, schedule, microbatches: int, *,
                 dp_group: commlib.Communicator | None = None, gradients=None,
                 measure: bool = True):
        p, v = stage.stages, stage.virtual
        if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
            raise ValueError(f"pipeline: microbatches must be a positive int, got {microbatches!r}")
        if isinstance(schedule, str):
            self.name = schedule
            schedule = build_schedule(schedule, p, microbatches, v)
        else:
            self.name = "custom"
        self.simulation = simulate(schedule)  # proves it complete and free of deadlock
        if len(schedule) != p or {a.chunk for a in schedule[0]} != set(range(v)) or \
                {a.microbatch for a in schedule[0]} != set(range(microbatches)):
            raise ValueError(f"pipeline: the schedule is not one for {p} stages, {v} chunks "
                             f"and {microbatches} microbatches")
        if 2 * p * v * microbatches > _TAG_LIMIT:
            raise ValueError(f"pipeline: {p * v} pieces x {microbatches} microbatches need more "
                             f"message tags than the {_TAG_LIMIT} commlib has; use fewer")
        self.stage, self.schedule, self.microbatches = stage, schedule, microbatches
        self.actions = schedule[stage.stage]
        if dp_group is not None and gradients is not None:
            raise ValueError("pipeline: give dp_group (average the gradients over it) or "
                             "gradients (a ZeRO that reduce-scatters them), not both")
        if dp_group is not None and dp_group.size > 1:
            gradients = GroupAverage(dp_group)
        self.gradients = gradients  # reduce(params), wait(): over the data-parallel ranks
        self.measure, self.report = measure, None
        self._post_before = _posting_plan(self.actions)
        self.split = {(a.microbatch, a.chunk) for a in self.actions if a.kind == "W"}
        if self.split and stage.unsplittable:
            raise ValueError(f"pipeline: schedule {self.name!r} splits backward into I and W, "
                             f"which {stage.unsplittable} do not support; use a schedule "
                             "without W (gpipe, 1f1b, interleaved-1f1b)")
        # the last backward action of each chunk: its gradients are final after it, but
        # those of a chunk holding a copy of a tied parameter only after their sum
        self._final = {a.chunk: a for a in self.actions if a.kind in ("B", "W")}
        self._tied_chunks = {c for c, piece in enumerate(stage.pieces)
                             if stage.tied and (piece.first or piece.last)}

    # ------------------------------------------------------------------ one step
    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """Forward and backward of the batch (token ids and targets, (B, T) each, the same on
        every stage); gradients accumulate into the parameters. Returns the batch's mean loss."""
        m = self.microbatches
        if inputs.dim() != 2 or inputs.shape != targets.shape:
            raise ValueError(f"pipeline: inputs and targets must both be (batch, time), got "
                             f"{tuple(inputs.shape)} and {tuple(targets.shape)}")
        if inputs.shape[0] % m:
            raise ValueError(f"pipeline: batch {inputs.shape[0]} does not divide into {m} "
                             f"microbatches; use a multiple of {m}")
        group = self.stage.group
        # what travels between stages: a microbatch's hidden states
        self._run = _StepState(inputs.chunk(m), targets.chunk(m),
                               (inputs.shape[0] // m, inputs.shape[1],
                                self.stage.config.d_model))
        run = self._run
        if self.measure:
            group.barrier()
        start = time.perf_counter()
        for i, a in enumerate(self.actions):
            for r in self._post_before[i]:
                run.posted[(r.kind, r.microbatch, r.chunk)] = self._post_recv(r)
            began = time.perf_counter()
            getattr(self, f"_{a.kind.lower()}")(a)
            if a.kind in COMPUTE:
                run.costs.setdefault((a.kind, a.chunk), []).append(time.perf_counter() - began)
        finished = time.perf_counter() - start
        for work in run.sends:
            work.wait()
        self._sum_tied()
        if self.gradients is not None:
            self.gradients.wait()
        # the last stage holds the cross-entropy; with MoE layers every stage adds aux losses
        loss = torch.tensor([run.loss], dtype=torch.float64)
        group.all_reduce(loss)
        if self.measure:
            self.report = self._measure(finished)
        self._run = None
        return float(loss)

    # ------------------------------------------------------------------ the actions
    def _f(self, a: Action):
        run, piece = self._run, self.stage.pieces[a.chunk]
        if piece.first:
            x = run.inputs[a.microbatch]
        else:
            x = run.inbox.pop(("F", a.microbatch, a.chunk)).requires_grad_(True)
        out, modules = self.stage.run_piece(a.chunk, x, run.targets[a.microbatch],
                                            capture=(a.microbatch, a.chunk) in self.split)
        if piece.last:
            out = out / self.microbatches
            run.loss += float(out.detach())
        aux = piece.aux_loss()
        if aux is not None:
            aux = aux / self.microbatches
            run.loss += float(aux.detach())
        run.held[(a.microbatch, a.chunk)] = _Held(x, out, modules, aux)
        if not piece.last:
            self._deliver("F", piece.index + 1, a.microbatch, out.detach())

    def _b(self, a: Action):
        held, grad = self._held_and_output_grad(a)
        roots, root_grads = held.roots(grad)
        torch.autograd.backward(roots, root_grads)
        if not self.stage.pieces[a.chunk].first:
            self._deliver("B", self._piece(a) - 1, a.microbatch, held.input.grad)
        del self._run.held[(a.microbatch, a.chunk)]
        self._after_weights(a)

    def _i(self, a: Action):
        held, grad = self._held_and_output_grad(a)
        piece = self.stage.pieces[a.chunk]
        outputs = [out for _, out in held.modules]
        # parameters of modules that were not called, applied by another module (Jamba's
        # mixer multiplies by its dt_proj's weight): theirs is no W, I gives their gradients
        called = {module for module, _ in held.modules}
        applied = [p for m, own in self.stage.weights[a.chunk].items() if m not in called
                   for p in own]
        wanted = ([] if piece.first else [held.input]) + outputs + applied
        roots, root_grads = held.roots(grad)
        # (allow_unused: a module's output nothing later used, such as a router's logits)
        grads = torch.autograd.grad(roots, wanted, root_grads, retain_graph=True,
                                    allow_unused=True)
        if not piece.first:
            self._deliver("B", self._piece(a) - 1, a.microbatch, grads[0])
            grads = grads[1:]
        held.module_grads = grads[:len(outputs)]
        for p, g in zip(applied, grads[len(outputs):]):
            if g is not None:
                p.grad = g if p.grad is None else p.grad.add_(g)

    def _w(self, a: Action):
        held = self._run.held.pop((a.microbatch, a.chunk))
        # per module: from its output to its own parameters only (one call over all modules
        # would also run back through the residual stream into earlier modules' weights)
        outputs: dict = {}  # module -> (its outputs, their gradients): one backward each
        for (module, out), grad in zip(held.modules, held.module_grads):
            if grad is not None:
                outs, grads = outputs.setdefault(module, ([], []))
                outs.append(out)
                grads.append(grad)
        for module, (outs, grads) in outputs.items():
            params = self.stage.weights[a.chunk][module]
            # (kept: a module whose output is its child's, a Mamba mixer's out_proj's, runs
            # back through the child's operations too; freed with ``held``)
            torch.autograd.backward(outs, grads, inputs=params, retain_graph=True)
        self._after_weights(a)

    def _send_f(self, a: Action):
        self._send("F", self._piece(a) + 1, a)

    def _send_b(self, a: Action):
        self._send("B", self._piece(a) - 1, a)

    def _recv_f(self, a: Action):
        self._receive(a, "F")

    def _recv_b(self, a: Action):
        self._receive(a, "B")

    # ------------------------------------------------------------------ helpers
    def _piece(self, a: Action) -> int:
        return a.chunk * self.stage.stages + self.stage.stage

    def _held_and_output_grad(self, a: Action):
        held = self._run.held[(a.microbatch, a.chunk)]
        grad = None if self.stage.pieces[a.chunk].last else \
            self._run.inbox.pop(("B", a.microbatch, a.chunk))
        return held, grad

    def _tag(self, direction: str, piece: int, microbatch: int) -> int:
        """The tag of the message to ``piece`` (its input, or the gradient of its output)."""
        return 2 * (piece * self.microbatches + microbatch) + (direction == "B")

    def _deliver(self, direction: str, piece: int, microbatch: int, tensor):
        """Hand a tensor to ``piece``: kept for this stage's own next action if the piece is
        here (a one-stage pipeline), else for the SEND action that follows."""
        p = self.stage.stages
        key = (direction, microbatch, piece // p)
        if piece % p == self.stage.stage:
            self._run.inbox[key] = tensor.detach()
        else:
            self._run.outbox[key] = tensor.detach().contiguous()

    def _send(self, direction: str, piece: int, a: Action):
        p = self.stage.stages
        tensor = self._run.outbox.pop((direction, a.microbatch, piece // p))
        self._run.sends.append(self.stage.group.send(
            tensor, piece % p, tag=self._tag(direction, piece, a.microbatch), async_op=True))

    def _post_recv(self, a: Action):
        direction = a.kind[-1]
        piece = self._piece(a)
        source = (piece - 1 if direction == "F" else piece + 1) % self.stage.stages
        buffer = torch.empty(self._run.shape, dtype=self.stage.dtype, device=self.stage.device)
        work = self.stage.group.recv(buffer, source, tag=self._tag(direction, piece, a.microbatch),
                                     async_op=True)
        return work, buffer

    def _receive(self, a: Action, direction: str):
        work, buffer = self._run.posted.pop((a.kind, a.microbatch, a.chunk))
        work.wait()
        self._run.inbox[(direction, a.microbatch, a.chunk)] = buffer

    def _after_weights(self, a: Action):
        """After a chunk's last backward action its gradients are final: start reducing
        them over the data-parallel ranks."""
        if self.gradients is not None and self._final[a.chunk] == a and \
                a.chunk not in self._tied_chunks:
            self._reduce(a.chunk)

    def _reduce(self, chunk: int):
        self.gradients.reduce([p for p in self.stage.pieces[chunk].parameters()
                               if p.requires_grad])

    def _sum_tied(self):
        """Make the gradient of each copy of a tied parameter (the first piece's, the last
        piece's) their sum, on the stages holding them, then reduce those chunks."""
        stage = self.stage
        grads = stage.tied_gradients()
        if grads:
            flat = torch.cat([g.reshape(-1) for g in grads])
            if stage.stages == 1:  # this stage holds both copies
                half = flat.numel() // 2
                flat = (flat[:half] + flat[half:]).repeat(2)
            else:
                peer = stage.stages - 1 if stage.stage == 0 else 0
                other = torch.empty_like(flat)
                works = [stage.group.send(flat, peer, tag=_TAG_LIMIT, async_op=True),
                         stage.group.recv(other, peer, tag=_TAG_LIMIT, async_op=True)]
                for work in works:
                    work.wait()
                flat = flat + other  # (the same sum on both: addition commutes exactly)
            for g, total in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(total.view_as(g))
        if self.gradients is not None:
            for chunk in sorted(self._tied_chunks):
                self._reduce(chunk)

    def _measure(self, finished: float) -> StepReport:
        """Gather every stage's busy time, end time and mean cost per (kind, chunk)."""
        run, v, p = self._run, self.stage.virtual, self.stage.stages
        kinds = list(COMPUTE)
        mine = torch.zeros(2 + v * len(kinds), dtype=torch.float64)
        mine[0] = sum(sum(t) for t in run.costs.values())
        mine[1] = finished
        for (kind, chunk), times in run.costs.items():
            mine[2 + chunk * len(kinds) + kinds.index(kind)] = sum(times) / len(times)
        everyone = torch.empty((p,) + mine.shape, dtype=torch.float64)
        self.stage.group.all_gather(everyone, mine)
        busy, end, costs = everyone[:, 0], everyone[:, 1], everyone[:, 2:].view(p, v, len(kinds))
        makespan = float(end.max())
        table = {(s, c, kind): float(costs[s, c, k]) for s in range(p) for c in range(v)
                 for k, kind in enumerate(kinds) if costs[s, c, k] > 0}
        sim = simulate(self.schedule, lambda a: table.get((a.stage, a.chunk, a.kind), 0.0))
        return StepReport(makespan, [1.0 - float(b) / makespan for b in busy], sim.idle, table)


class GroupAverage:
    """A pipeline's plain data parallelism: ``reduce(params)`` starts averaging their
    gradients over ``group`` (one flat async all-reduce), ``wait()`` writes the averages
    back to ``.grad``."""

    def __init__(self, group: commlib.Communicator):
        self.group, self.pending = group, []

    def reduce(self, params) -> None:
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        self.pending.append((self.group.all_reduce(flat, op="avg", async_op=True), flat, params))

    def wait(self) -> None:
        for work, flat, params in self.pending:
            work.wait()
            for p, g in zip(params, flat.split([p.numel() for p in params])):
                p.grad.copy_(g.view_as(p))
        self.pending = []


def _posting_plan(actions: list[Action]) -> list[list[Action]]:
    """The receives to post before each action: those the next compute action needs are
    posted before the current one starts, so their messages land while it computes."""
    plan = [[] for _ in actions]
    computes = [i for i, a in enumerate(actions) if a.kind in COMPUTE]
    for i, a in enumerate(actions):
        if a.kind.startswith("RECV"):
            before = [c for c in computes if c < i]
            plan[before[-1] if before else 0].append(a)
    return plan


@dataclass
class _Held:
    """What a forward leaves for its backward."""
    input: torch.Tensor
    output: torch.Tensor
    modules: list  # (module, output) of each module with parameters (split backward only)
    aux: torch.Tensor | None = None  # the piece's share of the MoE aux losses
    module_grads: tuple = ()

    def roots(self, grad) -> tuple:
        """(tensors, their gradients) that backward starts from: the output, given the
        gradient that came back for it (None: the loss), and the aux loss."""
        if self.aux is None:
            return [self.output], [grad]
        return [self.output, self.aux], [grad, None]


class _StepState:
    def __init__(self, inputs, targets, shape):
        self.inputs, self.targets, self.shape = inputs, targets, shape
        self.posted = {}   # (RECV kind, microbatch, chunk) -> (work, buffer)
        self.inbox = {}    # (direction, microbatch, chunk) -> tensor arrived for this chunk
        self.outbox = {}   # (direction, microbatch, chunk of the receiver) -> tensor to send
        self.held = {}     # (microbatch, chunk) -> _Held
        self.sends = []
        self.costs = {}    # (kind, chunk) -> seconds of each action
        self.loss = 0.0
