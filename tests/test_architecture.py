"""The layout rules of shared/DESIGN.md and docs/architecture.md, checked on the source tree.

Each rule is one a reader relies on to find their way: folders small enough to read, imports that
go one way, env knowledge only in envs/, contracts (not measurements) in docstrings.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("envs", "agents", "rollouts", "trainers", "configs")


def _library_files() -> list[Path]:
    return sorted(p for top in LIBRARY for p in (ROOT / top).rglob("*.py") if "__pycache__" not in p.parts)


def _imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, as an absolute toolgym.* name (relative imports resolved)."""
    package = ["toolgym", *path.relative_to(ROOT).parent.parts]  # the package the file is in
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []  # `.` is package
            module = ".".join(base + ([node.module] if node.module else []))
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def test_no_library_folder_holds_more_than_twelve_modules():
    crowded = {}
    for folder in {p.parent for p in _library_files()}:
        modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
        if len(modules) > 12:
            crowded[str(folder.relative_to(ROOT))] = len(modules)
    assert not crowded, f"group these folders by role (shared/DESIGN.md): {crowded}"


@pytest.mark.parametrize(
    ("folder", "forbidden"),
    [
        ("envs", ("toolgym.agents", "toolgym.rollouts", "toolgym.trainers", "toolgym.configs")),
        ("agents", ("toolgym.envs", "toolgym.rollouts", "toolgym.trainers", "toolgym.configs")),
        ("agents/kernels", ("toolgym.agents.engine", "toolgym.agents.vllm")),
        ("agents/model", ("toolgym.agents.engine", "toolgym.agents.kernels", "toolgym.agents.vllm")),
        ("trainers", ("toolgym.rollouts.runner", "toolgym.configs", "toolgym.envs")),
    ],
)
def test_imports_go_one_way(folder, forbidden):
    offenders = [
        f"{path.relative_to(ROOT)} imports {module}"
        for path in sorted((ROOT / folder).rglob("*.py"))
        for module in sorted(_imported_modules(path))
        if module.startswith(forbidden)
    ]
    assert not offenders, "\n".join(offenders)


def test_engine_reaches_kernels_only_through_the_backend_selector():
    offenders = [
        f"{path.relative_to(ROOT)} imports {module}"
        for path in sorted((ROOT / "agents" / "engine").glob("*.py"))
        if path.name != "backend.py"
        for module in sorted(_imported_modules(path))
        if module.startswith("toolgym.agents.kernels")
    ]
    assert not offenders, "\n".join(offenders)


def test_no_env_vocabulary_outside_envs():
    pattern = re.compile(r"tag_rate|\[ANSWER\]")
    offenders = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in _library_files()
        if path.parts[len(ROOT.parts)] != "envs"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not offenders, "env-specific metrics or answer formats in generic layers:\n" + "\n".join(offenders)


def test_library_code_names_no_machine_and_states_no_timing():
    # Measurements live in bench/RESULTS.md; a docstring may point there.
    pattern = re.compile(r"EPYC|Xeon|\bZen\b|\d\s*(ms|us|µs)\b|tok/s|tokens/s")
    offenders = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in _library_files()
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not offenders, "\n".join(offenders)
