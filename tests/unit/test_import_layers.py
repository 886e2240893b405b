"""Layered imports (docs/architecture.md, "Layers").

Every ``.py`` of the packages below is parsed with ``ast``; every import counts, lazy ones inside
functions included, relative ones resolved.  A string constant that names a module of this
repository (``"turnscale.envhub.babyai:make_family"``, ``importlib.import_module("turnscale.benchmarks.main")``)
counts as a reference too: the code reaches that module at run time; so does ``[python, "-m", "turnscale", ...]``, a launch (a fresh interpreter: checked against
the layer rule, but no edge of the import graph).  Then:

* each edge between packages must be allowed by ``ALLOWED`` (the layer rule; no package imports
  ``tests``: test scaffolding lives there, the packages' own scaffolding in ``benchmarks``);
* the package graph has no cycle;
* inside a package, the module-level (top-of-file, not lazy) imports have no cycle, and the two
  lazy cycles the issue named stay broken (``actors.engine`` imports no engine module;
  ``envhub.babyai_oracle`` does not import ``envhub.babyai``).
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

BOTTOM = ("protocol", "conf")
SHARED = ("common",)
ROLES = ("envhub", "actors", "learner")
TOP = ("turnscale", "benchmarks")
TOOLS = ("cluster",)  # the test cluster (network namespaces): standard library only
PACKAGES = (*BOTTOM, *SHARED, *ROLES, *TOP, *TOOLS)

LAYER = {**{p: "bottom" for p in BOTTOM}, **{p: "shared" for p in SHARED}, **{p: "role" for p in ROLES}, **{p: "top" for p in TOP}, **{p: "tools" for p in TOOLS}, "tests": "tests"}

ALLOWED: dict[str, frozenset[str]] = {
    # the bottom: the wire protocol imports nothing of ours; the config schema may read the
    # protocol's vocabulary (wire dtype names, ``protocol.dtypes``), never the reverse
    "protocol": frozenset(),
    "conf": frozenset(("protocol",)),
    # the shared layer: what several roles need
    "common": frozenset(BOTTOM),
    # the roles import only downward, never each other
    **{role: frozenset((*BOTTOM, *SHARED)) for role in ROLES},
    # the application dispatches ``turnscale bench`` into benchmarks (by module name, lazily)
    "turnscale": frozenset((*BOTTOM, *SHARED, *ROLES, "benchmarks")),
    # the benchmarks drive the roles; they import no application module (so the top layer has
    # no cycle), they only launch its processes (below)
    "benchmarks": frozenset((*BOTTOM, *SHARED, *ROLES, *TOOLS)),
    # the test cluster stands alone (the benchmarks and tests use it; no role does)
    "cluster": frozenset(),
}

LAUNCH_ALLOWED: dict[str, frozenset[str]] = {
    # ``[python, "-m", "turnscale", "learner", ...]``: a fresh interpreter, not an import, so it
    # is no edge of the import graph; only the top layer launches the application
    "benchmarks": frozenset(("turnscale",)),
}

MODULE_PATH = re.compile(r"^([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(?::[A-Za-z_]\w*)?$")


@dataclass(frozen=True)
class Ref:
    file: str  # relative to the repository root
    line: int
    source: str  # importing module
    target: str  # imported module (as written, resolved)
    lazy: bool  # inside a function (runs later, if at all), or a string reference
    how: str  # "import", "string" (a module path in a string) or "launch" (after ``-m``)


MAPPED = tuple(p for p in PACKAGES if p != "turnscale")  # the folders installed as turnscale.<pkg>


def module_name(path: Path) -> str:
    """The import name of a file: ``actors/relay.py`` -> ``turnscale.actors.relay`` (pyproject's
    package-dir), ``turnscale/cli.py`` -> ``turnscale.cli``."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    if parts[0] in MAPPED:
        parts = ["turnscale", *parts]
    return ".".join(parts)


def package_of(name: str) -> str:
    """The layer package a module name belongs to: ``turnscale.actors.x`` -> ``actors``,
    ``turnscale.cli`` -> ``turnscale`` (the application), ``turnscale`` alone -> ``root`` (the
    import-free namespace root), ``tests.x`` -> ``tests``; a bare ``actors.x`` -> ``bare`` (a
    top-level name that an install does not provide: always forbidden)."""
    parts = name.split(".")
    if parts[0] == "turnscale":
        if len(parts) == 1:
            return "root"
        return parts[1] if parts[1] in MAPPED else "turnscale"
    if parts[0] in MAPPED:
        return "bare"
    return parts[0]


