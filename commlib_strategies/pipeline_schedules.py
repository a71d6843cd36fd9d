"""Pipeline schedules as data, and a simulator that runs them in one process.

Vocabulary:

    stage       a rank of the pipeline: its coordinate along the mesh's "pp" dimension,
                0 .. p-1 (p = ``stages``)
    piece       one of p * v contiguous slices of the model, numbered in model order
                (v = ``virtual``, the pieces each stage holds)
    chunk       the pieces of a stage: chunk c of stage s is piece c * p + s, so with v > 1
                (interleaved schedules) a microbatch visits every stage v times
    microbatch  one of m equal slices of the batch; gradients accumulate over all m

An ``Action`` is one thing a stage does to one (microbatch, chunk):

    F        forward
    B        full backward: the gradients of the piece's input and of its weights
    I        backward to the input only (zero-bubble's "B"): what the previous piece waits for
    W        the weights' gradients, any time after I (zero-bubble fills bubbles with it)
    SEND_F   send the forward output to the stage holding the next piece
    RECV_F   receive the forward input from the stage holding the previous piece
    SEND_B   send the gradient of the piece's input to the stage holding the previous piece
    RECV_B   receive the gradient of the piece's output from the stage holding the next piece

A *schedule* is, for each stage, the ordered list of its actions. Sends are asynchronous
(they never wait); a receive waits until its message has been sent. A message is named by
its direction, piece and microbatch, so a receive matches its send whatever the order.
``simulate`` runs every stage's list with per-kind costs, proves the schedule complete and
free of deadlock, and measures its makespan and bubble (the fraction of the stages' time
spent idle).
"""
from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, Mapping, Union

COMPUTE = ("F", "B", "I", "W")
COMMUNICATION = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
KINDS = COMPUTE + COMMUNICATION
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")

# Costs in units of one piece's forward. A full backward costs about twice a forward; a
# zero-bubble split gives each half about one forward.
DEFAULT_COSTS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0,
                 "SEND_F": 0.0, "RECV_F": 0.0, "SEND_B": 0.0, "RECV_B": 0.0}


@dataclass(frozen=True)
class Action:
    stage: int
    kind: str
    microbatch: int
    chunk: int = 0

    def __str__(self):
        chunk = f".{self.chunk}" if self.chunk else ""
        return f"{self.kind}{self.microbatch}{chunk}@{self.stage}"


class DeadlockError(ValueError):
    """The schedule cannot finish: every unfinished stage waits for something that never comes."""


# ------------------------------------------------------------------------------ schedules

def schedule(name: str, stages: int, microbatches: int, virtual: int = 1) -> list[list[Action]]:
    """Every stage's ordered actions (compute and communication) for schedule ``name``:

    gpipe             all forwards, then all full backwards
    1f1b              p-s-1 warm-up forwards on stage s, then one forward and one backward in
                      turn, then the remaining backwards: at most p-s microbatches in flight
    interleaved-1f1b  1f1b over v > 1 chunks per stage (Megatron's order: p microbatches
                      through chunk 0, then the same p through chunk 1, ...); m must be a
                      multiple of p. Shrinks the bubble about v times
    zb-h1             1f1b with each backward split into I and W (the zero-bubble paper's
                      ZB-H1): the gradients run back through I alone and the deferred W's
                      fill the bubbles. Every stage holds at most p microbatches, 1f1b's
                      peak; with F = I = W a step takes 3m + p - 1 units against 1f1b's
                      3(m + p - 1)
    """
    _check_positive(stages=stages, microbatches=microbatches, virtual=virtual)
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of "
                         f"{', '.join(SCHEDULES)}")
    if name == "interleaved-1f1b":
        if virtual < 2:
            raise ValueError("interleaved-1f1b needs virtual >= 2 chunks per stage "
                             "(with one chunk it is 1f1b)")
        if microbatches % stages:
            raise ValueError(f"interleaved-1f1b needs microbatches divisible by stages: "
                             f"{microbatches} microbatches over {stages} stages; use a "
                             f"multiple of {stages}")
    elif virtual != 1:
        raise ValueError(f"{name} runs one chunk per stage, got virtual={virtual}; "
                         f"use interleaved-1f1b for virtual stages")
    build = {"gpipe": _gpipe, "1f1b": _one_f_one_b, "interleaved-1f1b": _interleaved,
             "zb-h1": _zb_h1}[name]
    compute = [build(s, stages, microbatches, virtual) for s in range(stages)]
    return [_with_communication(order, stages, virtual) for order in compute]


