"""ZeRO: data parallelism whose optimizer state (stage 1), gradients (2) and parameters (3)
are sharded over the data-parallel group instead of replicated.

Vocabulary: the model is cut into *units*, what stage 3 gathers at once: by default the
items of each ModuleList or Sequential (the blocks) and the other children with parameters
(``default_units``). Each parameter belongs to one unit. Those of no unit, and those that
several units hold (tied weights), form the *root* unit, the model itself, which stage 3
keeps gathered for the model's whole forward (and again its whole backward): a tied
lm_head reads the embedding's weight long after the embedding ran.
A unit's parameters, flattened in order and padded to a multiple of the group size, form
its *flat* vector; rank r owns the r-th of its ``group.size`` equal *shards*. (A unit may be
sharded over a group of its own: expert-parallel experts, replicated over dp only.) This rank's
shards of every unit, concatenated, are the *master* vector: the only parameters the
optimizer sees (any torch optimizer), so its state exists for 1/n of the model.

    stage 1  as soon as a unit's gradients are complete in backward, they are
             reduce-scattered to their owners (async, overlapping the rest of backward) and
             zeroed: they stay allocated at full size, as stage 1 holds them, and the next
             backward accumulates afresh. step() updates the master shard and all-gathers
             the new parameters.
    stage 2  as stage 1, but a unit's gradients are freed once reduce-scattered.
             With ``gather_ahead``, stages 1 and 2 wait for a unit's new parameters only
             just before its next forward, so that their all-gather overlaps the forward;
             until then the parameters are empty (settle(), gathered(), full_parameters()
             and checkpoints make them whole).
    stage 3  parameters live only as shards: a unit is all-gathered just before its forward
             (the next unit's gather is already in flight), freed after it, gathered again
             before its backward (prefetching the unit before it), then freed again.

Traffic per step: stages 1 and 2 reduce-scatter and all-gather the model once each (2x its
size), stage 3 all-gathers it twice and reduce-scatters it once (3x).

With ``compress`` (a wire format: commlib/compressed.py) each unit's gradients are
reduce-scattered in that format, as ZeRO++'s qgZ does, with an error feedback per unit
(unless ``error_feedback`` is False), on a thread of their own so that backward goes on
meanwhile (float32 units on the CPU). With ``compress_params`` (stage 3) the parameters'
gathers carry them in a wire format too, as ZeRO++'s qwZ does: forward and backward
compute with the decoded weights (the same on every rank), the optimizer updates the
float32 master shards, which no encoding touches (no error feedback: nothing accumulates).

Where several backward passes accumulate into one step's gradients and only the caller knows
when a unit's are final (a pipeline: every microbatch runs its own backward, split into
pieces), ``reduce_in_backward=False`` turns the backward hooks off: the caller
launches each unit's reduce-scatter with ``reduce(params)`` once the gradients of ``params``
(whole units) are final, and ``wait()`` collects them (reducing any unit not yet launched).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

import commlib
from commlib import compressed


def default_units(model: nn.Module) -> list:
    """The modules that are units of their own: the items of every ModuleList or Sequential
    (a model's blocks, wherever they are nested), and every other child with parameters
    beside them on the way down. The rest of ``model``'s parameters (registered on the
    modules along that way, and any shared between units, such as an lm_head tied to the
    embedding) form the *root* unit, ``model`` itself (see ``ZeRO``)."""
    def holds_list(m: nn.Module) -> bool:
        return any(isinstance(d, (nn.ModuleList, nn.Sequential)) and _has_parameters(d)
                   for d in m.modules())

    units = []
    for child in model.children():
        if isinstance(child, (nn.ModuleList, nn.Sequential)):
            units += [m for m in child if _has_parameters(m)]
        elif holds_list(child):
            units += default_units(child)
        elif _has_parameters(child):
            units.append(child)
    return units


def _has_parameters(m: nn.Module) -> bool:
    return any(True for _ in m.parameters())


def _tensors(value) -> list:
    """The tensors in a module's output: nested tuples, lists and dicts (transformers'
    ModelOutput is one) included."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


