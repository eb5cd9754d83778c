"""The import graph of gateway/: no cycles, no imports hidden in functions to dodge one, and
the layers point one way (decisions know nothing of HTTP; nothing on the request path imports
gateway/serving/; gateway/ never imports loadtest/). The load tester's graph and the
benchmarks' have no cycle either: the benchmarks share benchmarks/harness.py, not each other.

Every import statement counts, wherever it stands (module level, inside a function, under
`if TYPE_CHECKING:`), so deferring an import cannot hide a cycle from this test.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "gateway"

# Imports inside functions that are there for a reason other than a cycle, and why.
DEFERRED_OK = {
    ("gateway.state", "gateway.state.redis"): "redis-py is loaded only when a Redis URL is given",
    ("gateway.tokens.loading", "gateway.tokens.hub"): "only hub ids pay for huggingface_hub",
}
# Plain-code layers that decide: they must not import the HTTP side.
DECISIONS = ("gateway.routing", "gateway.admission", "gateway.tenancy", "gateway.tokens",
             "gateway.cost", "gateway.wire", "gateway.errors", "gateway.records",
             "gateway.pipeline")
HTTP_SIDE = ("gateway.api", "starlette", "uvicorn", "gateway.app", "gateway.serving")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}
BENCHMARKS = {module_name(p): p for p in (ROOT / "benchmarks").rglob("*.py")}
LOADTEST = {module_name(p): p for p in (ROOT / "loadtest").rglob("*.py")}


def resolve(name: str, modules: dict[str, Path] = MODULES) -> str | None:
    """The module of `modules` that `name` is, or is in (a `from a.b import c` may name a
    module c)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str, modules: dict[str, Path] = MODULES) -> list[tuple[str, bool]]:
    """(imported name, inside a function?) for every import statement of `module`."""
    tree = ast.parse(modules[module].read_text())
    out: list[tuple[str, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            if isinstance(child, ast.Import):
                out.extend((a.name, in_function) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                out.extend((f"{child.module}.{a.name}", in_function) for a in child.names)
            visit(child, nested)

    visit(tree, False)
    return out


def graph(modules: dict[str, Path] = MODULES) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for module in modules:
        for name, _ in imports(module, modules):
            target = resolve(name, modules)
            # A package importing its own submodules, or a module its parent package, is how
            # packages are built, not a cycle between jobs.
            if target is not None and target != module and not module.startswith(target + "."):
                edges[module].add(target)
    return edges


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (found := walk(nxt)) is not None:
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := walk(node)) is not None:
            return found
    return None


def test_the_import_graph_has_no_cycle() -> None:
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_benchmarks_import_graph_has_no_cycle() -> None:
    assert "benchmarks.harness" in BENCHMARKS
    cycle = find_cycle(graph(BENCHMARKS))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_load_testers_import_graph_has_no_cycle() -> None:
    assert "loadtest.sim.server" in LOADTEST
    cycle = find_cycle(graph(LOADTEST))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_finder_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_gateway_import_is_deferred_into_a_function_without_a_reason() -> None:
    deferred = sorted((module, target) for module in MODULES for name, inside in imports(module)
                      if inside and (target := resolve(name)) is not None)
    unexplained = [pair for pair in deferred if pair not in DEFERRED_OK]
    assert not unexplained, f"imports deferred into functions: {unexplained}"


def test_decisions_know_nothing_of_http_and_gateway_never_imports_loadtest() -> None:
    for module in MODULES:
        names = [name for name, _ in imports(module)]
        assert not any(n == "loadtest" or n.startswith("loadtest.") for n in names), module
        if module.startswith(DECISIONS):
            bad = [n for n in names if n.startswith(HTTP_SIDE)]
            assert not bad, f"{module} imports {bad}"


# The `loadtest` extra (pyproject.toml): only the load tester's plots and calibrate's policy
# rewrite use these, and the gateway is installed and served without them.
EXTRA = ("matplotlib", "ruamel")


def test_no_gateway_module_imports_the_loadtest_extra() -> None:
    for module in MODULES:
        bad = [n for n, _ in imports(module) if n.split(".")[0] in EXTRA]
        assert not bad, f"{module} imports {bad}"


def test_the_gateway_and_the_commands_load_nothing_of_the_loadtest_extra() -> None:
    # Imported for real, in a fresh interpreter: a chain through another library counts too.
    # Every gateway module, and every command's module of `gateway` and `loadtest` (the load
    # tester's import matplotlib and ruamel.yaml only where a plot or a rewrite is asked for).
    modules = sorted(m for m in MODULES if not m.endswith("__main__"))
    code = ("import importlib, sys\n"
            "from gateway.cli import COMMANDS as G\n"
            "from loadtest.cli import COMMANDS as L\n"
            "for m in [*sys.argv[1:], *(m for m, _ in [*G.values(), *L.values()])]:\n"
            "    importlib.import_module(m)\n"
            f"print(' '.join(sorted(n for n in sys.modules if n.split('.')[0] in {EXTRA!r})))\n")
    done = subprocess.run([sys.executable, "-c", code, *modules], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ""


# What decides (who may, where to, how much) is plain code: no chain of imports from it
# reaches an HTTP library or the gateway's HTTP side, the engines' seam included.
PLAIN = ("gateway.routing", "gateway.admission", "gateway.tenancy", "gateway.tokens",
         "gateway.cost", "gateway.wire", "gateway.errors", "gateway.records", "gateway.prefix",
         "gateway.state", "gateway.policy", "gateway.planner", "gateway.signals")
HTTP_REACH = ("aiohttp", "starlette", "uvicorn", "httptools", "gateway.api", "gateway.app",
              "gateway.serving", "gateway.upstream", "gateway.pipeline", "gateway.runtime")


def loaded(name: str) -> list[str]:
    """What importing `name` runs: its module and, first, every package above it."""
    target = resolve(name) or name
    parts = target.split(".")
    return [p for i in range(1, len(parts)) if (p := ".".join(parts[:i])) in MODULES] + [target]


def reach(start: str, targets: tuple[str, ...] = HTTP_REACH) -> list[str] | None:
    """The first import chain from `start` to anything of `targets`, or None. Importing a
    module runs its packages' __init__ too, so a chain may pass through them."""
    before: dict[str, str | None] = {start: None}
    queue = [start]
    while queue:
        module = queue.pop(0)
        for name, _ in imports(module):
            for target in loaded(name):
                if target in before:
                    continue
                before[target] = module
                if target.startswith(targets):
                    chain, at = [target], module
                    while at is not None:
                        chain.append(at)
                        at = before[at]
                    return chain[::-1]
                if target in MODULES:
                    queue.append(target)
    return None


def test_the_decisions_reach_no_http_through_any_chain() -> None:
    chains = {m: c for m in MODULES if m.startswith(PLAIN) and (c := reach(m)) is not None}
    assert not chains, "\n".join(" -> ".join(c) for c in chains.values())


# The request path: the transport, the stages, the engines' seam, what a policy builds, and the
# decisions. gateway/serving/ (the server process, its workers, the heap keeper) sits above the
# app and is handed the app; nothing a request runs through imports it.
REQUEST_PATH = ("gateway.api", "gateway.pipeline", "gateway.upstream", "gateway.runtime",
                "gateway.observe", *PLAIN)


def test_the_request_path_imports_nothing_of_serving() -> None:
    chains = {m: c for m in MODULES if m.startswith(REQUEST_PATH)
              and (c := reach(m, ("gateway.serving",))) is not None}
    assert not chains, "\n".join(" -> ".join(c) for c in chains.values())


def test_the_chain_finder_finds_one() -> None:
    assert reach("gateway.upstream.aio") == ["gateway.upstream.aio", "aiohttp"]
    # through a package's __init__: importing gateway.pipeline.serve runs gateway/pipeline/
    assert reach("gateway.api.openai", ("gateway.pipeline",)) is not None
    assert loaded("gateway.tokens.hub.fetch_tokenizer_files") == [
        "gateway", "gateway.tokens", "gateway.tokens.hub"]
