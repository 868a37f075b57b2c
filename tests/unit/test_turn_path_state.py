"""No module of sessions_app keeps state about turns: what a worker keeps about the turns it
runs (registries, heartbeats, caches) belongs to a `sessions_app.engine.worker.Worker`, so two of
them in one process share nothing (tests/turns/test_workers.py). Read from the source: a
module-level name bound to a container, a lock or an instance (UPPER_CASE names are
constants), or rebound through `global`, fails here unless it is listed below with the reason it is one per process."""

from __future__ import annotations

import ast

from tests.support import ROOT

# (module path, name): why one per process is right.
PER_PROCESS = {
    ("sessions_app/engine/worker.py", "_current"): "which Worker is this process's, for Celery's signals and wake-ups",
    ("sessions_app/engine/worker.py", "_embedded_lock"): "the embedded mode builds this process's Worker once",
    ("sessions_app/engine/host.py", "_loop"): "the runtime loop: runtime instances keep agent processes on it",
    ("sessions_app/engine/host.py", "_loop_lock"): "the runtime loop is built once per process",
}
CONTAINERS = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)
MUTABLE_FACTORIES = {"dict", "list", "set", "defaultdict", "OrderedDict", "deque", "Counter"}


def _called(node: ast.expr) -> str:
    func = node.func if isinstance(node, ast.Call) else None
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return ""


def _kept_state(tree: ast.Module) -> set[str]:
    """Module-level names bound to a mutable value, or rebound inside a function."""
    names = set()
    for node in tree.body:
        targets, value = [], None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        for target in targets:
            # UPPER_CASE names are constants: read, never changed.
            if not isinstance(target, ast.Name) or target.id.isupper() or target.id == "__all__":
                continue
            called = _called(value)
            if isinstance(value, CONTAINERS) or called in MUTABLE_FACTORIES or called[:1].isupper():
                names.add(target.id)
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            names.update(node.names)
    return names


def test_no_module_keeps_state_about_turns():
    found = set()
    for path in sorted((ROOT / "sessions_app").rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if "/migrations/" in relative:
            continue
        found |= {(relative, name) for name in _kept_state(ast.parse(path.read_text(), relative))}
    assert found <= PER_PROCESS.keys(), sorted(found - PER_PROCESS.keys())


def test_the_check_sees_what_it_looks_for():
    source = "_seen = {}\n_lock = threading.Lock()\nLIMITS = {'a': 1}\ndef f():\n    global _other\n"
    assert _kept_state(ast.parse(source)) == {"_seen", "_lock", "_other"}