class _UsesOutsideForward(TorchFunctionMode):
    """Stage 3's first forward runs under this mode: a parameter that an op reads while its
    unit is freed is used outside its unit's forward (a model reading a block's weight
    itself); that unit is gathered on the spot and held from then on, like the root."""

    def __init__(self, zero: "ZeRO"):
        super().__init__()
        self.zero = zero

    def __torch_function__(self, func, types, args=(), kwargs=None):
        for t in tree_leaves((args, kwargs)):
            unit = self.zero._unit_of.get(t) if isinstance(t, nn.Parameter) else None
            if unit is not None and not unit.gathered:
                unit.held = True
                self.zero._gather(unit)
        return func(*args, **(kwargs or {}))


def _assign(model: nn.Module, modules: list) -> list:
    """[(unit module, its parameters)]: each parameter to the one unit module that holds it;
    those no module or several hold go to the root unit, ``model``, first in the list
    (omitted when it gets none). ``modules`` may name ``model`` itself (its own parameters
    then join the root)."""
    holders: dict = {}
    for m in modules:
        if m is not model:
            for p in m.parameters():
                holders.setdefault(p, []).append(m)
    root = [p for p in model.parameters() if len(holders.get(p, ())) != 1]
    owned = [(m, [p for p in m.parameters() if holders[p] == [m]])
             for m in modules if m is not model]
    return [(m, params) for m, params in [(model, root)] + owned if params]


