"""Real hosts on one Linux machine, for tests and benchmarks across hosts.

A *host* is a process holding its own network, hostname, IPC, mount and pid namespaces:
its own network stack with one interface (eth0), its own /dev/shm (a private tmpfs),
/proc and /sys, an /etc/hosts that names every host, and its own share of this machine's
cores (what runs there is bound to them), as a real host has cores of its own. The hosts'
eth0 are veth pairs plugged into a bridge that lives in one more namespace, the *switch*,
so the machine's own network gets no new interface or address. mpiexec runs in the switch (as host
"launcher", which every host resolves: hydra's proxies connect back to it) and starts its
proxies on the hosts through a launcher-exec script that enters the named host, the way
``ssh HOST COMMAND`` would. Traffic between hosts goes over TCP; ranks of one host share
memory. Files are shared, as on a cluster with one network file system.

    with NamespaceHosts(2) as hosts:            # needs root and namespaces (usable())
        code, out = hosts.mpiexec([2, 2], [sys.executable, "script.py"], timeout=60)
        hosts.leftovers()                        # segments or processes left on any host

``link="1gbit"`` shapes every host's eth0 as a user's link is (a token bucket, tc's tbf:
``RATE[:BURST]``, burst 256kb by default): what leaves each host is held to the rate, so
each direction between two hosts is. Unshaped, veth moves bytes as fast as the cores copy
them, and the CPU, not the wire, bounds every transfer.

Teardown kills each holder by pid; a host's namespaces go with its last process, and the
veth pairs with them, so nothing is left: no namespace, interface, process or file.
"""
from __future__ import annotations

import argparse
import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SUBNET = "10.77.0"  # private to the switch's network namespace: it cannot clash
LAUNCHER = "launcher"
_RATE = re.compile(r"\d+(\.\d+)?([kmgt]?bit|[kmgt]?bps)")
_BURST = re.compile(r"\d+([kmg]?b?)")

# Run by each host's holder inside its new namespaces; it ends as the host's pid 1.
_HOST_SETUP = """
hostname "$1"
mount -t tmpfs -o size=1g,mode=1777 tmpfs /dev/shm
mount -t sysfs sysfs /sys
mount --bind "$2" /etc/hosts
echo ready
exec sleep infinity
"""

# hydra's ssh launcher runs: SCRIPT [ssh options] HOST COMMAND..., COMMAND quoted for a
# remote shell: enter HOST's namespaces and let a shell there unquote and run it.
_LAUNCH = """#!/bin/sh
while [ "${1#-}" != "$1" ]; do shift; done
host=$1; shift
case $host in
%s
*) echo "no namespace host named $host" >&2; exit 255;;
esac
exec nsenter -t "$pid" --net --uts --ipc --mount --pid --wd="$PWD" -- \
    taskset -c "$cores" sh -c "exec $*"
"""


@functools.lru_cache(maxsize=1)
def usable() -> str | None:
    """None when namespace hosts can be made here, else why not (for a skip message)."""
    if sys.platform != "linux":
        return "namespace hosts need Linux"
    if os.geteuid() != 0:
        return "namespace hosts need root (network, mount and pid namespaces)"
    missing = [t for t in ("unshare", "nsenter", "ip") if not shutil.which(t)]
    if missing:
        return f"namespace hosts need {', '.join(missing)} (util-linux, iproute2)"
    probe = subprocess.run(["unshare", "--net", "--uts", "--ipc", "--mount", "--pid", "--fork",
                            "--mount-proc", "ip", "link", "add", "b0", "type", "bridge"],
                           capture_output=True, text=True)
    if probe.returncode:
        return f"cannot create namespaces here: {probe.stderr.strip() or probe.returncode}"
    return None


