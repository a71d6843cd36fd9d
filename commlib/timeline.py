"""Merging the ranks' trace files (commlib/tracer.py writes them) into one Chrome trace, a
track per rank and a row per communicator, with whom each rank waited for; and its
swimlane picture. Data in, data out: nothing here runs a call.
"""
from __future__ import annotations

import json
from pathlib import Path


def load(where, complete: bool = True) -> list[dict]:
    """Every rank's trace file in ``where`` (a directory, or several: each host's, copied
    from hosts that share no file system), by rank (with ``complete``, one per rank of the
    world, or ValueError)."""
    wheres = [where] if isinstance(where, (str, Path)) else list(where)
    files = [f for w in wheres for f in sorted(Path(w).glob("rank-*.json"))]
    if not files:
        raise FileNotFoundError(f"no rank-*.json in {', '.join(map(str, wheres))}; run with "
                                f"COMMLIB_TRACE=DIR")
    ranks = {}
    for f in files:
        content = json.loads(f.read_text())
        if content["rank"] in ranks:
            raise ValueError(f"rank {content['rank']} has two trace files ({f} and another); "
                             "merge the directories of one run only")
        ranks[content["rank"]] = content
    sizes = {r["size"] for r in ranks.values()}
    if complete and (len(sizes) != 1 or len(ranks) != sizes.pop()):
        raise ValueError(f"{', '.join(map(str, wheres))}: {len(ranks)} rank files of a world "
                         f"of {sorted({r['size'] for r in ranks.values()})} ranks; a rank did "
                         "not write its trace (did it exit early? on another host: copy its "
                         "directory here and name both)")
    return [ranks[k] for k in sorted(ranks)]


def cropped(trace: dict, first_ms: float, last_ms: float) -> dict:
    """``trace`` with only the events that overlap [first_ms, last_ms], cut to it and
    shifted to start at first_ms."""
    kept = []
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            end = min(e["ts"] + e["dur"], last_ms * 1e3)
            start = max(e["ts"], first_ms * 1e3)
            if end < start:
                continue
            e = {**e, "ts": start - first_ms * 1e3, "dur": end - start}
        kept.append(e)
    return {**trace, "traceEvents": kept}


def chrome_trace(ranks: list[dict]) -> dict:
    """The Chrome trace (JSON object format) of ``ranks``: a process per rank, a thread per
    communicator, a complete event per call from its start to its end (its queueing before
    the start in the arguments), times in microseconds on rank 0's clock from the first
    call."""
    calls = [(r, c, call) for r in ranks for c in r["communicators"] for call in c["calls"]
             if call["started"] is not None]
    origin = min([call["issued"] - r["offset"] for r, _, call in calls] +
                 [begun - r["offset"] for r in ranks for _, begun, _ in r["regions"]],
                 default=0.0)
    events = []
    for r in ranks:
        events.append({"ph": "M", "name": "process_name", "pid": r["rank"],
                       "args": {"name": f"rank {r['rank']} ({r['host']})"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": r["rank"],
                       "args": {"sort_index": r["rank"]}})
        for tid, c in enumerate(r["communicators"]):
            events.append({"ph": "M", "name": "thread_name", "pid": r["rank"], "tid": tid,
                           "args": {"name": c["name"]}})
        below = len(r["communicators"])  # the regions' row, under the communicators'
        events.append({"ph": "M", "name": "thread_name", "pid": r["rank"], "tid": below,
                       "args": {"name": "regions"}})
        for name, begun, ended in r["regions"]:
            events.append({"ph": "X", "name": name, "cat": "region", "pid": r["rank"],
                           "tid": below, "ts": (begun - r["offset"] - origin) * 1e6,
                           "dur": (ended - begun) * 1e6, "args": {}})
    starts = _starts(calls)
    for r, c, call in calls:
        start = call["started"] - r["offset"] - origin
        end = (call["finished"] if call["finished"] is not None else call["started"]) - \
            r["offset"] - origin
        events.append({
            "ph": "X", "name": call["collective"], "cat": call["algorithm"] or "",
            "pid": r["rank"], "tid": r["communicators"].index(c),
            "ts": start * 1e6, "dur": max(end - start, 0.0) * 1e6,
            "args": {"seq": call["seq"], "algorithm": call["algorithm"],
                     "bytes": call["bytes"], "count": call["count"], "dtype": call["dtype"],
                     "op": call["op"], "root": call["root"], "state": call["state"],
                     "queued_us": (call["started"] - call["issued"]) * 1e6,
                     **_waits(r, c, call, starts),
                     **({"error": call["error"]} if call["error"] else {})}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"source": "commlib.trace", "ranks": len(ranks)}}


def _key(c: dict, call: dict) -> tuple:
    """A call as every member of its communicator names it (recorder.identify)."""
    return tuple(c.get("members", ())), c.get("ordinal", 0), call["seq"]


def _starts(calls: list) -> dict:
    """When each rank started each call, on rank 0's clock: {call's key: {rank: start}}."""
    starts: dict = {}
    for r, c, call in calls:
        starts.setdefault(_key(c, call), {})[r["rank"]] = call["started"] - r["offset"]
    return starts


def _waits(r: dict, c: dict, call: dict, starts: dict) -> dict:
    """Whom this rank waited for in ``call`` and how long: a collective cannot end here
    before every member has started it, so a peer that started later held it up by the
    difference (the last of them: waited_for, waited_us; the latest 8: late_peers). Empty
    where not every member's trace is at hand."""
    seen = starts[_key(c, call)]
    if not c.get("members") or set(seen) != set(c["members"]):
        return {}
    mine = seen[r["rank"]]
    late = sorted(((t - mine, peer) for peer, t in seen.items() if t > mine), reverse=True)
    if not late:
        return {"waited_us": 0.0}
    return {"waited_us": late[0][0] * 1e6, "waited_for": late[0][1],
            "late_peers": {str(peer): lag * 1e6 for lag, peer in late[:8]}}


def swimlanes(ranks: list[dict], trace: dict, path: str) -> None:
    """A PNG of ``trace`` (``ranks``' Chrome trace): a lane per rank, a bar per call
    coloured by collective, and under it the program's regions (forward, backward, ...) in
    lighter colours."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    bars = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    calls = sorted({e["name"] for e in bars if e["cat"] != "region"})
    regions = sorted({e["name"] for e in bars if e["cat"] == "region"})
    colours = {**{n: plt.get_cmap("tab10")(i % 10) for i, n in enumerate(calls)},
               **{n: plt.get_cmap("Pastel2")(i % 8) for i, n in enumerate(regions)}}
    fig, ax = plt.subplots(figsize=(10, 0.6 + 0.6 * len(ranks)))
    for e in bars:
        lane = (e["pid"] + 0.1, 0.3) if e["cat"] == "region" else (e["pid"] - 0.4, 0.45)
        ax.broken_barh([(e["ts"] / 1e3, max(e["dur"] / 1e3, 1e-3))], lane,
                       color=colours[e["name"]])
    ax.set_yticks([r["rank"] for r in ranks], [f"rank {r['rank']}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("ms (rank 0's clock)")
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=colours[n]) for n in calls + regions],
              labels=calls + regions, loc="upper left", bbox_to_anchor=(1.0, 1.0),
              fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
