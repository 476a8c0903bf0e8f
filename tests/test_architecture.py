"""The layout rules of shared/DESIGN.md and docs/architecture.md, checked on the source tree.

Each rule is one a reader relies on to find their way: folders of one role (and a generous size
guard), imports that go one way and never in a circle, a loop without mode branches, env
knowledge only in envs/, contracts (not measurements) in docstrings, pages short enough to read.
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


def _module_name(path: Path) -> str:
    parts = ["toolgym", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_library_folder_holds_more_than_fifteen_modules():
    # A guard, not the rule: a folder holds one role (shared/DESIGN.md), whatever its count.
    crowded = {}
    for folder in {p.parent for p in _library_files()}:
        modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
        if len(modules) > 15:
            crowded[str(folder.relative_to(ROOT))] = len(modules)
    assert not crowded, f"group these folders by role (shared/DESIGN.md): {crowded}"


def test_no_import_cycle_in_the_library():
    """Every import counts, those inside functions too: an import moved into a function still
    ties the two modules together, it only hides the circle until run time."""
    modules = {_module_name(p): p for p in _library_files()}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for imported in _imported_modules(path):
            # `from .x import y` names x.y: the module x.y if there is one, else x
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        graph[name] = targets
    # Tarjan's strongly connected components
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, "import cycles:\n" + "\n".join(", ".join(c) for c in cycles)


def test_the_rl_loop_has_no_mode_branches():
    """The loop takes batches from a source (trainers/loop/sources.py); sync, async and
    generator ranks are sources, never branches of the loop."""
    code = (ROOT / "trainers" / "loop" / "rl.py").read_text()
    tree = ast.parse(code)
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
    }
    assert not names & {"mode", "split", "generators", "producer", "rank_groups", "placement"}


@pytest.mark.parametrize(("page", "limit"), [("README.md", 300), ("bench/RESULTS.md", 600)])
def test_the_pages_stay_short(page, limit):
    lines = len((ROOT / page).read_text().splitlines())
    assert lines < limit, f"{page} has {lines} lines (< {limit}): move the detail to docs/ (history: git log -p)"


@pytest.mark.parametrize(
    ("folder", "forbidden"),
    [
        ("envs", ("toolgym.agents", "toolgym.rollouts", "toolgym.trainers", "toolgym.configs")),
        ("agents", ("toolgym.envs", "toolgym.rollouts", "toolgym.trainers", "toolgym.configs")),
        ("agents/kernels", ("toolgym.agents.engine", "toolgym.agents.vllm")),
        ("agents/model", ("toolgym.agents.engine", "toolgym.agents.kernels", "toolgym.agents.vllm")),
        ("trainers", ("toolgym.rollouts.episode", "toolgym.configs", "toolgym.envs", "toolgym.agents.engine")),
        ("rollouts", ("toolgym.trainers", "toolgym.configs")),
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


# The optional env and policy hooks, declared with their defaults on TextEnv (envs/core/text_env.py,
# read off a plain gymnasium.Env by `env_hooks` there) and on the Policy protocol (agents/policy.py).
DECLARED_HOOKS = {
    "step_waits",
    "context_policy",
    "abandon",
    "oracle_actions",
    "malformed_action",
    "answer_action",
    "wrong_note_actions",
    "wrong_lookup_actions",
    "max_seq_len",
}


def test_rollouts_call_the_declared_hooks_and_never_look_them_up():
    offenders = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.func.id}(..., {node.args[1].value!r})"
        for path in sorted((ROOT / "rollouts").rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("getattr", "hasattr")
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
        and node.args[1].value in DECLARED_HOOKS
    ]
    assert not offenders, "call the declared hook (or envs' env_hooks for a plain env):\n" + "\n".join(offenders)


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


# What turns rewards into advantages (rollouts/scoring/: the estimators, turn-level credit, the
# over-stale scaling). The scorer's entry points (`score_group`, `score_recorded`) call them.
ADVANTAGE_MAKERS = frozenset(
    {
        "group_advantages",
        "batch_advantages",
        "shaped_rewards",
        "turn_loo_advantages",
        "group_turn_advantages",
        "scale_advantage",
    }
)


def _names(path: Path) -> set[str]:
    """Every name a module uses, reads an attribute of, or imports."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.ImportFrom):
            names.update(alias.name for alias in node.names)
    return names


def test_advantages_are_made_only_by_the_scorer():
    """ONE scorer (shared/DESIGN.md): no library module outside rollouts/scoring/ names an
    estimator, a turn-level credit function or the over-stale scaling; trainers/ receives finished
    advantages, so it names no scorer either."""
    scoring = ROOT / "rollouts" / "scoring"
    offenders = []
    for path in _library_files():
        if scoring in path.parents:
            continue
        forbidden = ADVANTAGE_MAKERS
        if path.parts[len(ROOT.parts)] == "trainers":
            forbidden = forbidden | {"score_group", "score_recorded"}
        offenders += [f"{path.relative_to(ROOT)} names {name}" for name in sorted(_names(path) & forbidden)]
    assert not offenders, "advantages are made in rollouts/scoring/ only:\n" + "\n".join(offenders)


def test_no_default_advantage_config_outside_config_loading():
    """`AdvantageConfig()` is the config schema's default; anywhere else it would score with a
    config the run may not have used (replay and the viewer read the run's from its recording)."""
    allowed = {ROOT / "configs" / "schema.py", ROOT / "configs" / "load.py"}
    offenders = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path in [*_library_files(), *sorted((ROOT / "bench").glob("*.py"))]
        if path not in allowed
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and not node.args
        and not node.keywords
        and (node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None))
        == "AdvantageConfig"
    ]
    assert not offenders, "AdvantageConfig() outside config loading:\n" + "\n".join(offenders)


def test_only_the_fallback_module_imports_transformers():
    """transformers is an optional extra: the library reaches it through agents/model/hf_fallback.py
    (policy.implementation = "transformers") only."""
    allowed = ROOT / "agents" / "model" / "hf_fallback.py"
    offenders = [
        f"{path.relative_to(ROOT)} imports {module}"
        for path in _library_files()
        if path != allowed
        for module in sorted(_imported_modules(path))
        if module == "transformers" or module.startswith("transformers.")
    ]
    assert not offenders, "\n".join(offenders)


def test_the_base_install_s_commands_import_without_the_extras():
    """`pip install toolgym` (no extras) runs train, record, replay and view: their modules import
    with the serve extra's packages (FastAPI, uvicorn, openai, jsonschema) and transformers absent."""
    import subprocess
    import sys

    blocked = ["fastapi", "uvicorn", "openai", "jsonschema", "transformers", "mcp"]
    code = (
        "import sys\n"
        f"for name in {blocked!r}: sys.modules[name] = None\n"
        "import toolgym.configs.cli.main, toolgym.configs.cli.rollout, toolgym.configs.cli.train\n"
        "import toolgym.configs.cli.recordings\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
