"""The import rules of docs/architecture.md, read from the source with `ast` so they stay true.

- no import cycles between modules (imports inside functions and under TYPE_CHECKING count too);
- the engine imports nothing of the supervisor side (resilience, validator, integrations, cli);
- the supervisor side never imports torch, and never the engine or RL's training half;
  only the CLI may reach the engine, lazily, inside a command that needs it;
- RL's torch-free half (what lint, preflight and the supervisor import) never imports its training half;
- the job contract imports nothing of the package, and its other half (rundir) only the contract;
- prime_train's direct children stand in layers (LAYERS): each imports only its own layer's bottom modules
  or layers below it, so no two of them import each other, however indirectly.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "prime_train"

# what the supervisor process runs; config/ is shared by both sides (the engine reads the resolved config)
SUPERVISOR_SIDE = (
    "prime_train.resilience",
    "prime_train.kit",
    "prime_train.validator",
    "prime_train.integrations",
    "prime_train.sweep",
    "prime_train.cli",
)
TORCH_FREE = (*SUPERVISOR_SIDE, "prime_train.config")
TORCH_FREE_TOP = (
    "prime_train.contract",
    "prime_train.rundir",
    "prime_train.retention",
    "prime_train.launch",
    "prime_train.tasks",
    "prime_train.vocab",
)
RL_TORCH_FREE = (
    "prime_train.environments",
    "prime_train.reward_scorer",
    "prime_train.rl.budget",
    "prime_train.rl.workers",
    "prime_train.rl.client",
    "prime_train.rl.rollouts",
    "prime_train.rl.vllm_server",
)
RL_TRAINING = (
    "prime_train.rl.grpo",
    "prime_train.rl.ppo",
    "prime_train.rl.train",
    "prime_train.rl.generation",
    "prime_train.rl.worker",
    "prime_train.rl.pairs",
)
HEAVY = (
    "torch",
    "transformers",
    "safetensors",
    "numpy",
    "tokenizers",
    "wandb",
    "boto3",
    "vllm",
    "sky",
    "mlflow",
    "clearml",
    "neptune",
)


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # a module of prime_train, or a third-party top-level name
    lazy: bool  # inside a function (or under `if TYPE_CHECKING`), not executed at import time
    line: int


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def _resolve(name: str) -> str | None:
    """The prime_train module `name` refers to: itself, or the package holding it (an attribute import)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(module: str) -> list[Import]:
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    found: list[Import] = []

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            child_lazy = lazy or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            if isinstance(child, ast.If) and _is_type_checking(child):
                child_lazy = True
            if isinstance(child, ast.Import):
                for alias in child.names:
                    found.append(Import(module, _resolve(alias.name) or alias.name.split(".")[0], lazy, child.lineno))
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parent = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join([*parent, base]).strip(".")
                if not base.startswith("prime_train"):
                    found.append(Import(module, base.split(".")[0], lazy, child.lineno))
                    continue
                for alias in child.names:
                    target = _resolve(f"{base}.{alias.name}") or _resolve(base)
                    found.append(Import(module, target, lazy, child.lineno))
            visit(child, child_lazy)

    visit(tree, False)
    return [i for i in found if i.target != module]


IMPORTS = {m: imports_of(m) for m in MODULES}