def all_modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            out[module_name(path)] = path
    return out


MODULES = all_modules()


def _resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> list[str]:
    if not node.level:
        base = node.module or ""
    else:
        parts = mod.split(".") if is_pkg else mod.split(".")[:-1]
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join([*parts, *([node.module] if node.module else [])])
    # ``from pkg import mod`` names a module: count the submodule when there is one
    out = [base]
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        if sub in MODULES:
            out.append(sub)
    return out


def _string_refs(node: ast.AST) -> list[tuple[int, str, str]]:
    """Module paths of this repository named by string constants: ``pkg.mod`` or ``pkg.mod:attr``
    ("string"), or the word after a ``"-m"`` in a list/tuple ("launch")."""
    out = []
    # a logger's name (``logging.getLogger("turnscale.learner")``) is a label, not a module
    loggers = {id(a) for n in ast.walk(node) if isinstance(n, ast.Call)
               and getattr(n.func, "attr", getattr(n.func, "id", None)) == "getLogger" for a in n.args}
    for n in ast.walk(node):
        if id(n) in loggers:
            continue
        if isinstance(n, (ast.List, ast.Tuple)):
            elts = n.elts
            for a, b in zip(elts, elts[1:]):
                if isinstance(a, ast.Constant) and a.value == "-m" and isinstance(b, ast.Constant) and isinstance(b.value, str):
                    out.append((b.lineno, b.value, "launch"))
        if isinstance(n, ast.Constant) and isinstance(n.value, str):
            m = MODULE_PATH.match(n.value)
            if m and "." in m.group(1) and m.group(1) in MODULES:
                out.append((n.lineno, m.group(1), "string"))
    return out


def refs_of(mod: str, path: Path) -> list[Ref]:
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    rel = str(path.relative_to(ROOT))
    # lazy: inside a function; module level, class bodies, ``try``/``if`` blocks run at import
    in_function = {
        id(sub)
        for n in ast.walk(tree)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for sub in ast.walk(n)
        if isinstance(sub, (ast.Import, ast.ImportFrom))
    }
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            targets = [a.name for a in n.names]
        elif isinstance(n, ast.ImportFrom):
            targets = _resolve(mod, is_pkg, n)
        else:
            continue
        for t in targets:
            out.append(Ref(rel, n.lineno, mod, t, id(n) in in_function, "import"))
    # docstrings are prose, not references
    docs = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant):
                docs.add(id(n.body[0].value))
    for line, target, how in _string_refs(tree):
        out.append(Ref(rel, line, mod, target, True, how))
    return [r for r in out if package_of(r.target) in (*LAYER, "root", "bare") and not _is_doc(r, tree, docs)]  # ours and tests


def _is_doc(ref: Ref, tree: ast.AST, docs: set[int]) -> bool:
    if ref.how != "string":
        return False
    for n in ast.walk(tree):
        if id(n) in docs and n.lineno <= ref.line <= (n.end_lineno or n.lineno):
            return True
    return False


def collect() -> list[Ref]:
    out = []
    for mod, path in MODULES.items():
        out.extend(refs_of(mod, path))
    return out


