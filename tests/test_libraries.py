"""The libraries' boundary: ``decoding`` and ``retrieval`` take plain arguments and read no environment
variables (settings are resolved in ``app`` and passed down)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _environment_reads(source: str) -> list[int]:
    """Lines that read the process environment: ``os.environ``, ``os.getenv``, ``environ`` / ``getenv``
    imported from ``os``."""
    names = ("environ", "getenv", "environb")
    lines = []
    for node in ast.walk(ast.parse(source)):
        attribute = isinstance(node, ast.Attribute) and node.attr in names
        imported = isinstance(node, ast.ImportFrom) and node.module == "os" and any(a.name in names for a in node.names)
        if attribute or imported:
            lines.append(node.lineno)
    return lines


def test_the_check_sees_environment_reads() -> None:
    assert _environment_reads("import os\nx = os.environ.get('A')\n") == [2]
    assert _environment_reads("import os\nx = os.getenv('A')\n") == [2]
    assert _environment_reads("from os import environ\n") == [1]
    assert _environment_reads("import os\nx = os.path.join('a')\n") == []


def test_libraries_read_no_environment_variables() -> None:
    found = []
    for package in ("decoding", "retrieval"):
        for path in sorted((REPO / package).rglob("*.py")):
            found += [f"{path.relative_to(REPO)}:{line}" for line in _environment_reads(path.read_text())]
    assert not found, f"environment read in a library (resolve it in app/ and pass it down): {found}"


def _imported_packages(source: str) -> set[str]:
    """Top-level packages a module imports (anywhere in it, function-local imports too)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name.partition(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.partition(".")[0])
    return found


def test_the_check_sees_imports() -> None:
    source = "import app.x\ndef f():\n    from decoding.speculative.tree import ROOT\n"
    assert _imported_packages(source) == {"app", "decoding"}


def test_libraries_never_import_each_other_nor_the_app() -> None:
    """app -> decoding, app -> retrieval; decoding and retrieval never import each other nor app."""
    forbidden = {"decoding": {"retrieval", "app", "bench", "tests"}, "retrieval": {"decoding", "app", "bench", "tests"}}
    found = []
    for package, others in forbidden.items():
        for path in sorted((REPO / package).rglob("*.py")):
            imported = _imported_packages(path.read_text()) & others
            found += [f"{path.relative_to(REPO)} imports {name}" for name in sorted(imported)]
    assert not found, found


PACKAGES = ("app", "retrieval", "decoding")
ROOMS = ("drafters", "speculative", "runtime", "cache")  # decoding's rooms, each importing only those after it


