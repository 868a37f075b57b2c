"""Control groups of sandboxed agent processes: the kernel's own accounting of a unit's
process tree (its memory, page cache, tmpfs, shmem and memfds included, its processes and
CPU share), and a kill that reaches every process of it whatever it did to leave its
process group. One group per agent process (a unit runs one process per worker).

Two layouts are understood:

- **cgroup v2** (unified): `AAP_SANDBOX_CGROUP` names a directory the service may write (a
  delegated subtree: under systemd `Delegate=yes`, in Kubernetes/Docker a writable cgroup
  namespace), or, as root on a unified host, `/sys/fs/cgroup/aap` is used. Units are its
  children, with `memory.max`, `memory.swap.max`, `pids.max` and `cpu.weight`; a unit is
  killed with `cgroup.kill`.
- **cgroup v1** (the `memory`, `pids` and `cpu` hierarchies mounted separately), as root:
  `<hierarchy>/<the worker's group>/aap/<unit-process>` in each, with `memory.limit_in_bytes` (and `memsw` where
  accounted), `pids.max` and `cpu.shares`.

Where neither can be written, `layout()` says why and the sandbox keeps its rlimits and the
/proc poller (limits.py); the reason is logged once.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import secrets
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings

from .limits import Limits

logger = logging.getLogger("agents.runtimes.acp")

ROOT = Path("/sys/fs/cgroup")
V1_CONTROLLERS = ("memory", "pids", "cpu")
CPU_WEIGHT = 100  # v2 default: every unit the same share, whatever it runs
CPU_SHARES = 1024  # v1 default


@dataclass(frozen=True)
class Layout:
    version: int  # 1 or 2
    bases: tuple[Path, ...]  # v2: one directory; v1: one per controller, in V1_CONTROLLERS order


@dataclass(frozen=True)
class UnitGroup:
    """The cgroup(s) of one isolation unit."""

    layout: Layout
    dirs: tuple[Path, ...]

    @property
    def procs_files(self) -> list[str]:
        return [str(directory / "cgroup.procs") for directory in self.dirs]

    def _file(self, controller: str, name: str) -> Path:
        if self.layout.version == 2:
            return self.dirs[0] / name
        return self.dirs[V1_CONTROLLERS.index(controller)] / name

    def pids(self) -> list[int]:
        found: set[int] = set()
        for directory in self.dirs:
            try:
                found.update(int(line) for line in (directory / "cgroup.procs").read_text().split())
            except (OSError, ValueError):
                continue
        return sorted(found)

    def tasks(self) -> int:
        try:
            return int(self._file("pids", "pids.current").read_text())
        except (OSError, ValueError):
            return 0

    def oom_kills(self) -> int:
        """How many processes the kernel killed for this unit's memory limit."""
        name = "memory.events" if self.layout.version == 2 else "memory.oom_control"
        try:
            for line in self._file("memory", name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def kill(self) -> None:
        """Kill every process of the unit and wait (bounded) until none is left."""
        if self.layout.version == 2:
            with contextlib.suppress(OSError):
                (self.dirs[0] / "cgroup.kill").write_text("1")
        deadline = time.monotonic() + 10
        while True:
            pids = self.pids()
            if not pids or time.monotonic() > deadline:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    continue
            time.sleep(0.02)

    def remove(self) -> None:
        """Kill what is left and remove the unit's directories."""
        self.kill()
        for directory in self.dirs:
            try:
                directory.rmdir()
            except OSError:
                continue


def _writable(path: Path) -> bool:
    return path.is_dir() and os.access(path, os.W_OK)


@functools.cache
def layout() -> Layout | str:
    """Where units' cgroups go, or a phrase saying why there are none."""
    configured = getattr(settings, "AAP_SANDBOX_CGROUP", "")
    if configured == "off":
        return "AAP_SANDBOX_CGROUP is off"
    if configured:
        base = Path(configured)
        if not (base / "cgroup.controllers").exists():
            return f"AAP_SANDBOX_CGROUP={configured} is not a cgroup v2 directory"
        return _v2(base)
    if (ROOT / "cgroup.controllers").exists():
        if os.geteuid() != 0:
            return "no delegated cgroup v2 subtree (set AAP_SANDBOX_CGROUP)"
        return _v2(ROOT / "aap")
    bases = tuple(ROOT / controller / _own_v1(controller) for controller in V1_CONTROLLERS)
    if all(_writable(base) for base in bases):
        try:
            for base in bases:
                (base / "aap").mkdir(exist_ok=True)
        except OSError as exc:
            return f"the cgroup v1 hierarchies cannot be written ({type(exc).__name__})"
        return Layout(1, tuple(base / "aap" for base in bases))
    return "no writable cgroup hierarchy (cgroup v2 with a delegated subtree, or v1 as root)"


def _own_v1(controller: str) -> str:
    """This process's own group in a v1 hierarchy (units nest below it, inside its limits)."""
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, names, path = line.split(":", 2)
            if controller in names.split(","):
                return path.lstrip("/")
    except (OSError, ValueError):
        pass
    return ""


def _v2(base: Path) -> Layout | str:
    try:
        base.mkdir(exist_ok=True)
        wanted = {"memory", "pids", "cpu"}
        available = set((base / "cgroup.controllers").read_text().split())
        if not wanted <= available:
            return f"the cgroup {base} lacks the controllers {', '.join(sorted(wanted - available))}"
        enabled = set((base / "cgroup.subtree_control").read_text().split())
        if not wanted <= enabled:
            (base / "cgroup.subtree_control").write_text(" ".join("+" + name for name in sorted(wanted - enabled)))
    except OSError as exc:
        return f"the cgroup {base} cannot be set up ({type(exc).__name__})"
    return Layout(2, (base,))


def _name(unit: str) -> str:
    """The unit's group name: its name within this installation (the workspace root), so two
    services on one host (or two test suites) never share, nor kill, each other's groups."""
    scoped = f"{os.path.realpath(settings.AAP_WORKSPACE_ROOT)}\0{unit}"
    return "unit-" + hashlib.sha256(scoped.encode()).hexdigest()[:24]


def create(unit: str, limits: Limits) -> UnitGroup | None:
    """A cgroup (or one per v1 hierarchy) for one process of the unit and everything it
    starts, with the unit's limits (None where there are no cgroups). Each process gets a group
    of its own: two workers on one host may each hold a process of the same unit (a session
    moved between them), and stopping one must not touch the other."""
    found = layout()
    if isinstance(found, str):
        return None
    name = f"{_name(unit)}-{secrets.token_hex(4)}"
    group = UnitGroup(found, tuple(base / name for base in found.bases))
    for directory in group.dirs:
        directory.mkdir()
    memory = str(limits.memory_bytes)
    if found.version == 2:
        directory = group.dirs[0]
        (directory / "memory.max").write_text(memory)
        _try_write(directory / "memory.swap.max", "0")
        (directory / "pids.max").write_text(str(limits.processes))
        _try_write(directory / "cpu.weight", str(CPU_WEIGHT))
    else:
        memory_dir, pids_dir, cpu_dir = group.dirs
        _try_write(memory_dir / "memory.memsw.limit_in_bytes", "-1")  # lower memsw only after the limit
        (memory_dir / "memory.limit_in_bytes").write_text(memory)
        _try_write(memory_dir / "memory.memsw.limit_in_bytes", memory)
        (pids_dir / "pids.max").write_text(str(limits.processes))
        _try_write(cpu_dir / "cpu.shares", str(CPU_SHARES))
    return group


def _try_write(path: Path, value: str) -> None:
    with contextlib.suppress(OSError):
        path.write_text(value)