def forbidden(refs: list[Ref]) -> list[str]:
    bad = []
    for r in refs:
        src, dst = package_of(r.source), package_of(r.target)
        if r.how == "launch" and r.target == "turnscale":
            dst = "turnscale"  # ``python -m turnscale``: the application's __main__
        if dst == "bare":
            bad.append(f"{r.file}:{r.line} names {r.target}: import it as turnscale.{r.target} (installed under the turnscale namespace)")
            continue
        if dst == "root":  # the namespace root imports nothing: every layer may name it
            continue
        allowed = ALLOWED[src] | (LAUNCH_ALLOWED.get(src, frozenset()) if r.how == "launch" else frozenset())
        if src != dst and dst not in allowed:
            what = {"import": "imports", "string": "names (string)", "launch": "launches (-m)"}[r.how]
            bad.append(f"{r.file}:{r.line} {what} {r.target} (layer {LAYER[src]} '{src}' may not import layer {LAYER[dst]} '{dst}')")
    return sorted(set(bad))


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a node list (first == last), or None."""
    color: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        color[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if color.get(m) == 1:
                return [*stack[stack.index(m):], m]
            if not color.get(m):
                found = visit(m)
                if found:
                    return found
        stack.pop()
        color[n] = 2
        return None

    for n in sorted(graph):
        if not color.get(n):
            found = visit(n)
            if found:
                return found
    return None


def _owning_module(target: str) -> str | None:
    """The repository module ``target`` names (``pkg.mod.attr`` -> ``pkg.mod``)."""
    parts = target.split(".")
    while parts:
        name = ".".join(parts)
        if name in MODULES:
            return name
        parts.pop()
    return None


REFS = collect()


def test_no_forbidden_import_between_layers():
    bad = forbidden(REFS)
    assert not bad, "forbidden imports across layers:\n  " + "\n  ".join(bad)


def test_package_graph_is_acyclic():
    graph: dict[str, set[str]] = defaultdict(set)
    for r in REFS:
        src, dst = package_of(r.source), package_of(r.target)
        if src != dst and r.how != "launch" and dst != "root":
            graph[src].add(dst)
    cycle = find_cycle(graph)
    assert cycle is None, "package import cycle: " + " -> ".join(cycle)


def test_module_level_imports_inside_each_package_are_acyclic():
    graph: dict[str, set[str]] = defaultdict(set)
    for r in REFS:
        if r.lazy or package_of(r.source) != package_of(r.target):
            continue
        dst = _owning_module(r.target)
        if dst and dst != r.source:
            graph[r.source].add(dst)
    cycle = find_cycle(graph)
    assert cycle is None, "module-level import cycle: " + " -> ".join(cycle)


def _targets(source: str) -> set[str]:
    return {m for r in REFS if r.source == source for m in [_owning_module(r.target)] if m}


def test_engine_interface_imports_no_engine():
    """actors.engine (the interface) <-> the engine modules / the factory was a lazy cycle."""
    engines = {"turnscale.actors.engines", "turnscale.actors.hf_engine", "turnscale.actors.sim_engine", "turnscale.actors.vllm_engine", "turnscale.actors.vllm_state", "turnscale.actors.vllm_worker"}
    assert not (_targets("turnscale.actors.engine") & engines)


def test_babyai_oracle_does_not_import_babyai():
    """envhub.babyai <-> envhub.babyai_oracle was a lazy cycle; the oracle needs only the prims."""
    assert "turnscale.envhub.babyai" not in _targets("turnscale.envhub.babyai_oracle")


def test_the_check_sees_lazy_relative_and_string_references():
    """The parser itself: a relative import resolves, a lazy one is lazy, ``-m`` strings count,
    and a bare top-level name (``import actors.episode``) is refused: it exists only in a checkout."""
    tree = ast.parse("def f():\n    from ..learner import trainer\n    import actors.episode\n    return ['-m', 'turnscale']\n")
    node = tree.body[0].body[0]
    assert _resolve("turnscale.envhub.sub.probe", False, node)[0] == "turnscale.envhub.learner"
    assert (4, "turnscale", "launch") in _string_refs(tree)
    bad = forbidden([
        Ref("envhub/x.py", 3, "turnscale.envhub.x", "turnscale.actors.episode", True, "import"),
        Ref("common/x.py", 4, "turnscale.common.x", "turnscale", True, "launch"),
        Ref("benchmarks/x.py", 5, "turnscale.benchmarks.x", "tests.unit.fakes", False, "import"),
        Ref("learner/x.py", 6, "turnscale.learner.x", "actors.episode", False, "import"),
        Ref("learner/x.py", 7, "turnscale.learner.x", "turnscale", False, "import"),
    ])
    assert bad == [
        "benchmarks/x.py:5 imports tests.unit.fakes (layer top 'benchmarks' may not import layer tests 'tests')",
        "common/x.py:4 launches (-m) turnscale (layer shared 'common' may not import layer top 'turnscale')",
        "envhub/x.py:3 imports turnscale.actors.episode (layer role 'envhub' may not import layer role 'actors')",
        "learner/x.py:6 names actors.episode: import it as turnscale.actors.episode (installed under the turnscale namespace)",
    ]