def _gpipe(s, p, m, v):
    return ([Action(s, "F", i) for i in range(m)] + [Action(s, "B", i) for i in range(m)])


def _one_f_one_b(s, p, m, v):
    warmup = min(p - s - 1, m)
    order = [Action(s, "F", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [Action(s, "F", warmup + i), Action(s, "B", i)]
    return order + [Action(s, "B", i) for i in range(m - warmup, m)]


def _interleaved(s, p, m, v):
    def unit(k, backward):  # the k-th (microbatch, chunk) a stage works on, in either pass
        chunk = (k // p) % v
        return (k // (p * v)) * p + k % p, (v - 1 - chunk if backward else chunk)

    total = m * v
    # forwards before the first backward: the earlier chunks' (v - 1) * p, and 2 per
    # stage between this one and the last (the trip there and back)
    warmup = min((p - s - 1) * 2 + (v - 1) * p, total)
    order = [Action(s, "F", *unit(k, False)) for k in range(warmup)]
    for k in range(total - warmup):
        order += [Action(s, "F", *unit(warmup + k, False)), Action(s, "B", *unit(k, True))]
    return order + [Action(s, "B", *unit(k, True)) for k in range(total - warmup, total)]


def _zb_h1(s, p, m, v):
    # 1f1b's order with B split in I then W, where stage s lets up to s W's wait: with its
    # p - s - 1 warm-up forwards it then holds at most p microbatches, like 1f1b's stage 0.
    # Later stages thus skip W's early on and pass forwards and gradients on sooner; their
    # held W's run at the end, while the last gradients travel back through the earlier
    # stages.
    warmup = min(p - s - 1, m)
    order = [Action(s, "F", i) for i in range(warmup)]
    weights = 0  # W's issued so far (in microbatch order)
    for i in range(m - warmup):
        order += [Action(s, "F", warmup + i), Action(s, "I", i)]
        held = i + 1 - weights  # microbatches whose I has run and W has not
        if held > s:
            order.append(Action(s, "W", weights))
            weights += 1
    for i in range(m - warmup, m):
        order.append(Action(s, "I", i))
        order.append(Action(s, "W", weights))
        weights += 1
    return order + [Action(s, "W", i) for i in range(weights, m)]


def _with_communication(order: list[Action], p: int, v: int) -> list[Action]:
    """Insert each receive just before the compute that needs it and each send just after
    the compute that produces it (the runtime posts receives earlier: this is where it waits)."""
    out, last = [], p * v - 1
    for a in order:
        piece = a.chunk * p + a.stage
        if a.kind == "F" and piece > 0 and p > 1:
            out.append(Action(a.stage, "RECV_F", a.microbatch, a.chunk))
        if a.kind in ("B", "I") and piece < last and p > 1:
            out.append(Action(a.stage, "RECV_B", a.microbatch, a.chunk))
        out.append(a)
        if a.kind == "F" and piece < last and p > 1:
            out.append(Action(a.stage, "SEND_F", a.microbatch, a.chunk))
        if a.kind in ("B", "I") and piece > 0 and p > 1:
            out.append(Action(a.stage, "SEND_B", a.microbatch, a.chunk))
    return out


def _check_positive(**values):
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"pipeline: {name} must be a positive int, got {value!r}")


# ------------------------------------------------------------------------------ simulator

Costs = Union[Mapping[str, float], Callable[[Action], float]]


@dataclass
class Simulation:
    """What ``simulate`` measured. Times are in the costs' unit."""
    makespan: float
    busy: list            # per stage: time spent computing (F, B, I, W)
    idle: list            # per stage: 1 - busy / makespan
    peak_in_flight: list  # per stage: most (microbatch, chunk)s forwarded whose weight
                          # gradients are not yet done (their activations are held)
    timeline: list = field(repr=False)  # per stage: [(action, start, end)] in order

    @property
    def bubble(self) -> float:
        """The fraction of all stages' time spent idle."""
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan) if self.makespan else 0.0

    def chart(self, unit: float = 1.0) -> str:
        """One line per stage, one cell per ``unit`` of time: " F3" is time spent on the
        forward of microbatch 3 (" F3b": of its chunk 1, when there are several), "."
        idle; communication is not drawn."""
        events = [e for stage in self.timeline for e in stage if e[0].kind in COMPUTE]
        chunks = 1 + max((a.chunk for a, _, _ in events), default=0)

        def label(a):
            return f"{a.kind}{a.microbatch}" + ("abcdefghij"[a.chunk % 10] if chunks > 1 else "")
        width = 1 + max((len(label(a)) for a, _, _ in events), default=2)
        lines = []
        for s, stage in enumerate(self.timeline):
            row = [".".rjust(width)] * round(self.makespan / unit)
            for a, start, end in stage:
                if a.kind in COMPUTE:
                    for c in range(round(start / unit), round(end / unit)):
                        row[c] = label(a).rjust(width)
            lines.append(f"stage {s}:" + "".join(row))
        return "\n".join(lines)


def simulate(stages_actions: list[list[Action]], costs: Costs | None = None,
             latency: float = 0.0) -> Simulation:
    """Run every stage's actions in order, each taking ``costs[kind]`` (or ``costs(action)``),
    a message arriving ``latency`` after its send. Raises ``ValueError`` on a malformed or
    incomplete schedule and ``DeadlockError`` (naming each stuck action and what it waits
    for) on one that cannot finish."""
    layout = _check_schedule(stages_actions)
    cost = _cost_function(costs)
    p = len(stages_actions)
    done: dict = {}  # (stage, kind, microbatch, chunk) -> end time
    clock = [0.0] * p
    position = [0] * p
    timeline = [[] for _ in range(p)]
    # each stage runs in order as far as it can, then sleeps until one of the actions it
    # waits for is done; the times depend only on each action's predecessors, never on
    # the order in which stages are tried
    awake, sleeping = deque(range(p)), {}  # sleeping: awaited action's key -> stages
    while awake:
        s = awake.popleft()
        actions = stages_actions[s]
        while position[s] < len(actions):
            a = actions[position[s]]
            ready, missing = _ready(a, done, layout, latency)
            if ready is None:
                for m in missing:
                    sleeping.setdefault(_key(m), []).append(s)
                break
            start = max(clock[s], ready)
            clock[s] = start + cost(a)
            done[_key(a)] = clock[s]
            timeline[s].append((a, start, clock[s]))
            position[s] += 1
            awake.extend(sleeping.pop(_key(a), ()))
    stuck = [(actions[position[s]]) for s, actions in enumerate(stages_actions)
             if position[s] < len(actions)]
    if stuck:
        waits = "; ".join(f"stage {a.stage} at {a} waits for "
                          + " or ".join(map(str, _ready(a, done, layout, latency)[1]))
                          for a in stuck)
        raise DeadlockError(f"pipeline schedule deadlocks: {waits}")
    makespan = max(clock, default=0.0)
    busy = [sum(end - start for a, start, end in events if a.kind in COMPUTE)
            for events in timeline]
    idle = [1.0 - b / makespan if makespan else 0.0 for b in busy]
    return Simulation(makespan, busy, idle, [_peak_in_flight(events) for events in timeline],
                      timeline)


def _key(a: Action) -> tuple:
    return a.stage, a.kind, a.microbatch, a.chunk


@dataclass(frozen=True)
class _Layout:
    stages: int
    microbatches: int
    virtual: int

    @property
    def pieces(self):
        return self.stages * self.virtual

    def owner(self, piece):  # (stage, chunk)
        return piece % self.stages, piece // self.stages


def _ready(a: Action, done: dict, layout: _Layout, latency: float):
    """(time at which ``a`` may start, None) once its inputs exist, else (None, the actions
    it waits for: one of them)."""
    s, mb, c = a.stage, a.microbatch, a.chunk
    piece = c * layout.stages + s
    needs = []  # (stage, kind or kinds, chunk, delay)
    if a.kind == "F" and piece > 0:
        prev_stage, prev_chunk = layout.owner(piece - 1)
        needs.append((s, "F", prev_chunk, 0.0) if prev_stage == s else (s, "RECV_F", c, 0.0))
    elif a.kind == "SEND_F":
        needs.append((s, "F", c, 0.0))
    elif a.kind == "RECV_F":
        prev_stage, prev_chunk = layout.owner(piece - 1)
        needs.append((prev_stage, "SEND_F", prev_chunk, latency))
    elif a.kind in ("B", "I"):
        needs.append((s, "F", c, 0.0))
        if piece < layout.pieces - 1:
            next_stage, next_chunk = layout.owner(piece + 1)
            needs.append((s, ("B", "I"), next_chunk, 0.0) if next_stage == s
                         else (s, "RECV_B", c, 0.0))
    elif a.kind == "W":
        needs.append((s, "I", c, 0.0))
    elif a.kind == "SEND_B":
        needs.append((s, ("B", "I"), c, 0.0))
    elif a.kind == "RECV_B":
        next_stage, next_chunk = layout.owner(piece + 1)
        needs.append((next_stage, "SEND_B", next_chunk, latency))
    ready = 0.0
    for stage, kinds, chunk, delay in needs:
        kinds = (kinds,) if isinstance(kinds, str) else kinds
        ends = [done[k] for k in ((stage, kind, mb, chunk) for kind in kinds) if k in done]
        if not ends:
            return None, [Action(stage, kind, mb, chunk) for kind in kinds]
        ready = max(ready, ends[0] + delay)
    return ready, None


def _check_schedule(stages_actions) -> _Layout:
    """The schedule's layout, after checking that every stage does exactly the actions a
    pipeline step needs: per (microbatch, chunk) one F and one B (or one I and one W), each
    send and receive its neighbours need, nothing twice."""
    if not isinstance(stages_actions, list) or not stages_actions:
        raise ValueError("a schedule is a non-empty list (one per stage) of lists of Actions")
    p = len(stages_actions)
    everything = [a for actions in stages_actions for a in actions]
    for s, actions in enumerate(stages_actions):
        for a in actions:
            if not isinstance(a, Action) or a.kind not in KINDS:
                raise ValueError(f"stage {s}: {a!r} is not an Action of a kind in {KINDS}")
            if a.stage != s:
                raise ValueError(f"stage {s}'s list holds {a}, an action of stage {a.stage}")
            if a.microbatch < 0 or a.chunk < 0:
                raise ValueError(f"stage {s}: {a} has a negative microbatch or chunk")
    if not everything:
        raise ValueError("the schedule has no actions")
    layout = _Layout(p, 1 + max(a.microbatch for a in everything),
                     1 + max(a.chunk for a in everything))
    for s, actions in enumerate(stages_actions):
        want = _expected(s, layout, split={(a.microbatch, a.chunk) for a in actions
                                           if a.kind in ("I", "W")})
        have = Counter((a.kind, a.microbatch, a.chunk) for a in actions)
        missing, extra = want - have, have - want
        if missing or extra:
            def show(counter):
                return ", ".join(str(Action(s, k, mb, c)) for k, mb, c in sorted(counter)[:6])
            problems = ([f"missing {show(missing)}"] if missing else []) + \
                       ([f"unexpected or repeated {show(extra)}"] if extra else [])
            raise ValueError(f"stage {s} of a {p}-stage schedule with {layout.microbatches} "
                             f"microbatches and {layout.virtual} chunks: {'; '.join(problems)}")
    return layout


def _expected(s, layout, split) -> Counter:
    want = Counter()
    p, last = layout.stages, layout.pieces - 1
    for c in range(layout.virtual):
        piece = c * p + s
        for mb in range(layout.microbatches):
            want.update([("F", mb, c)])
            want.update([("I", mb, c), ("W", mb, c)] if (mb, c) in split else [("B", mb, c)])
            if p > 1 and piece > 0:
                want.update([("RECV_F", mb, c), ("SEND_B", mb, c)])
            if p > 1 and piece < last:
                want.update([("SEND_F", mb, c), ("RECV_B", mb, c)])
    return want


def _cost_function(costs: Costs | None) -> Callable[[Action], float]:
    if callable(costs):
        return costs
    table = dict(DEFAULT_COSTS)
    for kind, value in (costs or {}).items():
        if kind not in KINDS:
            raise ValueError(f"cost for unknown action kind {kind!r}; kinds: {', '.join(KINDS)}")
        if value < 0:
            raise ValueError(f"cost of {kind} must be >= 0, got {value}")
        table[kind] = float(value)
    return lambda a: table[a.kind]


def _peak_in_flight(events) -> int:
    held, peak = set(), 0
    for a, _, _ in events:
        if a.kind == "F":
            held.add((a.microbatch, a.chunk))
            peak = max(peak, len(held))
        elif a.kind in ("B", "W"):
            held.discard((a.microbatch, a.chunk))
    return peak
