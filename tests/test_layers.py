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
PUBLIC = {"commlib", "commlib.torch_backend", "commlib.torch_hooks", "commlib.trace",
          "commlib.testing", "commlib.compressed", "commlib.low_rank",
          "commlib.torch_compression", "commlib.settings"}


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


def test_strategies_use_only_the_public_api():
    used = {m: sorted(p.name for p in (ROOT / "commlib_strategies").glob("*.py")
                      if m in _imports(p))
            for p in (ROOT / "commlib_strategies").glob("*.py") for m in _imports(p)}
    assert set(used) <= PUBLIC, {m: files for m, files in used.items() if m not in PUBLIC}


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
    out = subprocess.run([sys.executable, "-c", "import sys, commlib, commlib.torch_backend; "
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
