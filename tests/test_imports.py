"""Who may import whom (docs/architecture.md), read from the source with `ast`, and checked once
more in a fresh interpreter: what `serve` and `check-config` load, and what `bench` says without
the tools installed."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "router"

# What the simulator may use of the router's package: the shared text helpers, nothing of the proxy.
SIM_MAY_IMPORT = ("router.sim", "router.content", "router.prompts")
# What the load generator may use of the router's package: the shared helpers (text, prompts, the
# one percentile, the SSE stream watch), the simulator's profiles, and the demo that composes
# router and simulator into the layouts it measures. Never the router's core directly.
BENCH_MAY_IMPORT = (
    "router.bench", "router.content", "router.prompts", "router.quantiles", "router.sse", "router.sim.profile",
    "router.demo", "router.record",
)  # fmt: skip
# The shared helpers the bench uses: nothing of the router's package behind them but each other.
SHARED_HELPERS = (
    "router.content", "router.prompts", "router.quantiles", "router.sse", "router.sim.profile", "router.record",
)  # fmt: skip
# Network and concurrency: what a pure decision must not reach, even through another module.
IO = (
    "asyncio", "socket", "ssl", "selectors", "http.client", "urllib.request", "anyio", "uvloop", "uvicorn",
    "httptools", "h11", "httpx", "aiohttp", "starlette", "multipart", "python_multipart", "psycopg",
    "psycopg_pool", "redis", "grpc", "opentelemetry",
    "router.transport", "router.server", "router.app", "router.runtime", "router.catalog", "router.admin",
    "router.metrics", "router.backends.health", "router.backends.scrape", "router.backends.pools",
    "router.request.pipeline", "router.request.ingress", "router.request.forward", "router.request.relay",
    "router.request.observe",
)  # fmt: skip
# Pure functions of their inputs: the decisions, and the state machines driven by (now, event).
DECISIONS = (
    "router.routing.classify",
    "router.routing.policy",
    "router.request.decide",
    "router.backends.engines",
    "router.backends.outlier",
)
# The tools and what only they need; the router's core never loads them.
TOOLS = ("router.sim", "router.bench", "router.demo", "numpy", "matplotlib", "rich", "httpx")
COMPOSERS = ("router.cli", "router.demo")  # they put router and tools together, as their job
# The PostgreSQL driver (the extra specroute[postgres]): the Batch API's PostgreSQL store alone
# uses it, and it is loaded only when that store is configured.
DRIVERS = ("psycopg", "psycopg_pool")
# The extras' packages and the one module each that uses them, imported only when configured:
# dnspython (specroute[dns]) by the resolver of SRV records and chosen nameservers, OpenTelemetry
# (specroute[otel]) by the tracer.
EXTRAS = {"dns": "router.backends.nameservers", "opentelemetry": "router.otel"}
# None, not even for type checking: the app mounts the Batch API's routes on the service they take.
KNOWN_CYCLES: set[tuple[str, str]] = set()


def _name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _imports(module: str, *, top_level_only: bool = False) -> Iterator[str]:
    tree = ast.parse(MODULES[module].read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    for node in nodes:
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module != "__future__":
            yield node.module
            # `from router import sse` imports the module router.sse.
            yield from (f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in MODULES)


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _reach(module: str) -> set[str]:
    """The module and every module of the package it imports, directly or through another."""
    seen, todo = set(), [module]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        todo += [name for name in _imports(current) if name in MODULES]
    return seen


def test_the_rules_see_the_package() -> None:
    assert {
        "router.cli",
        "router.demo",
        "router.sim.server",
        "router.routing.classify",
        "router.bench.cli",
    } <= MODULES.keys()
    assert "router.content" in set(_imports("router.sim.protocol"))
    assert {"router.sse", "router.sim.profile"} <= set(_imports("router.bench.load")) | set(
        _imports("router.bench.cli")
    )


@pytest.mark.parametrize("module", [m for m in MODULES if _under(m, ("router.sim",))])
def test_the_simulator_uses_only_the_shared_text_helpers(module: str) -> None:
    used = {name for name in _imports(module) if _under(name, ("router",)) and name != "router"}
    assert {name for name in used if not _under(name, SIM_MAY_IMPORT)} == set()


@pytest.mark.parametrize("module", [m for m in MODULES if _under(m, ("router.bench",))])
def test_the_bench_uses_only_the_shared_helpers_and_the_demo(module: str) -> None:
    used = {name for name in _imports(module) if _under(name, ("router",)) and name != "router"}
    assert {name for name in used if not _under(name, BENCH_MAY_IMPORT)} == set()


@pytest.mark.parametrize("module", SHARED_HELPERS)
def test_the_shared_helpers_reach_no_more_of_the_package(module: str) -> None:
    assert {name for name in _reach(module) if not _under(name, SHARED_HELPERS)} == set()


@pytest.mark.parametrize("module", DECISIONS)
def test_decisions_do_no_io(module: str) -> None:
    reached = _reach(module)
    found = {(m, name) for m in reached for name in _imports(m) if _under(name, IO)}
    assert found == set()


# Who may hold the whole settings: `apply` maps them onto the parts (runtime, plan); the rest only
# load them and hand them on (app, cli, demo), read the restart-only sections at start (listener),
# or document them (reference).
SETTINGS_HOLDERS = {
    "router.reference",
    "router.config",
    "router.runtime",
    "router.request.plan",
    "router.app",
    "router.cli",
    "router.demo",
    "router.server.listener",
    "router.server.run",
}


def test_the_parts_take_their_own_sections_not_the_settings() -> None:
    holders = {
        module
        for module, path in MODULES.items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom)
        and node.module == "router.config"
        and any(alias.name == "Settings" for alias in node.names)
    }
    assert holders <= SETTINGS_HOLDERS


@pytest.mark.parametrize("module", [m for m in MODULES if _under(m, ("router.batch",))])
def test_the_batch_parts_take_their_section_from_apply(module: str) -> None:
    """The Batch API's section reaches its parts by `configure` from `Router.apply`, as every
    other part's does, never as an attribute read off the Router (`router.batch`)."""
    tree = ast.parse(MODULES[module].read_text())
    assert [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr == "batch"] == []