def under(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def where(i: Import) -> str:
    return f"{MODULES[i.source].relative_to(PACKAGE.parent)}:{i.line} imports {i.target}"


def test_the_import_reader_sees_lazy_type_checking_and_relative_imports(tmp_path):
    # the reader is what keeps these rules true: check it on the shapes of import it must see
    assert any(i.target == "prime_train.contract" and not i.lazy for i in IMPORTS["prime_train.resilience.supervisor"])
    lazy = [i for i in IMPORTS["prime_train.rl.budget"] if i.lazy]
    assert lazy, "rl.budget imports inside functions and under TYPE_CHECKING; the reader must see them"
    assert "prime_train.engine.export" in {i.target for i in IMPORTS["prime_train.engine.loop"]}


def test_no_import_cycles_between_modules():
    graph = {m: sorted({i.target for i in IMPORTS[m] if i.target in MODULES}) for m in MODULES}
    # Tarjan's strongly connected components: any component of two or more modules is a cycle
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strongconnect(w)
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

    for v in sorted(graph):  # the import graph is ~100 modules deep at most: far within the recursion limit
        if v not in index:
            strongconnect(v)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_engine_imports_nothing_of_the_supervisor_side():
    bad = [
        where(i)
        for m, found in IMPORTS.items()
        if under(m, ("prime_train.engine", *RL_TRAINING))
        for i in found
        if under(i.target, SUPERVISOR_SIDE)
    ]
    assert not bad, "\n".join(sorted(set(bad)))


@pytest.mark.parametrize("side", ["supervisor", "rl-torch-free", "top-level"])
def test_the_supervisor_side_never_imports_torch_or_the_engine(side):
    """Supervisor-side modules other than the CLI never import the engine, even lazily; heavy libraries only lazily."""
    prefixes = {"supervisor": TORCH_FREE, "rl-torch-free": RL_TORCH_FREE, "top-level": TORCH_FREE_TOP}[side]
    bad = []
    for m, found in IMPORTS.items():
        if not under(m, prefixes) or under(m, ("prime_train.cli",)):
            continue  # the CLI has its own rule below
        for i in found:
            if under(i.target, ("prime_train.engine", *RL_TRAINING)):
                bad.append(where(i) + " (the engine: only the job's processes load it)")
            elif i.target in HEAVY and not i.lazy:
                bad.append(where(i) + " at module top level")
    assert not bad, "\n".join(sorted(set(bad)))


def test_the_cli_reaches_the_engine_only_lazily():
    bad = [
        where(i)
        for m, found in IMPORTS.items()
        if under(m, ("prime_train.cli",))
        for i in found
        if not i.lazy and (i.target in HEAVY or under(i.target, ("prime_train.engine", *RL_TRAINING)))
    ]
    assert not bad, "\n".join(sorted(set(bad)))


def test_the_contract_imports_nothing_of_the_package():
    assert not [where(i) for i in IMPORTS["prime_train.contract"] if i.target.startswith("prime_train")]
    # the run directory's half of the contract leans on the contract alone
    assert {i.target for i in IMPORTS["prime_train.rundir"] if i.target.startswith("prime_train")} == {
        "prime_train.contract"
    }


def test_importing_every_supervisor_side_module_loads_no_torch():
    # the static rules above, checked once for real: transitive imports included
    names = [m for m in MODULES if under(m, (*TORCH_FREE, *RL_TORCH_FREE, *TORCH_FREE_TOP))]
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        f"loaded = sorted(m for m in {HEAVY!r} if m in sys.modules)\n"
        "print(','.join(loaded))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "", f"heavy modules loaded by the supervisor side: {result.stdout.strip()}"


# prime_train's direct children, bottom first (docs/architecture.md "The layers"). A package imports only from
# layers below its own; the modules of the bottom layer may also import each other.
LAYERS = (
    ("contract", "rundir", "retention", "tasks", "vocab", "environments", "reward_scorer", "cpu_share"),
    ("config",),
    ("kit",),
    ("engine",),
    ("rl",),
    ("integrations",),
    ("launch",),
    ("validator",),
    ("resilience",),
    ("sweep",),
    ("cli",),
    ("__main__",),
)


def _child(module: str) -> str | None:
    """The direct child of prime_train a module belongs to (None for the package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_every_direct_child_of_the_package_has_a_layer():
    layered = {name for layer in LAYERS for name in layer}
    children = {c for m in MODULES if (c := _child(m)) is not None}
    assert children == layered, f"without a layer: {sorted(children - layered)}; gone: {sorted(layered - children)}"


def test_the_packages_import_only_downward_through_the_layers():
    level = {name: n for n, layer in enumerate(LAYERS) for name in layer}
    bad = []
    for m, found in IMPORTS.items():
        source = _child(m)
        for i in found:
            target = _child(i.target) if i.target.startswith("prime_train.") else None
            if source is None or target is None or target == source:
                continue
            if level[target] > level[source] or (level[target] == level[source] and level[source] != 0):
                bad.append(f"{where(i)} ({source} is layer {level[source]}, {target} layer {level[target]})")
    assert not bad, "\n".join(sorted(set(bad)))


def test_no_source_file_is_over_800_lines():
    long = {
        str(p.relative_to(PACKAGE.parent)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 800
    }
    assert not long, long


MAX_FUNCTION_LINES = 100


def test_no_function_over_100_lines():
    # every def, methods and nested functions included, from its `def` line to its last line
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                long.append(f"prime_train/{relative}:{node.lineno} {node.name} {length} lines")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them by meaning):\n" + "\n".join(long)


def _event_names(tree: ast.AST) -> list[tuple[ast.expr, int]]:
    """The event names a module gives: the first argument of every `.emit(...)` on an event log (not the CLI's
    output.emit, which prints) and of every `note(...)` (kit/observe: an event a watcher saw, for the supervisor
    to record), and the value of every "event" key of a dict literal."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "emit":
            printed = isinstance(node.func.value, ast.Name) and node.func.value.id == "output"
            if node.args and not printed:
                found.append((node.args[0], node.lineno))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("note", "Note"):
            found += [(node.args[0], node.lineno)] if node.args else []
        elif isinstance(node, ast.Dict):
            pairs = zip(node.keys, node.values, strict=True)
            found += [(v, node.lineno) for k, v in pairs if isinstance(k, ast.Constant) and k.value == "event"]
    return found


def test_every_event_the_package_records_is_named_from_the_contracts_catalogue():
    from prime_train.contract import Event

    emitted: set[str] = set()
    stray = []
    for name, path in MODULES.items():
        if name in ("prime_train.kit.events", "prime_train.kit.observe"):
            continue  # EventLog and Note themselves, which carry the name they are given
        for value, line in _event_names(ast.parse(path.read_text())):
            member = ast.unparse(value).removeprefix("Event.")
            if isinstance(value, ast.Attribute) and member in Event.__members__:
                emitted.add(Event[member].value)
            else:
                stray.append(f"{name}:{line}: {ast.unparse(value)}")
    assert not stray, f"events not named from contract.Event (add the name to the catalogue, emit Event.X): {stray}"
    assert emitted == {e.value for e in Event}, f"in the catalogue, never emitted: {sorted({*Event} - emitted)}"


def test_a_runs_paths_come_from_its_layout_never_from_a_run_directory_built_again_from_its_config():
    # RunDir(cfg.run_dir) would put the checkpoints in checkpoints/ whatever ckpt.dir says: Config.layout is the one
    # place a config's run directory is built (rundir.RunDir, docs/architecture.md "The layout")
    import re

    rebuilt = re.compile(r"RunDir\([^)]*\bcfg\b")
    found = [
        f"{name}:{n}"
        for name, path in MODULES.items()
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if rebuilt.search(line)
    ]
    assert not found, found


# a job's kind is its plan's (resilience/plan.py, docs/architecture.md "The packages"): the supervisor and its watchers
# run every kind the same way, and hear from a watcher only through the protocol (kit/observe.py), never by
# reading its attributes
KIND_FREE = tuple(f"prime_train.resilience.{m}" for m in ("supervisor", "watchers", "background"))
JOB_KINDS = ("command", "sft", "pretrain", "rl")


def _asks_the_kind(tree: ast.AST, *, side_channels: bool = True) -> list[tuple[int, str]]:
    """Where a module reads [job].command or run.job, compares with a kind's name, or (`side_channels`) reads an
    attribute by getattr/hasattr."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
            if (node.value.attr, node.attr) in (("job", "command"), ("run", "job")):
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(isinstance(s, ast.Constant) and s.value in JOB_KINDS for s in sides):
                found.append((node.lineno, ast.unparse(node)))
        elif side_channels and isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr"):
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_the_supervisor_never_asks_which_kind_of_job_it_runs():
    import re

    text = re.compile(r"job\.command|run\.job|==\s*[\"']rl[\"']")
    found = []
    for name in KIND_FREE:
        source = MODULES[name].read_text()
        found += [f"{name}:{n}: {line.strip()}" for n, line in enumerate(source.splitlines(), 1) if text.search(line)]
        # a watcher may read its own attributes by name; the supervisor and the watchers' thread never read a watcher's
        side_channels = name != "prime_train.resilience.watchers"
        found += [f"{name}:{n}: {code}" for n, code in _asks_the_kind(ast.parse(source), side_channels=side_channels)]
    assert not found, "ask the plan (resilience/plan.py) or the watcher's Observation instead:\n" + "\n".join(found)
    # the reader sees what it must
    assert _asks_the_kind(ast.parse("cfg.job.command or self.cfg.run.job == 'rl'"))
    assert _asks_the_kind(ast.parse("getattr(w, 'failure', None)"))
