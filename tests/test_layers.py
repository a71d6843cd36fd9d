"""The layers hold: strategies -> commlib's public API -> dispatch -> select -> algorithms
-> transports -> csrc. Checked on the source, and on what importing commlib loads; plus what
the wheel declares to run."""
import ast
import re
import subprocess
import sys
import tomllib
from importlib import import_module
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PUBLIC = {"commlib", "commlib.torch", "commlib.torch.backend", "commlib.torch.hooks",
          "commlib.trace", "commlib.testing", "commlib.compressed", "commlib.low_rank",
          "commlib.torch.compression", "commlib.settings", "commlib.cuda",
          "commlib.collectives"}


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found.add(node.module)
    return {m for m in found if m == "commlib" or m.startswith("commlib.")}


def _modules_imported(path: Path) -> set[str]:
    """Every commlib module ``path`` imports, relative imports resolved, names imported from
    a package included (they may be its modules), inside functions too."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(p for p in (base, node.module) if p)
            found |= {module} | {f"{module}.{a.name}" for a in node.names}
    return {m for m in found if m.startswith("commlib.")}


def test_algorithms_see_the_transport_interface_and_the_dispatcher_chooses():
    """Transports import no algorithm and no choice; algorithms import only the transport
    interface and the facts every transport shares (rows, MPI's names), not the choice:
    one-way, so a transport or an algorithm is added without touching the other layer."""
    above = ("commlib.algorithms", "commlib.select", "commlib.dispatch", "commlib.tuning",
             "commlib.comm")
    shared = {"commlib.transports", "commlib.transports.base", "commlib.transports.rows",
              "commlib.transports.mpi_types"}
    wrong = {}
    for path in (ROOT / "commlib" / "transports").glob("*.py"):
        bad = {m for m in _modules_imported(path) if m.startswith(above)}
        if bad:
            wrong[path.name] = sorted(bad)
    for path in (ROOT / "commlib" / "algorithms").glob("*.py"):
        bad = {m for m in _modules_imported(path) if m.startswith(above[1:]) or
               (m.startswith("commlib.transports") and m not in shared
                and m.rsplit(".", 1)[0] not in shared - {"commlib.transports"})}
        if bad:
            wrong[f"algorithms/{path.name}"] = sorted(bad)
    assert not wrong, wrong


def _import_graph() -> dict[str, set[str]]:
    """{commlib module: the commlib modules it imports, anywhere in it}. ``from P import n``
    is an edge to P.n where that is a module (or the compiled _C, _cuda), else to P: a
    package's __init__ runs first either way, but only the latter needs what it defines."""
    paths = {}
    for path in (ROOT / "commlib").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    modules = set(paths) | {"commlib._C", "commlib._cuda"}
    graph = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = package.rsplit(".", node.level - 1)[0] if node.level else ""
                module = ".".join(p for p in (base, node.module) if p)
                subs = {f"{module}.{a.name}" for a in node.names} & modules
                edges |= subs | ({module} if len(subs) < len(node.names) else set())
        graph[name] = (edges & modules) - {name}
    return graph


def test_no_import_circles_between_commlib_modules():
    """The layers go one way: no module reaches itself through the modules it imports, at
    the top or inside a function (a lower one learns of a higher one by a hook it is given:
    user_ops.on_define, FlightRecorder.on_create, transports' registry)."""
    graph = _import_graph()

    def reaches(start: str) -> list[str] | None:
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in graph.get(node, ()):
                if nxt == start:
                    return path + [start]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
        return None

    circles = [" -> ".join(c) for c in map(reaches, sorted(graph)) if c]
    assert not circles, "\n".join(circles)


def test_strategies_use_only_the_public_api():
    used = {m: sorted(p.name for p in (ROOT / "commlib_strategies").glob("*.py")
                      if m in _imports(p))
            for p in (ROOT / "commlib_strategies").glob("*.py") for m in _imports(p)}
    assert set(used) <= PUBLIC, {m: files for m, files in used.items() if m not in PUBLIC}


def _is_module(name: str) -> bool:
    """Whether ``name`` (dotted) is a module of commlib: a file, a package or compiled."""
    if not name.startswith("commlib."):
        return False
    path = ROOT.joinpath(*name.split("."))
    return (path.with_suffix(".py").exists() or (path / "__init__.py").exists()
            or any(path.parent.glob(f"{path.name}.*.so")))


def test_the_benchmarks_use_the_public_api_but_in_one_module():
    """commlib_bench reads commlib beyond its public API only in internals.py, which says
    why; the rest imports public modules (``from commlib import x``: x public too)."""
    wrong = {}
    for path in (ROOT / "commlib_bench").glob("*.py"):
        if path.name == "internals.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [f"{node.module}.{a.name}" if node.module == "commlib" else node.module
                         for a in node.names]
            bad = [n for n in names if _is_module(n) and n not in PUBLIC]
            if bad:
                wrong.setdefault(path.name, set()).update(bad)
    assert not wrong, wrong


def test_no_module_reads_a_communicators_private_fields():
    """Only comm.py touches a Communicator's own fields (its transport and dispatcher)."""
    offenders = []
    for path in (ROOT / "commlib").rglob("*.py"):
        if path.name == "comm.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"(?<!\w)comm\._\w+|\.comm\._\w+", line):
                offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_importing_commlib_loads_no_cuda():
    out = subprocess.run([sys.executable, "-c", "import sys, commlib, commlib.torch.backend; "
                          "print(sorted(m for m in sys.modules if 'cuda' in m and "
                          "m.startswith('commlib')))"],
                         capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert out.strip() == "[]", out


def test_the_wheel_declares_what_users_run():
    """pyproject's console scripts name functions that exist, in packages the wheel holds."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    scripts = project["project"]["scripts"]
    assert set(scripts) == {"commlib-bench", "commlib-train"}
    packages = project["tool"]["setuptools"]["packages"]["find"]["include"]
    for target in scripts.values():
        module, function = target.split(":")
        assert module.split(".")[0] in packages, (target, packages)
        assert callable(getattr(import_module(module), function)), target