def test_no_module_of_the_package_imports_itself_back() -> None:
    """No import cycle, not even one for type checking only : each
    part can be read, and tested, from the bottom up."""
    graph = {module: {name for name in _imports(module) if name in MODULES and name != module} for module in MODULES}
    cycles = {tuple(sorted((a, b))) for a in graph for b in graph[a] if a in _reach_in(graph, b)}
    assert cycles <= KNOWN_CYCLES


def _reach_in(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        current = todo.pop()
        if current not in seen:
            seen.add(current)
            todo += graph[current]
    return seen


@pytest.mark.parametrize("module", [m for m in MODULES if not _under(m, TOOLS + COMPOSERS)])
def test_the_router_core_never_imports_the_tools(module: str) -> None:
    assert {name for name in _imports(module) if _under(name, TOOLS)} == set()


@pytest.mark.parametrize("module", [m for m in MODULES if m != "router.batch.postgres"])
def test_only_the_postgres_store_imports_its_driver(module: str) -> None:
    assert {name for name in _imports(module) if _under(name, DRIVERS)} == set()


def test_the_postgres_store_is_imported_only_where_it_is_chosen() -> None:
    importers = {m for m in MODULES if "router.batch.postgres" in set(_imports(m, top_level_only=True))}
    assert importers == set()  # service.py imports it inside the function that opens the store
    assert "router.batch.postgres" in set(_imports("router.batch.service"))


@pytest.mark.parametrize("module", [m for m in MODULES if m != "router.replicas.redis"])
def test_only_the_redis_store_imports_redis(module: str) -> None:
    assert {name for name in _imports(module) if _under(name, ("redis",))} == set()


def test_the_redis_store_is_imported_only_where_it_is_chosen() -> None:
    importers = {m for m in MODULES if "router.replicas.redis" in set(_imports(m, top_level_only=True))}
    assert importers == set()  # shared.py imports it inside the method that opens the store
    assert "router.replicas.redis" in set(_imports("router.replicas.shared"))


@pytest.mark.parametrize("package", sorted(EXTRAS))
def test_only_its_module_imports_an_extras_package(package: str) -> None:
    importers = {m for m in MODULES if any(_under(name, (package,)) for name in _imports(m))}
    assert importers == {EXTRAS[package]}
    # ...and that module is imported only inside the function that chooses it (router.runtime).
    assert {m for m in MODULES if EXTRAS[package] in set(_imports(m, top_level_only=True))} == set()


def test_the_cli_imports_a_subcommand_only_when_it_runs() -> None:
    heavy = (*TOOLS, "router.app", "uvicorn")
    assert {name for name in _imports("router.cli", top_level_only=True) if _under(name, heavy)} == set()


def _loaded_after(code: str) -> set[str]:
    """The modules a fresh interpreter has loaded after running `code`."""
    probe = code + "\nimport sys\nprint('\\n'.join(sys.modules))"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECROUTE_")}
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, env=env)
    return set(result.stdout.split())


def test_serving_and_checking_a_config_load_no_tool(tmp_path: Path) -> None:
    config = tmp_path / "router.yaml"
    config.write_text(
        "pools:\n  fast:\n    speculative: true\n    backends:\n      fast-1: {url: 'http://127.0.0.1:9'}\n"
    )
    for code, not_needed in (
        (f"from router.cli import main; main(['check-config', {str(config)!r}])", ("router.app", "uvicorn")),
        ("from router.cli import parser; parser().parse_args(['bench', 'sweep', '--base-url', 'x'])", ("uvicorn",)),
        ("import router.app, router.server.server, router.cli", ()),
    ):
        loaded = _loaded_after(code)
        assert {name for name in loaded if _under(name, (*TOOLS, *DRIVERS, *EXTRAS, *not_needed))} == set(), code


def test_bench_without_the_tools_says_how_to_install_them() -> None:
    # As if `rich` were not installed: an import of a module mapped to None fails as a missing one.
    code = "import sys; sys.modules['rich'] = None\nfrom router.cli import main\nsys.exit(main(sys.argv[1:]))"
    result = subprocess.run(
        [sys.executable, "-c", code, "bench", "sweep", "--base-url", "http://127.0.0.1:9/v1"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 1
    assert "pip install 'specroute[tools]'" in result.stderr
    assert "Traceback" not in result.stderr