class NamespaceHosts:
    """``count`` namespace hosts named host1, host2, ... at 10.77.0.1, .2, ..., each eth0
    shaped to ``link`` (``RATE[:BURST]``, tc's units: "1gbit", "100mbit:64kb"; None:
    unshaped)."""

    def __init__(self, count: int, link: str | None = None):
        if count < 1:
            raise ValueError(f"NamespaceHosts({count}): need at least one host")
        self.shaping = shaping(link)
        self.link = link
        self.names = [f"host{i + 1}" for i in range(count)]
        self.cores = dict(zip(self.names, _share(sorted(os.sched_getaffinity(0)), count)))
        self.pids: dict[str, int] = {}  # host -> its pid 1, as this machine sees it
        self.switch: int | None = None  # the switch's holder (mpiexec runs there)
        self._holders: list[subprocess.Popen] = []
        self._dir: Path | None = None

    # ------------------------------------------------------------------ bring up, tear down
    def __enter__(self) -> "NamespaceHosts":
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        reason = usable()
        if reason:
            raise RuntimeError(reason)
        self._dir = Path(tempfile.mkdtemp(prefix="commlib-hosts-"))
        hosts_file = self._dir / "hosts"
        hosts_file.write_text("127.0.0.1 localhost\n" + "".join(
            f"{SUBNET}.{i + 1} {name}\n" for i, name in enumerate(self.names))
            + f"{SUBNET}.254 {LAUNCHER}\n")
        setup = self._dir / "setup.sh"
        setup.write_text(_HOST_SETUP)
        # the switch keeps the machine's pid namespace: mpiexec must not run inside a host's
        self.switch = self._hold(["--net", "--uts", "--mount"], setup, LAUNCHER, hosts_file)
        self._in(self.switch, "ip link add br0 type bridge && ip link set br0 up && "
                 f"ip addr add {SUBNET}.254/24 dev br0 && ip link set lo up")
        for i, name in enumerate(self.names):
            pid = self.pids[name] = self._hold(
                ["--net", "--uts", "--ipc", "--mount", "--pid", "--fork", "--mount-proc"],
                setup, name, hosts_file)
            self._in(self.switch, f"ip link add v{i + 1} type veth peer name eth0 netns {pid} "
                     f"&& ip link set v{i + 1} master br0 up")
            self._in(pid, f"ip addr add {SUBNET}.{i + 1}/24 dev eth0 && ip link set eth0 up "
                     "&& ip link set lo up")
            if self.shaping:
                self._in(pid, f"tc qdisc add dev eth0 root {self.shaping}")
        script = self._dir / "enter-host"
        script.write_text(_LAUNCH % "\n".join(f"{n}) pid={p} cores={self.cores[n]};;"
                                              for n, p in self.pids.items()))
        script.chmod(0o755)
        self.launch_script = str(script)

    def _hold(self, namespaces: list, setup: Path, name: str, hosts_file: Path) -> int:
        """Start a holder in new ``namespaces``; returns the pid of its sleeping process."""
        holder = subprocess.Popen(["unshare", *namespaces, "sh", str(setup), name,
                                   str(hosts_file)], stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, text=True, start_new_session=True)
        self._holders.append(holder)
        if holder.stdout.readline().strip() != "ready":
            raise RuntimeError(f"namespace host {name} did not come up (exit {holder.wait()})")
        if "--fork" not in namespaces:
            return holder.pid
        children = Path(f"/proc/{holder.pid}/task/{holder.pid}/children").read_text().split()
        return int(children[0])

    @staticmethod
    def _in(pid: int, command: str) -> None:
        subprocess.run(["nsenter", "-t", str(pid), "--net", "--", "sh", "-c", command],
                       check=True, capture_output=True, text=True)

    def close(self) -> None:
        """Kill each host's pid 1 (its processes go with it), which its holder reaps before
        exiting; kill the switch; wait for every holder."""
        for pid in [*self.pids.values(), self.switch]:
            if pid:
                _kill(pid)
        for holder in self._holders:
            try:
                holder.wait(timeout=10)
            except subprocess.TimeoutExpired:  # (never seen) its child would outlive it
                _kill(holder.pid)
                holder.wait()
            holder.stdout.close()
        self._holders.clear()
        self.pids.clear()
        self.switch = None
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    # ------------------------------------------------------------------ running
    def command(self, per_host: list[int], argv: list[str], mpiexec: str | None = None,
                options: tuple = ()) -> list[str]:
        """The mpiexec command line (to run in the switch: see popen) that starts
        ``per_host[i]`` ranks of ``argv`` on host i+1."""
        if len(per_host) > len(self.names) or min(per_host, default=0) < 1:
            raise ValueError(f"ranks per host {per_host}: need 1 to {len(self.names)} hosts "
                             "with at least one rank each")
        hosts = ",".join(f"{name}:{k}" for name, k in zip(self.names, per_host))
        return [mpiexec or default_mpiexec(), "-launcher", "ssh", "-launcher-exec",
                self.launch_script, "-hosts", hosts, "-n", str(sum(per_host)), *options, *argv]

    def popen(self, argv: list[str], cwd=None, **kwargs) -> subprocess.Popen:
        """Start ``argv`` in the switch namespace (as host "launcher"), in its own session."""
        return subprocess.Popen(["nsenter", "-t", str(self.switch), "--net", "--uts",
                                 "--mount", f"--wd={cwd or os.getcwd()}", "--", *argv],
                                start_new_session=True, **kwargs)

    def popen_on(self, host: str, argv: list[str], cwd=None, **kwargs) -> subprocess.Popen:
        """Start ``argv`` on ``host`` (in all its namespaces), in its own session."""
        return subprocess.Popen(["nsenter", "-t", str(self.pids[host]), "--net", "--uts",
                                 "--ipc", "--mount", "--pid", f"--wd={cwd or os.getcwd()}",
                                 "--", "taskset", "-c", self.cores[host], *argv],
                                start_new_session=True, **kwargs)

    def mpiexec(self, per_host: list[int], argv: list[str], timeout: float = 300,
                env: dict | None = None, options: tuple = (), cwd=None) -> tuple[int | None, str]:
        """Run ``argv`` on ``per_host`` ranks per host; (exit code or None on timeout,
        output). On timeout everything the job started is killed, on every host."""
        proc = self.popen(self.command(per_host, argv, options=options), env=env, cwd=cwd,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
            return proc.returncode, out
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            self.kill_strays()
            return None, f"TIMEOUT after {timeout}s\n{out}"

    def cut(self, host: str, off: bool = True) -> None:
        """Unplug ``host`` from the switch (``off=False``: plug it back): its processes live
        on, its connections stay open, and nothing it sends arrives, nor anything sent to it."""
        i = self.names.index(host) + 1
        self._in(self.switch, f"ip link set v{i} {'down' if off else 'up'}")

    # ------------------------------------------------------------------ looking inside hosts
    def shm_files(self) -> dict[str, list[str]]:
        """Each host's /dev/shm entries."""
        return {name: sorted(os.listdir(f"/proc/{pid}/root/dev/shm"))
                for name, pid in self.pids.items()}

    def processes(self) -> dict[str, list[str]]:
        """Each host's processes but its pid 1: pid and command line."""
        found = {}
        for name, pid in self.pids.items():
            proc = Path(f"/proc/{pid}/root/proc")
            found[name] = [f"{p.name} {_cmdline(p)}" for p in proc.iterdir()
                           if p.name.isdigit() and p.name != "1" and _cmdline(p)]
        return found

    def leftovers(self, grace: float = 2.0) -> dict[str, list[str]]:
        """What any host still holds after a job: /dev/shm files and processes, given
        ``grace`` seconds to go (ranks told to abort are still exiting when mpiexec ends)."""
        deadline = time.monotonic() + grace
        while True:
            shm, procs = self.shm_files(), self.processes()
            left = {h: shm[h] + procs[h] for h in self.names if shm[h] or procs[h]}
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.05)

    def kill_strays(self) -> None:
        """SIGKILL every process on every host but its pid 1, and clear its /dev/shm."""
        for name, pid in self.pids.items():
            subprocess.run(["nsenter", "-t", str(pid), "--pid", "--mount", "--", "sh", "-c",
                            "kill -9 -1; rm -rf /dev/shm/*"], capture_output=True)