def _module_names() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project modules it imports (anywhere in it: a function-local import is still an edge)."""

    def owner(name: str) -> str | None:  # the module a dotted name lives in (``a.b.C`` -> ``a.b``)
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges |= {owner(alias.name) for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                edges |= {owner(f"{base}.{alias.name}") or owner(base) for alias in node.names}
        graph[name] = {e for e in edges if e is not None and e != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_check_sees_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles() -> None:
    """No module of app, retrieval and decoding reaches itself through imports (function-local ones included)."""
    graph = _import_graph(_module_names())
    assert "decoding.speculative.engine" in graph["decoding.speculative.calibration"]  # the graph is read
    assert not _cycles(graph), _cycles(graph)


def test_decoding_rooms_form_a_ladder() -> None:
    """drafters -> speculative -> runtime -> cache -> errors: no room imports one before it."""
    graph = _import_graph(_module_names())

    def room(module: str) -> int:
        parts = module.split(".")
        return ROOMS.index(parts[1]) if len(parts) > 2 and parts[1] in ROOMS else len(ROOMS)

    up = sorted(f"{m} -> {d}" for m, deps in graph.items() if m.startswith("decoding.")
                for d in deps if d.startswith("decoding.") and room(d) < room(m))
    assert not up, up


def test_only_the_bench_tests_import_the_bench() -> None:
    """bench/ is a user of the libraries, not a library of the tests: only tests/bench, the benchmarks' own
    tests, import it."""
    found = [str(path.relative_to(REPO)) for path in sorted((REPO / "tests").rglob("*.py"))
             if not path.is_relative_to(REPO / "tests" / "bench") and "bench" in _imported_packages(path.read_text())]
    assert not found, found


APP_ROOMS = ("api", "answering", "serving")  # app's rooms, each importing only itself and those after it
APP_SHARED = {"app.errors", "app.schemas", "app.openai_schemas", "app.config"}  # errors, bodies, configs: any room's
RUNNING_STATE = "app.services"  # the loaded services: handed to the routes and to answer()


def _app_room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 and parts[0] == "app" and parts[1] in APP_ROOMS else None


def _app_rooms_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, deps in graph.items():
        room = _app_room(module)
        if room is None:
            continue
        for dep in sorted(d for d in deps if d.startswith("app.")):
            dep_room = _app_room(dep)
            if dep_room is not None:
                ok = APP_ROOMS.index(dep_room) >= APP_ROOMS.index(room)
                if room == dep_room == "api" and module.startswith("app.api.routes."):
                    ok = not dep.startswith("app.api.routes.")  # routes never import each other
            else:
                ok = dep in APP_SHARED or (dep == RUNNING_STATE and room in ("api", "answering"))
            if not ok:
                bad.append(f"{module} -> {dep}")
    return bad


def test_the_rooms_check_sees_a_wrong_way_import() -> None:
    graph = {
        "app.serving.scheduler": {"app.answering.pipeline", "app.errors"},  # serving -> answering: up
        "app.answering.pipeline": {"app.serving.scheduler", "app.services", "app.cli.local"},  # cli: an entry
        "app.api.routes.openai": {"app.api.routes.ask", "app.api.deps"},  # a route importing a route
        "app.serving.sessions": {"app.services"},  # the running state is not serving's to import
    }
    assert _app_rooms_violations(graph) == [
        "app.serving.scheduler -> app.answering.pipeline", "app.answering.pipeline -> app.cli.local",
        "app.api.routes.openai -> app.api.routes.ask", "app.serving.sessions -> app.services",
    ]


def test_app_rooms_import_one_way() -> None:
    """api -> answering -> serving -> the libraries: a room imports only itself, the rooms after it, the shared
    modules (errors, schemas, configs) and, for api and answering, the loaded services; routes never import each
    other; nothing in the rooms imports the entries (cli, cluster, main)."""
    graph = _import_graph(_module_names())
    assert "app.serving.scheduler" in graph["app.answering.pipeline"]  # the graph is read
    violations = _app_rooms_violations(graph)
    assert not violations, violations


def _reached(graph: dict[str, set[str]], module: str) -> set[str]:
    seen, todo = set(), [module]
    while todo:
        for dep in graph.get(todo.pop(), ()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_the_engine_and_the_drafters_reach_no_concrete_runtime() -> None:
    """``decoding.speculative`` and ``decoding.drafters`` call a runtime only through its protocol: of
    ``decoding.runtime`` they reach, directly or through any other module (function-local imports count), only
    ``interface`` (``TargetRuntime``, ``BatchItem``, ``CHUNK_ROWS``) and ``host`` (device-to-host transfers, no
    model); never a runtime (``quantized``, ``torch_runtime``), the loader, the kernels or the attention paths."""
    allowed = {"decoding.runtime.interface", "decoding.runtime.host"}
    graph = _import_graph(_module_names())
    assert "decoding.runtime.interface" in graph["decoding.speculative.engine"]  # the graph is read
    assert "decoding.runtime.torch_runtime" in graph["decoding.runtime.loader"]  # and sees a runtime import

    rooms = [m for m in graph if m.split(".")[:2] in (["decoding", "speculative"], ["decoding", "drafters"])]
    assert "decoding.drafters.rapid" in rooms and "decoding.speculative.batching" in rooms
    found = sorted(f"{m} -> {d}" for m in rooms for d in _reached(graph, m)
                   if d.split(".")[:2] == ["decoding", "runtime"] and d not in allowed)
    assert not found, found


RUNTIME_ROOMS = {  # decoding.runtime's sub-rooms -> what each may import of the rest of decoding.runtime
    "decoding.runtime.formats": set(),  # a weight format's facts and layout: numpy only
    "decoding.runtime.gguf": set(),  # a GGUF file's own description (metadata, tokenizer)
    "decoding.runtime.families": {"decoding.runtime.gguf"},  # an architecture, from its GGUF metadata
    "decoding.runtime.kernels": {"decoding.runtime.formats", "decoding.runtime.quant"},  # the C kernels
}
TORCH_PATH = {"decoding.runtime.attention", "decoding.runtime.attention_cuda", "decoding.runtime.torch_runtime"}


def _runtime_rooms_violations(graph: dict[str, set[str]]) -> list[str]:
    def room(module: str) -> str | None:
        return next((r for r in RUNTIME_ROOMS if module == r or module.startswith(r + ".")), None)

    bad = []
    for module, deps in sorted(graph.items()):
        own = room(module)
        if own is None:
            continue
        for dep in sorted(deps):
            if dep.startswith("decoding.runtime.") and room(dep) != own and room(dep) not in RUNTIME_ROOMS[own] \
                    and dep not in RUNTIME_ROOMS[own]:
                bad.append(f"{module} -> {dep}")
    return bad


def test_the_runtime_rooms_check_sees_a_wrong_way_import() -> None:
    graph = {
        "decoding.runtime.formats.q4_k": {"decoding.runtime.formats.base", "decoding.runtime.quant"},
        "decoding.runtime.kernels.ops": {"decoding.runtime.quant", "decoding.runtime.loader"},
        "decoding.runtime.families.gemma": {"decoding.runtime.gguf.meta", "decoding.runtime.families.base"},
    }
    assert _runtime_rooms_violations(graph) == ["decoding.runtime.formats.q4_k -> decoding.runtime.quant",
                                                "decoding.runtime.kernels.ops -> decoding.runtime.loader"]


def test_runtime_rooms_import_one_way() -> None:
    """Inside ``decoding.runtime``: a weight format and the GGUF readers import nothing of the runtime, a family only
    the GGUF readers, the kernels only the formats (and ``quant``'s matrices); and the quantized runtime reaches
    none of the transformers path's modules (attention, its CUDA twin, ``TorchRuntime``)."""
    graph = _import_graph(_module_names())
    assert "decoding.runtime.formats.base" in graph["decoding.runtime.formats.q4_k"]  # the graph is read
    violations = _runtime_rooms_violations(graph)
    assert not violations, violations
    assert "decoding.runtime.kernels" in _reached(graph, "decoding.runtime.quantized")
    assert not _reached(graph, "decoding.runtime.quantized") & TORCH_PATH


SETTINGS = "app.settings"
WIRING = {  # the modules that turn settings into a running service; everything else takes configs or values
    "app.config",  # settings -> the service's frozen config
    "app.services",  # settings -> the loaded services (models, stores, caches, workers)
    "app.main",  # settings -> the app (its config, key ring and lifespan) and ragspec serve's uvicorn config
    "app.cli.main",  # the CLI entry: environment and flags -> settings, handed to every command
    "app.cli.startup",  # ragspec serve's start: settings -> the port, the data dir, the models, the app, or one line
    "app.cli.local",  # the CLI's in-process commands: open the store or load the services from the settings
    "app.cluster.serve",  # the cluster entry: settings -> Ray, the deployments, the replicas' settings as data
    "app.cluster.checks",  # its Ray-free half, run by the CLI first: what cluster mode asks of the settings
}


def _settings_readers(graph: dict[str, set[str]]) -> list[str]:
    return sorted(module for module, deps in graph.items()
                  if module.partition(".")[0] == "app" and module not in WIRING | {SETTINGS} and SETTINGS in deps)


def test_the_wiring_check_sees_settings_outside_the_wiring() -> None:
    graph = {
        "app.main": {"app.settings", "app.config"},  # wiring
        "app.api.routes.ask": {"app.settings"},  # a route reading the settings
        "app.cli.remote": {"app.settings", "app.cli.progress"},  # a CLI module that is not an entry
        "app.serving.scheduler": {"app.config"},  # a frozen config: fine
    }
    assert _settings_readers(graph) == ["app.api.routes.ask", "app.cli.remote"]


def test_only_the_wiring_imports_the_settings() -> None:
    """``app.settings`` is read where settings become the running service (``WIRING``: the configs, the services,
    the app factory and the two entries, CLI and cluster); routes, answering, serving and the rest get the frozen
    configs or plain values."""
    graph = _import_graph(_module_names())
    assert SETTINGS in graph["app.config"]  # the graph is read (``from app.settings import Settings`` is an edge)
    assert set(graph) >= WIRING  # every wiring module named exists
    readers = _settings_readers(graph)
    assert not readers, f"only the wiring modules import app.settings: {readers}"
