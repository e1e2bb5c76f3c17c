"""The docs cite only what exists: tests, repository files, command-line options (pure, no mounts).

For docs/*.md, README.md and benchmarks/probes/README.md:

- a test cited as `FILE.py::name` (with or without `tests/`, a `Class::method` chain, a
  `[param]` suffix or a `*` wildcard) names a function, method or class of that file, and a
  bare `test_name` in a code span or a table row names a test function somewhere under tests/
  (collected with ast: no test module is imported);
- a repository path (`ckptfs/...`, `tests/...`, `benchmarks/...`, `examples/...`, `docs/...`,
  `docker/...`, `mount/...`, `.ci/...`, and a package-relative `store/drain.py` or
  `kernel/order.py`) exists;
- an option in a command that starts `ckptfs SUBCOMMAND` (in a code span or block) is one of
  that subcommand's (ckptfs's own argparse parser), and one after `benchmarks/NAME.py`,
  `benchmarks/probes/NAME.py` or `examples/NAME.py` appears as a string literal in that script
  (or in benchmarks/common.py, which the scripts' shared options come from).

Each check lists every offender, with its file and line.
"""
from __future__ import annotations

import argparse
import ast
import fnmatch
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"


def doc_files() -> list[Path]:
    return sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md", ROOT / "benchmarks" / "probes" / "README.md"]


# --- reading a doc ------------------------------------------------------------------------------

FENCE = re.compile(r"^\s*(```|~~~)")


def code_and_prose(text: str) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(code, rows): the doc's code, as (first line, text) pieces: each fenced block's commands
    (backslash continuations joined) and each inline code span (which may wrap across lines);
    and its table rows, as (line, text)."""
    code, rows, prose = [], [], []
    in_fence = False
    pending: tuple[int, str] | None = None
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            in_fence = not in_fence
            prose.append((n, ""))
            continue
        if in_fence:
            if pending is not None:
                pending = (pending[0], pending[1] + " " + line.strip())
            else:
                pending = (n, line)
            if pending[1].rstrip().endswith("\\"):
                pending = (pending[0], pending[1].rstrip()[:-1])
            else:
                code.append(pending)
                pending = None
            prose.append((n, ""))
            continue
        prose.append((n, line))
        if line.lstrip().startswith("|"):
            rows.append((n, line))
    # inline code spans, over the prose only (line numbers kept through the newlines)
    joined = "\n".join(line for _, line in prose)
    for m in re.finditer(r"(?<!`)`([^`]+)`(?!`)", joined):
        start = joined.count("\n", 0, m.start()) + 1
        code.append((start, " ".join(m.group(1).split())))
    code.sort(key=lambda piece: piece[0])
    return code, rows


# --- tests --------------------------------------------------------------------------------------

def collect_tests() -> tuple[dict[str, set[str]], set[str]]:
    """Per test file (its name without .py), its functions, methods and classes (and module-level
    names assigned, e.g. a hypothesis state machine's `TestX = Machine.TestCase`); and every test
    function name under tests/."""
    per_file, tests = {}, set()
    for path in sorted(TESTS.rglob("*.py")):
        names = set()
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
                if node.name.startswith("test") and not isinstance(node, ast.ClassDef):
                    tests.add(node.name)
        for node in tree.body:
            if isinstance(node, ast.Assign):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        per_file[path.relative_to(TESTS).with_suffix("").as_posix()] = names
    return per_file, tests


TEST_REF = re.compile(r"(?<![\w/.-])(?:tests/)?((?:\w+/)*test_\w+)\.py((?:::[\w*]+)+)(?:\[[^\]]*\])?")
BARE_TEST = re.compile(r"(?<![\w/.:*-])test_\w+(?:\*)?(?![\w.:]|\*)")


def _matches(name: str, names: set[str]) -> bool:
    return any(fnmatch.fnmatchcase(n, name) for n in names) if "*" in name else name in names


def test_every_cited_test_exists():
    per_file, tests = collect_tests()
    bad = []
    for doc in doc_files():
        text = doc.read_text()
        rel = doc.relative_to(ROOT)
        for n, line in enumerate(text.splitlines(), 1):
            for m in TEST_REF.finditer(line):
                file, chain = m.group(1), m.group(2).split("::")[1:]
                if file not in per_file:
                    bad.append(f"{rel}:{n}: {m.group(0)}: no tests/{file}.py")
                    continue
                missing = [c for c in chain if not _matches(c, per_file[file])]
                if missing:
                    bad.append(f"{rel}:{n}: {m.group(0)}: tests/{file}.py has no {', '.join(missing)}")
        code, rows = code_and_prose(text)
        for n, piece in code + rows:
            for m in BARE_TEST.finditer(TEST_REF.sub(" ", piece)):
                if not _matches(m.group(0), tests):
                    bad.append(f"{rel}:{n}: {m.group(0)}: no such test function under tests/")
    assert not bad, "tests cited that do not exist:\n" + "\n".join(bad)


# --- paths --------------------------------------------------------------------------------------

PATH = re.compile(r"(?<![\w./~$<>-])((?:ckptfs|tests|benchmarks|examples|docs|docker|mount|\.ci)/[\w./*-]*)")
# a module path relative to the package: `store/drain.py`, `kernel/order.py`
PKG_PATH = re.compile(r"(?<![\w./~$<>-])((?:format|fs|store|fuse|ops|replicate|kernel)/[\w/]*\.py)\b")
PKG_ROOT = {"kernel": "ckptfs/fuse/"}
# scratch/ and what benchmarks/node/pack.sh fills are git-ignored outputs
IGNORED = ("scratch/", "benchmarks/node/carry/")
PLACEHOLDERS = {"NAME", "FILE", "CASE", "X"}  # `benchmarks/probes/NAME.py`: a pattern, not a path


def _exists(rel: str) -> bool:
    if "*" in rel:
        return any(ROOT.glob(rel))
    return (ROOT / rel).exists()


def test_every_cited_path_exists():
    bad = []
    for doc in doc_files():
        rel_doc = doc.relative_to(ROOT)
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            for m in PATH.finditer(line):
                path = m.group(1).rstrip(".-")
                if path.startswith(IGNORED) or _exists(path):
                    continue
                if any(Path(part).stem in PLACEHOLDERS for part in path.split("/")):
                    continue
                bad.append(f"{rel_doc}:{n}: {path}")
            for m in PKG_PATH.finditer(line):
                path = m.group(1)
                full = PKG_ROOT.get(path.split("/")[0], "ckptfs/") + path
                if not _exists(full):
                    bad.append(f"{rel_doc}:{n}: {path} (as {full})")
    assert not bad, "paths cited that do not exist:\n" + "\n".join(bad)


# --- command-line options ----------------------------------------------------------------------

CLI = re.compile(r"(?<![\w./-])ckptfs\s+([a-z]+)\b(.*)")
SCRIPT = re.compile(r"(?<![\w./-])((?:benchmarks/probes|benchmarks|examples)/\w+\.py)\b(.*)")
OPTION = re.compile(r"(?<![\w-])(--[a-z][\w-]*)")
END = re.compile(r"\s(?:&&|\|\||;|\||#)\s|\s#|;")  # a shell separator or comment ends the command


def _options(rest: str) -> list[str]:
    return OPTION.findall(END.split(rest, maxsplit=1)[0])


def cli_options() -> dict[str, set[str]]:
    from ckptfs.cli import build_parser

    def options(p: argparse.ArgumentParser) -> set[str]:
        """p's options, and those of its own subcommands (`ckptfs replicas ls --json`)."""
        out = set(p._option_string_actions)
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for sp in a.choices.values():
                    out |= options(sp)
        return out

    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: options(sp) for name, sp in subs.choices.items()}