# ------------------------------------------------------------------ a command across hosts
def add_host_arguments(p) -> argparse.ArgumentParser:
    """--hosts N, --per-host K, --link RATE: what across_hosts takes (the benchmarks',
    commlib-train's)."""
    p.add_argument("--hosts", type=int, default=0, metavar="N",
                   help="run across N namespace hosts on this machine (root; not under mpiexec)")
    p.add_argument("--per-host", type=int, default=1, metavar="K", help="ranks per host "
                   "with --hosts (default 1)")
    p.add_argument("--link", metavar="RATE[:BURST]", help="with --hosts: every host's eth0 "
                   "shaped to RATE (tc's tbf: 1gbit, 100mbit:64kb; default unshaped)")
    return p


def across_hosts(args, argv: list, module: str = "commlib_bench") -> int:
    """Run ``python -m module`` with ``argv`` less --hosts/--per-host/--link on
    ``args.per_host`` ranks on each of ``args.hosts`` namespace hosts (brought up and torn
    down here), their links shaped to ``args.link``; returns mpiexec's exit code."""
    if usable():
        raise SystemExit(f"{module} --hosts: {usable()}")
    if args.hosts < 1 or args.per_host < 1:
        raise SystemExit(f"{module}: --hosts and --per-host take positive counts")
    try:
        shaping(args.link)
    except ValueError as e:
        raise SystemExit(f"{module} --link: {e}") from None
    _, rest = add_host_arguments(argparse.ArgumentParser(add_help=False)).parse_known_args(argv)
    with NamespaceHosts(args.hosts, link=args.link) as h:
        print(f"{module}: {args.hosts} namespace hosts x {args.per_host} ranks"
              f"{f', links {args.link}' if args.link else ''}: {' '.join(rest)}", flush=True)
        job = h.popen(h.command([args.per_host] * args.hosts,
                                [sys.executable, "-m", module, *rest]), cwd=os.getcwd())
        return job.wait()