class _Unit:
    def __init__(self, module: nn.Module, params: list, group: commlib.Communicator,
                 master_offset: int):
        self.module, self.group = module, group
        self.params = [p for p in params if p.requires_grad]
        self.shapes = [p.shape for p in self.params]
        self.numel = sum(p.numel() for p in self.params)
        n = group.size
        self.shard_numel = -(-self.numel // n)
        self.padded = self.shard_numel * n
        self.master_offset = master_offset
        self.dtype = self.params[0].dtype if self.params else torch.float32
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.gathered = False    # the parameters hold their full values
        self.gather_work = None  # (work, flat) of an all-gather in flight
        self.grad_work = None    # (work, shard) of a reduce-scatter in flight
        self.refresh = None      # stages 1, 2: (work, flat) of the new parameters' all-gather
        self.ready: set = set()
        self.held = False  # stage 3: gathered for the model's whole forward, and backward

    def flatten(self, tensors) -> torch.Tensor:
        flat = torch.zeros(self.padded, dtype=self.dtype, device=self.device)
        offset = 0
        for t, shape in zip(tensors, self.shapes):
            n = shape.numel()
            if t is not None:
                flat[offset:offset + n].copy_(t.reshape(-1))
            offset += n
        return flat

    def views(self, flat: torch.Tensor) -> list:
        out, offset = [], 0
        for shape in self.shapes:
            out.append(flat[offset:offset + shape.numel()].view(shape))
            offset += shape.numel()
        return out


class ZeRO(nn.Module):
    """``ZeRO(model, group, stage, optimizer)``: ``optimizer(params)`` builds any torch
    optimizer over the list it is given (this rank's master shard). Train with
    ``loss.backward(); zero.step(); zero.zero_grad()``.

    ``unit_groups``: {unit module: group} for units whose parameters are replicated over a
    smaller group than ``group`` (each ep rank holds other experts: they are replicated over
    dp only). Such a unit is sharded over its own group, and its gradient summed over it and
    divided by ``group.size``, as every unit's: the mean over the ranks that saw different
    data, when each of its replicas already sums what the others contributed (an expert's
    gradient holds every ep rank's tokens)."""

    def __init__(self, module: nn.Module, group: commlib.Communicator, stage: int, optimizer,
                 units: list | None = None, reduce_in_backward: bool = True,
                 unit_groups: dict | None = None, gather_ahead: bool = False,
                 compress=None, error_feedback: bool = True, compress_params=None):
        super().__init__()
        self.wire = None if compress is None else compressed.as_wire(compress)
        self.param_wire = None if compress_params is None else \
            compressed.as_wire(compress_params)
        self.error_feedback = error_feedback
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage!r}")
        if self.param_wire is not None and stage != 3:
            raise ValueError(f"ZeRO(compress_params={self.param_wire.format!r}) compresses "
                             f"stage 3's parameter gathers; stage {stage} gathers once a "
                             f"step, uncompressed (use stage 3, or leave it out)")
        if gather_ahead and stage == 3:
            raise ValueError("ZeRO: gather_ahead is stages 1 and 2's (stage 3 prefetches each "
                             "unit's gather during forward and backward anyway)")
        self.gather_ahead = gather_ahead
        self.module, self.group, self.stage = module, group, stage
        unit_groups = unit_groups or {}
        self.units, offset = [], 0
        for m, params in _assign(module, units if units is not None else default_units(module)):
            self.units.append(_Unit(m, params, unit_groups.get(m, group), offset))
            offset += self.units[-1].shard_numel
        unknown = set(unit_groups) - {u.module for u in self.units}
        if unknown:
            raise ValueError(f"ZeRO: unit_groups names modules that are no unit "
                             f"({sorted(type(m).__name__ for m in unknown)}); key it by units")
        with torch.no_grad():  # every rank starts from its group's rank 0's weights
            group_of = {p: u.group for u in self.units for p in u.params}
            for t in list(module.parameters()) + list(module.buffers()):
                group_of.get(t, group).broadcast(t.data, root=0)
        dtypes = {u.dtype for u in self.units}
        if len(dtypes) > 1:
            raise ValueError(f"ZeRO: the model mixes parameter dtypes {sorted(map(str, dtypes))}; "
                             "convert it to one (e.g. model.to(torch.bfloat16))")
        self.dtype = dtypes.pop() if dtypes else torch.float32
        self.compressed_groups: dict = {}  # id(a unit's group) -> the compressed calls' own
        if self.wire is not None or self.param_wire is not None:
            if self.dtype != torch.float32 or any(
                    u.device.type != "cpu" for u in self.units if u.params):
                what = "compress" if self.wire is not None else "compress_params"
                raise TypeError(f"ZeRO({what}=...) compresses float32 tensors on the CPU, "
                                f"not {self.dtype}: keep the model in float32 on the CPU, or "
                                f"leave {what} out")
            self.background = compressed.Background()
            self.feedback: dict = {}  # unit -> ErrorFeedback
            # the compressed calls' own communicators (their thread's calls must not meet
            # the gathers stage 3 issues meanwhile), one per group, made in unit order
            for u in self.units:
                if id(u.group) not in self.compressed_groups:
                    self.compressed_groups[id(u.group)] = u.group.dup()
        devices = {u.device for u in self.units if u.params}
        if len(devices) > 1:
            raise ValueError(f"ZeRO: the model's parameters are on {sorted(map(str, devices))}; "
                             "put it on one device (model.to(device))")
        self.device = devices.pop() if devices else torch.device("cpu")
        # master weights in fp32 at least (mixed precision: a bf16 model; fp64 stays fp64)
        self.master = nn.Parameter(torch.empty(offset, dtype=torch.promote_types(
            self.dtype, torch.float32), device=self.device))
        self.grad_shard = None  # this rank's reduced gradients, in the model's dtype
        with torch.no_grad():
            for u in self.units:
                self._master_of(u).copy_(u.flatten(u.params).chunk(u.group.size)[u.group.rank])
        # stage 3 gathers from a shard in the model's dtype (the master itself where they agree)
        self.param_shard = self.master.data.to(self.dtype) if stage == 3 else None
        self.optimizer = optimizer([self.master])
        self._unit_of = {p: u for u in self.units for p in u.params}
        self._pending = False
        self._discovered = False  # stage 3's first forward looked for parameters used outside
        self._next_launch = 0  # units' reduce-scatters are launched in reverse unit order
        # evidence of overlap: gathers already in flight when needed, reduce-scatters
        # launched while backward was still running
        self.prefetched = self.reduced_during_backward = 0
        self.reduce_in_backward = reduce_in_backward
        if reduce_in_backward:
            for p in self._unit_of:
                p.register_post_accumulate_grad_hook(self._on_grad)
        if gather_ahead:  # each unit's new parameters just before its forward needs them
            root = [u for u in self.units if u.module is module]
            module.register_forward_pre_hook(lambda m, args: self._refresh(root))
            for u in self.units:
                if u.module is not module and u.params:
                    u.module.register_forward_pre_hook(
                        lambda m, args, u=u: self._refresh([*root, u]))
        if stage == 3:
            self._discovering = None  # during the first forward: _UsesOutsideForward
            module.register_forward_pre_hook(lambda m, args: self._before_model_forward())
            module.register_forward_hook(lambda m, args, out: self._after_model_forward(out),
                                         always_call=True)
            for i, u in enumerate(self.units):
                self._free(u)
                u.held = u.module is module  # the root unit
                if not u.held:
                    u.module.register_forward_pre_hook(
                        lambda m, args, i=i: self._before_forward(i))
                    u.module.register_forward_hook(
                        lambda m, args, out, i=i: self._after_forward(i, out))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @property
    def own_groups(self) -> list:
        """The communicators it made (the compressed calls'): their traffic is its too."""
        return list(self.compressed_groups.values())

    def compression_holders(self) -> list:
        """Each unit's ErrorFeedback, in unit order (None where nothing is held)."""
        return [self._feedback(u) for u in self.units] if self.wire is not None else []

    def _feedback(self, u: _Unit):
        """``u``'s error feedback (none without ``error_feedback``)."""
        if not self.error_feedback:
            return None
        return self.feedback.setdefault(u, compressed.ErrorFeedback())

    def _master_of(self, u: _Unit) -> torch.Tensor:
        return self.master.data[u.master_offset:u.master_offset + u.shard_numel]

    # ------------------------------------------------------------------ stage 3 parameters
    def _start_gather(self, u: _Unit) -> None:
        if u.gather_work is None and not u.gathered:
            flat = torch.empty(u.padded, dtype=u.dtype, device=u.device)
            src = self.param_shard[u.master_offset:u.master_offset + u.shard_numel]
            if self.param_wire is not None:  # (on the compressed calls' thread, in order)
                u.gather_work = (self.background.submit(
                    compressed.all_gather, self.compressed_groups[id(u.group)], flat, src,
                    self.param_wire), flat)
            else:
                u.gather_work = (u.group.all_gather(flat, src, async_op=True), flat)

    def _gather(self, u: _Unit) -> None:
        if u.gathered:
            return
        self.prefetched += u.gather_work is not None
        self._start_gather(u)
        work, flat = u.gather_work
        work.wait()
        u.gather_work = None
        u.gathered = True  # first: _UsesOutsideForward sees the assignments below
        for p, view in zip(u.params, u.views(flat)):
            p.data = view

    def _free(self, u: _Unit) -> None:
        for p in u.params:
            p.data = torch.empty(0, dtype=u.dtype, device=u.device)
        u.gathered = False

    def _hold(self) -> None:
        """Gather the held units: the root, and those used outside their own forward."""
        held = [u for u in self.units if u.held]
        for u in held:
            self._start_gather(u)
        for u in held:
            self._gather(u)

    def _before_model_forward(self) -> None:
        self._hold()
        if not self._discovered:
            self._discovered = True
            self._discovering = _UsesOutsideForward(self)
            self._discovering.__enter__()

    def _after_model_forward(self, out) -> None:
        if self._discovering is not None:
            self._discovering.__exit__(None, None, None)
            self._discovering = None
        for u in self.units:
            if u.held:
                self._free(u)
        for t in _tensors(out):  # the model's backward starts: hold them again
            if t.requires_grad:
                t.register_hook(lambda grad: self._hold())

    def _before_forward(self, i: int) -> None:
        self._gather(self.units[i])
        if i + 1 < len(self.units):
            self._start_gather(self.units[i + 1])  # prefetch: overlaps this unit's compute

    def _after_forward(self, i: int, out) -> None:
        if not self.units[i].held:
            self._free(self.units[i])
        # Gradients reaching the unit's outputs mean its backward is next: gather it again.
        for t in _tensors(out):
            if t.requires_grad:
                t.register_hook(lambda grad, i=i: self._before_backward(i))

    def _before_backward(self, i: int) -> None:
        self._gather(self.units[i])
        if i > 0:
            self._start_gather(self.units[i - 1])

    # ------------------------------------------------------------------ gradients
    def _on_grad(self, p) -> None:
        if not self._pending:
            self._pending = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        self._unit_of[p].ready.add(p)
        while self._next_launch < len(self.units):  # in reverse unit order, complete ones
            next_unit = self.units[len(self.units) - 1 - self._next_launch]
            if len(next_unit.ready) < len(next_unit.params):
                return
            self._reduce_scatter(next_unit)
            self._next_launch += 1
            self.reduced_during_backward += 1

    def _reduce_scatter(self, u: _Unit) -> None:
        """Launch the reduce-scatter of ``u``'s gradients; free them (and, in stage 3, the
        unit's parameters)."""
        flat = u.flatten([p.grad for p in u.params])
        shard = torch.empty(u.shard_numel, dtype=u.dtype, device=u.device)
        if self.wire is None:
            work = u.group.reduce_scatter(shard, flat, op="avg", async_op=True)
        else:  # (flat stays referenced by the call until it ends)
            work = self.background.submit(compressed.reduce_scatter,
                                          self.compressed_groups[id(u.group)], shard, flat,
                                          self.wire, self._feedback(u), op="avg")
        u.grad_work = (work, shard)
        for p in u.params:
            if self.stage == 1 and p.grad is not None:
                p.grad.zero_()  # (held, as stage 1 holds them: the next backward adds to 0)
            else:
                p.grad = None
        if self.stage == 3:
            self._free(u)
        u.ready.clear()

    def _finish_backward(self) -> None:
        while self._next_launch < len(self.units):  # units without gradients send zeros
            self._reduce_scatter(self.units[len(self.units) - 1 - self._next_launch])
            self._next_launch += 1
        self._collect_gradients()
        self._next_launch = 0
        self._pending = False

    def reduce(self, params) -> None:
        """Launch the reduce-scatter of the units ``params`` make up, whose gradients are
        final (with ``reduce_in_backward=False``); ``wait`` collects it. Every rank of the
        group must reduce the same units in the same order."""
        given = set(params)
        units = [u for u in self.units if u.params and set(u.params) <= given]
        if {p for u in units for p in u.params} != given:
            raise ValueError("ZeRO.reduce: the parameters given are not a set of whole units; "
                             "pass every trainable parameter of each unit (e.g. a module's)")
        for u in units:
            if u.grad_work is not None:
                raise RuntimeError("ZeRO.reduce: a unit was reduced twice in one step; reduce "
                                   "each unit once, when its gradients are final")
            self._reduce_scatter(u)

    def wait(self) -> None:
        """Collect the reduce-scatters ``reduce`` launched; units it did not reach are
        reduced now (zeros for those without gradients)."""
        for u in reversed(self.units):
            if u.grad_work is None:
                self._reduce_scatter(u)
        self._collect_gradients()

    def _collect_gradients(self) -> None:
        """Wait for the reduce-scatters; add each shard into this rank's gradient shard (so
        micro-batches accumulate). It keeps the model's dtype: the optimizer gets a copy in the
        master's dtype only for the step."""
        if self.grad_shard is None:
            self.grad_shard = torch.zeros(self.master.numel(), dtype=self.dtype,
                                          device=self.device)
        for u in self.units:
            work, shard = u.grad_work
            work.wait()
            u.grad_work = None
            if u.group is not self.group:  # averaged over u.group: the mean over group's
                shard *= u.group.size / self.group.size
            self.grad_shard[u.master_offset:u.master_offset + u.shard_numel] += shard

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self) -> None:
        if self.stage == 1 and self.grad_shard is None and not self.reduce_in_backward:
            self.wait()
        if self.grad_shard is None:
            raise RuntimeError("ZeRO.step() without gradients: call loss.backward() first")
        if self.stage == 3:  # nothing gathered outlives the step: it would be stale after it
            for u in self.units:
                if u.gather_work is not None:  # a prefetch nothing used
                    u.gather_work[0].wait()
                    u.gather_work = None
                self._free(u)
        self.master.grad = self.grad_shard.to(self.master.dtype)
        self.optimizer.step()
        self.master.grad = None
        if self.stage == 3 and self.param_shard.data_ptr() != self.master.data_ptr():
            self.param_shard.copy_(self.master.data)
        if self.stage < 3:  # every rank's new parameters, unit by unit in forward order
            for u in self.units:
                flat = torch.empty(u.padded, dtype=u.dtype, device=u.device)
                u.refresh = (u.group.all_gather(flat, self._master_of(u).to(u.dtype),
                                                async_op=True), flat)
                if self.gather_ahead:  # (empty until its next forward or settle)
                    for p in u.params:
                        p.data = torch.empty(0, dtype=u.dtype, device=u.device)
            if not self.gather_ahead:
                self.settle()

    def settle(self) -> None:
        """Make every parameter whole and current (gather_ahead: their gathers are waited
        for now rather than at each unit's next forward). Collective where any is pending."""
        self._refresh(self.units)

    def _refresh(self, units) -> None:
        for u in units:
            if u.refresh is None:
                continue
            work, flat = u.refresh
            u.refresh = None
            work.wait()
            for p, view in zip(u.params, u.views(flat)):
                if self.gather_ahead:
                    p.data = view
                else:
                    p.copy_(view)

    def zero_grad(self) -> None:
        self.grad_shard = None
        for p in self._unit_of:
            p.grad = None

    # ------------------------------------------------------------------ after a death
    @torch.no_grad()
    def regroup(self, group: commlib.Communicator) -> None:
        """Go on over ``group``, the survivors of this one (Communicator.shrink), sharded
        over them from now on; collective over ``group``. A step that failed midway is
        dropped: redo it (its gradients are gone).

        Stages 1 and 2 only: their parameters are whole on every rank, so the master
        weights of a dead rank's shards are refilled from them (exact for an fp32 model;
        a bf16 model's loses the master's low bits there). The optimizer's state of those
        shards (Adam's moments, momentum) existed nowhere else: it restarts from zero, as
        for a parameter just added; where that matters, restart from the last checkpoint
        instead. Stage 3 cannot: the dead rank's parameter shards are lost with it. The
        optimizer object is kept (its learning-rate schedule goes on)."""
        self.settle()  # (the parameters, whole, refill a dead rank's shards)
        if self.stage == 3:
            raise commlib.CommError(
                "ZeRO.regroup: stage 3 keeps each parameter shard on one rank only, so a dead "
                "rank's part of the model is lost with it; restart every rank from the last "
                "checkpoint (commlib-train --resume; torchrun --max-restarts does it)")
        if any(u.group is not self.group for u in self.units):
            raise commlib.CommError(
                "ZeRO.regroup: units sharded over groups of their own (unit_groups: "
                "expert-parallel experts) cannot be regrouped; restart from the last checkpoint")
        old_ranks = torch.empty(group.size, dtype=torch.int64)
        group.all_gather(old_ranks, torch.tensor([self.group.rank]))
        shards = torch.empty(group.size, self.master.numel(), dtype=self.master.dtype,
                             device=self.device)
        # the parameters are replicated: every rank has the dead rank's part of them
        whole = [u.flatten(u.params).to(self.master.dtype) for u in self.units]
        units = []
        offset = 0
        for u in self.units:
            units.append(_Unit(u.module, u.params, group, offset))
            offset += units[-1].shard_numel

        def reshard(shard: torch.Tensor, refill: list) -> torch.Tensor:
            """This rank's new shard of the master-shaped ``shard``: the survivors' old
            shards where they had them, ``refill``'s flat vectors (one per unit) elsewhere."""
            group.all_gather(shards, shard.to(shards.dtype))
            out = torch.empty(offset, dtype=shard.dtype, device=self.device)
            for old, new, flat in zip(self.units, units, refill):
                flat = torch.cat([flat[:old.numel], flat.new_zeros(new.padded - old.numel)])
                s = old.shard_numel
                for j, r in enumerate(old_ranks.tolist()):
                    kept = max(0, min(s, old.numel - r * s))  # (the last shards pad)
                    flat[r * s:r * s + kept] = shards[j, old.master_offset:old.master_offset + kept]
                mine = flat[group.rank * new.shard_numel:(group.rank + 1) * new.shard_numel]
                out[new.master_offset:new.master_offset + new.shard_numel] = mine
            return out

        state = self.optimizer.state.get(self.master, {})
        for kind, value in list(state.items()):
            if isinstance(value, torch.Tensor) and value.shape == self.master.shape:
                state[kind] = reshard(value, [torch.zeros_like(w) for w in whole])
        self.master.data = reshard(self.master.data, whole)
        self.group, self.units = group, units
        self._unit_of = {p: u for u in units for p in u.params}
        self.grad_shard, self._pending, self._next_launch = None, False, 0
        for p in self._unit_of:
            p.grad = None

    @contextmanager
    def gathered(self):
        """Inside, every parameter holds its whole value: stage 3 gathers them all (collective)
        and frees them on the way out; stages 1 and 2 hold them anyway (settled first)."""
        self.settle()
        if self.stage == 3:
            for u in self.units:
                self._gather(u)
        try:
            yield
        finally:
            if self.stage == 3:
                for u in self.units:
                    self._free(u)

    @torch.no_grad()
    def full_parameters(self) -> dict:
        """Every parameter, whole, by name (stage 3 gathers them: collective)."""
        with self.gathered():
            return {name: p.detach().clone() for name, p in self.module.named_parameters()}