def script_options(rel: str) -> set[str] | None:
    """The "--x" string literals of a script (and of benchmarks/common.py when it imports it)."""
    path = ROOT / rel
    if not path.exists():
        return None
    sources = [path]
    text = path.read_text()
    if rel.startswith("benchmarks/") and re.search(r"^\s*(from common import|import common)", text, re.M):
        sources.append(ROOT / "benchmarks" / "common.py")
    out = set()
    for src in sources:
        for node in ast.walk(ast.parse(src.read_text(), str(src))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("--"):
                out.add(node.value.split("=")[0])
    return out


def test_every_cited_option_exists():
    subcommands = cli_options()
    scripts: dict[str, set[str] | None] = {}
    bad = []
    for doc in doc_files():
        rel_doc = doc.relative_to(ROOT)
        code, _ = code_and_prose(doc.read_text())
        for n, piece in code:
            for m in CLI.finditer(piece):
                sub, rest = m.group(1), m.group(2)
                if sub not in subcommands:
                    continue  # `ckptfs status` in prose is checked; `ckptfs is ...` is not a command
                for opt in _options(rest):
                    if opt not in subcommands[sub]:
                        bad.append(f"{rel_doc}:{n}: ckptfs {sub} {opt}: no such option")
            for m in SCRIPT.finditer(piece):
                script, rest = m.group(1), m.group(2)
                if script not in scripts:
                    scripts[script] = script_options(script)
                known = scripts[script]
                if known is None:
                    continue  # a missing script is the path check's to report
                for opt in _options(rest):
                    if opt != "--help" and opt not in known:
                        bad.append(f"{rel_doc}:{n}: {script} {opt}: no such option")
    assert not bad, "options cited that do not exist:\n" + "\n".join(bad)