def shaping(link: str | None) -> str | None:
    """tc's qdisc for ``link`` (``RATE[:BURST]``), or None where it is None or empty."""
    if not link:
        return None
    rate, _, burst = link.lower().partition(":")
    burst = burst or "256kb"
    if not _RATE.fullmatch(rate) or not _BURST.fullmatch(burst):
        raise ValueError(f"link {link!r}: expected RATE[:BURST] in tc's units, e.g. 1gbit, "
                         "100mbit:64kb (rates in bit, kbit, mbit, gbit or bps; bursts in bytes, "
                         "kb, mb)")
    # the queue holds 50 ms at the rate: enough for TCP to fill the link, no more
    return f"tbf rate {rate} burst {burst} latency 50ms"


def default_mpiexec() -> str:
    """MPICH's mpiexec next to this interpreter (the mpich wheel puts it there): its hydra
    launcher takes -launcher-exec."""
    here = Path(sys.prefix) / "bin" / "mpiexec"
    return str(here) if here.exists() else (shutil.which("mpiexec") or "mpiexec")


def _share(cores: list, hosts: int) -> list[str]:
    """Each host's cores (taskset's list form): contiguous equal parts, or with more hosts
    than cores, one core each, round robin."""
    if hosts > len(cores):
        return [str(cores[i % len(cores)]) for i in range(hosts)]
    per, extra = divmod(len(cores), hosts)
    parts, start = [], 0
    for i in range(hosts):
        end = start + per + (i < extra)
        parts.append(",".join(map(str, cores[start:end])))
        start = end
    return parts


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:  # gone meanwhile
        return ""


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
