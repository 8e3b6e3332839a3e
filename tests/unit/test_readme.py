"""The documentation (README.md and docs/) as users read it: its examples run as written, its
Python parses, its links resolve, and the API reference covers every public name."""
from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from lmcollect.collectors import LLMCollector
from lmcollect.data import keys
from lmcollect.testing import ScriptedPolicy

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
DOC_FILES = [README, *sorted(DOCS.rglob("*.md"))]


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def doc_block(marker: str) -> str:
    """The one ```python block of README.md or docs/ that contains ``marker``."""
    found = [block for path in DOC_FILES for block in python_blocks(path) if marker in block]
    assert len(found) == 1, f"{len(found)} python blocks of README.md and docs/ contain {marker!r}, expected 1"
    return found[0]


def test_custom_env_example_collects() -> None:
    namespace: dict = {}
    exec(doc_block("class EchoEnv"), namespace)  # noqa: S102 - our own docs (docs/collectors.md)
    collector = LLMCollector(namespace["EchoEnv"](), policy=ScriptedPolicy("hi there"), dialog_turns_per_batch=4)
    batch = collector.next()
    assert batch.batch_size == (2, 2)
    assert batch[keys.NEXT_REWARD].flatten().tolist() == [1.0] * 4
    assert batch[keys.STEP_COUNT].flatten().tolist() == [0, 0, 0, 0]  # one-turn dialogs


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_parse(path: Path) -> None:
    for block in python_blocks(path):
        ast.parse(block)


def test_readme_links_resolve() -> None:
    """The README points at the guide pages in docs/: each relative link names a file that exists."""
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    local = [link for link in links if "://" not in link]
    assert any(link.startswith("docs/") for link in local)
    assert [link for link in local if not (ROOT / link).is_file()] == []


# each public package -> its page of the API reference (docs/api/); mkdocs renders them from the docstrings
API_PAGES = {
    "lmcollect.agents": "agents.md",
    "lmcollect.collectors": "collectors.md",
    "lmcollect.buffers": "buffers.md",
    "lmcollect.data": "data.md",
    "lmcollect.envs": "envs.md",
    "lmcollect.engines": "engines.md",
    "lmcollect.policies": "policies.md",
    "lmcollect.weight_sync": "weight_sync.md",
    "lmcollect.transports": "transports.md",
    "lmcollect.ray": "ray.md",
    "lmcollect.diagnostics": "diagnostics.md",
    "lmcollect.testing": "testing.md",
    "lmcollect.loggers": "loggers.md",
    "lmcollect.models": "models.md",
    "lmcollect.viewer": "viewer.md",
}


@pytest.mark.parametrize("package", sorted(API_PAGES))
def test_api_page_covers_public_names(package: str) -> None:
    """Every name of a package's ``__all__`` is on its API page (a ``:::`` directive or the page's text)."""
    page = (DOCS / "api" / API_PAGES[package]).read_text()
    assert f"::: {package}\n" in page  # the package docstring opens the page
    missing = [name for name in importlib.import_module(package).__all__ if not re.search(rf"\b{name}\b", page)]
    assert missing == [], f"docs/api/{API_PAGES[package]} lacks {missing}"


def test_api_index_covers_top_level_names() -> None:
    import lmcollect

    index = (DOCS / "api" / "index.md").read_text()
    assert [name for name in lmcollect.__all__ if f"`{name}`" not in index] == []


def _top_level_names(source: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def test_api_directives_name_existing_objects() -> None:
    """Each ``::: path`` of docs/api/ is a module of lmcollect or a name defined at the top of one, so a
    renamed or moved object fails here and not only in ``make docs`` (which reads the source the same way)."""
    wrong = []
    for page in sorted((DOCS / "api").glob("*.md")):
        for path in re.findall(r"^::: (\S+)$", page.read_text(), flags=re.M):
            parts = path.split(".")
            for split in range(len(parts), 0, -1):  # the longest prefix that is a module
                base = ROOT.joinpath(*parts[:split])
                source = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
                if source.is_file():
                    break
            rest = parts[split:]
            if not source.is_file() or len(rest) > 1 or (rest and rest[0] not in _top_level_names(source)):
                wrong.append(f"{page.name}: {path}")
    assert wrong == []


def api_table_names() -> list[tuple[str, str]]:
    """(package, name) for every name in the "main public names" column of the README's API table."""
    section = README.read_text().split("## API overview", 1)[1].split("\n## ", 1)[0]
    pairs = []
    for row in re.findall(r"^\| `(lmcollect[\w.]*)`(?:, `(lmcollect[\w.]*)`)? \| (.*?) \|", section, flags=re.M):
        packages, names = [p for p in row[:2] if p], re.findall(r"`(\w+)`", row[2])
        pairs += [(packages, name) for name in names]
    return [(" / ".join(packages), name) for packages, name in pairs]


@pytest.mark.parametrize(("packages", "name"), api_table_names(), ids=lambda v: str(v))
def test_every_name_of_the_readmes_api_table_imports_from_the_package_it_names(packages: str, name: str) -> None:
    modules = [importlib.import_module(package) for package in packages.split(" / ")]
    assert any(hasattr(module, name) for module in modules), f"{name} is not importable from {packages}"
