"""The layout the architecture table of docs/architecture.md shows: each layer imports only the layers below it,
only ``lmcollect/ray`` imports Ray, and no private name is imported from another module."""
from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import lmcollect

PACKAGE = Path(lmcollect.__file__).parent

# bottom to top; a module may import its own layer and the layers before it
LAYERS = [
    {"files", "lazy", "plumbing", "startup", "data", "models", "loggers"},
    {"weights"},
    {"transports"},
    {"envs", "buffers", "checkpoint", "checkpoint_buffer", "diagnostics", "viewer"},
    {"engines"},
    {"agents"},
    {"compat"},  # adapters of outside libraries: over envs (ChatEnv tasks) and agents (AgentEnv, tool parsers)
    {"policies"},
    {"testing"},
    {"weight_sync"},
    {"training"},
    {"collectors"},
    {"ray"},
    {"cli"},
]
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def layer_of(module: str) -> str | None:
    """``lmcollect.engines.sampling`` -> ``engines``; the package's face (``lmcollect``) -> None."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "lmcollect" else None


def imports(path: Path) -> Iterator[tuple[int, str, list[str]]]:
    """(line, module, names) of every import in ``path``, also those inside functions."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module, [alias.name for alias in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, []


def modules() -> Iterator[tuple[Path, str]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        yield path, ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_every_folder_has_a_layer() -> None:
    entries = [path for path in PACKAGE.iterdir() if path.is_dir() or path.suffix == ".py"]  # not py.typed
    folders = {path.stem if path.is_file() else path.name for path in entries}
    folders -= {"__init__", "__pycache__"}
    assert folders == set(RANK), f"give these a layer in LAYERS: {sorted(folders ^ set(RANK))}"


def test_no_import_runs_upward() -> None:
    upward = []
    for path, module in modules():
        mine = layer_of(module)
        if mine is None:  # lmcollect/__init__.py: the package's face names everything, lazily
            continue
        for line, imported, _ in imports(path):
            theirs = layer_of(imported)
            if theirs is not None and RANK[theirs] > RANK[mine]:
                upward.append(f"{module}:{line} imports {imported} ({mine} is below {theirs})")
    assert not upward, "\n".join(upward)


def test_only_the_ray_package_imports_ray() -> None:
    found = [
        f"{module}:{line}"
        for path, module in modules()
        if layer_of(module) != "ray"
        for line, imported, _ in imports(path)
        if imported == "ray" or imported.startswith("ray.")
    ]
    assert not found, f"move these Ray uses into lmcollect/ray: {found}"


def test_no_private_name_crosses_a_module() -> None:
    found = [
        f"{module}:{line} imports {name} from {imported}"
        for path, module in modules()
        for line, imported, names in imports(path)
        if imported.startswith("lmcollect") and imported != module
        for name in names
        if name.startswith("_")
    ]
    assert not found, "\n".join(found)


MAX_FUNCTION_LINES = 60  # docstring included: a longer function is split where its steps are


def test_no_function_is_over_sixty_lines() -> None:
    long = [
        f"{module}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path, module in modules()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, "split these into named steps:\n" + "\n".join(long)
