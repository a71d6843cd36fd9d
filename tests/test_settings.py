"""commlib/settings.py declares every environment variable once: the docs' table is made
from it, the code reads the library's variables only through it, every variable named in
code or docs is declared, and nothing is read at import."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from commlib import settings

ROOT = Path(__file__).resolve().parent.parent
PYTHON_TREES = ("commlib", "commlib_bench", "commlib_strategies", "tests")
# a read of a variable straight from the environment (writes, deletions and copies pass)
DIRECT_READ = re.compile(r"""environ\.get\(\s*f?["']([A-Z][A-Z0-9_]*)|"""
                         r"""environ\[\s*f?["']([A-Z][A-Z0-9_]*)["']\s*\](?!\s*=[^=])|"""
                         r"""getenv\(\s*f?["']([A-Z][A-Z0-9_]*)""")
NAMED = re.compile(r"COMMLIB_[A-Z0-9_]*(?:<[A-Z_]+>|[A-Z0-9])")
QUOTED = re.compile(r"""["'](COMMLIB_[A-Z0-9_]*[A-Z0-9])["']""")
NOT_VARIABLES = {"COMMLIB_CXX_FLAGS": "a C macro setup.py defines",
                 "COMMLIB_NO_SUCH": "this file's undeclared name"}


def _python_files():
    yield ROOT / "setup.py"
    for tree in PYTHON_TREES:
        yield from (ROOT / tree).rglob("*.py")


def _declared(name: str) -> bool:
    try:
        settings.declaration(name)
    except KeyError:
        return False
    return True


def test_the_docs_table_is_the_declarations():
    docs = (ROOT / "docs" / "collectives.md").read_text()
    start = docs.index("| Variable | Default | Effect | Described in |")
    end = (docs.find("\n\n", start) + 1) or len(docs)
    assert docs[start:end] == settings.markdown(), \
        "docs/collectives.md's table differs: paste `python -m commlib.settings` there"


def test_the_librarys_variables_are_read_only_through_settings():
    """Tests may read their own (stage "test") variables; nothing else reads one of the
    declared variables but commlib/settings.py."""
    found = []
    for path in _python_files():
        if path == ROOT / "commlib" / "settings.py":
            continue
        in_tests = path.is_relative_to(ROOT / "tests")
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for match in ([] if line.lstrip().startswith("del ") else
                          DIRECT_READ.finditer(line)):
                name = next(g for g in match.groups() if g)
                if not _declared(name):
                    continue  # (a launcher's: RANK, WORLD_SIZE, ...)
                if in_tests and settings.declaration(name).stage == settings.TEST:
                    continue
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, "read these through commlib.settings.get:\n" + "\n".join(found)


def test_every_variable_named_in_code_or_docs_is_declared():
    """Python's quoted names, C++'s getenv and the docs' mentions: a typo or a variable
    added without its declaration fails here."""
    named = {}
    for path in _python_files():
        for name in QUOTED.findall(path.read_text()):
            named.setdefault(name, path)
    for path in [*(ROOT / "csrc").rglob("*.c*"), *(ROOT / "commlib" / "cuda").glob("*.cu")]:
        for name in re.findall(r"""getenv\("([A-Z0-9_]+)"\)""", path.read_text()):
            named.setdefault(name, path)
            assert settings.declaration(name).read_by != "commlib", \
                f"{name} is read by {path.name}: say so in its declaration's read_by"
    for path in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        for name in NAMED.findall(path.read_text()):
            named.setdefault(name, path)
    undeclared = {n: str(p.relative_to(ROOT)) for n, p in named.items()
                  if not _declared(n) and n not in NOT_VARIABLES}
    assert not undeclared, undeclared


def test_values_are_parsed_as_declared_and_bad_ones_named(monkeypatch):
    monkeypatch.delenv("COMMLIB_CHECK", raising=False)
    assert settings.get("COMMLIB_CHECK") is True
    for text, value in [("0", False), ("off", False), ("No", False), ("1", True),
                        ("true", True), ("", True)]:
        monkeypatch.setenv("COMMLIB_CHECK", text)
        assert settings.get("COMMLIB_CHECK") is value, text
    monkeypatch.setenv("COMMLIB_CHECK", "sometimes")
    with pytest.raises(ValueError, match=r"COMMLIB_CHECK='sometimes': expected 1 or 0"):
        settings.get("COMMLIB_CHECK")
    monkeypatch.setenv("COMMLIB_TIMEOUT", "2.5")
    assert settings.get("COMMLIB_TIMEOUT") == 2.5
    monkeypatch.setenv("COMMLIB_TIMEOUT", "-1")
    with pytest.raises(ValueError, match=r"COMMLIB_TIMEOUT='-1': expected a number >= 0"):
        settings.get("COMMLIB_TIMEOUT")
    monkeypatch.setenv("COMMLIB_SEGMENT_BYTES", "1M")
    with pytest.raises(ValueError, match=r"COMMLIB_SEGMENT_BYTES='1M': expected an integer"):
        settings.get("COMMLIB_SEGMENT_BYTES")
    monkeypatch.setenv("COMMLIB_GPU_MEET", "host")
    with pytest.raises(ValueError, match=r"COMMLIB_GPU_MEET='host': expected one of "
                                         r"'streams', 'proxy'"):
        settings.get("COMMLIB_GPU_MEET")
    monkeypatch.setenv("COMMLIB_ALGO_REDUCE_SCATTER", "ring")
    assert settings.get("COMMLIB_ALGO_REDUCE_SCATTER") == "ring"
    assert settings.declaration("COMMLIB_ALGO_ALL_TO_ALL").name == "COMMLIB_ALGO_<COLLECTIVE>"
    with pytest.raises(KeyError, match="COMMLIB_NO_SUCH is not declared in commlib/settings.py"):
        settings.get("COMMLIB_NO_SUCH")


def test_a_bad_value_fails_the_call_that_reads_it_not_the_import(tmp_path):
    """Importing commlib reads no setting: a value it cannot take fails when first used,
    naming itself (here an unreadable tuning file and a segment size in words)."""
    bad = tmp_path / "tuning.json"
    bad.write_text("not json")
    env = {**os.environ, "COMMLIB_TUNING": str(bad), "COMMLIB_SEGMENT_BYTES": "lots",
           "COMMLIB_GPU_MEET": "nowhere"}
    code = ("import commlib, commlib.select, commlib.cuda, commlib.torch.backend, "
            "commlib.transports.mpi, commlib.transports.cuda_ipc, commlib_strategies\n"
            "from commlib import settings\n"
            "try:\n    settings.get('COMMLIB_SEGMENT_BYTES')\n"
            "except ValueError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, text=True,
                         capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "COMMLIB_SEGMENT_BYTES='lots': expected an integer"
