"""The resource limits of a sandboxed ACP agent's isolation unit, and how a running unit is
measured against them (its processes, resident memory and disk use; the exit signals that
mean a limit was hit). The kernel enforces what it can per process (rlimits, set by the
launcher); what only adds up across the unit's processes is checked here."""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path

MiB = 1024 * 1024

LIMIT_DEFAULTS = {"memoryMiB": 2048, "cpuSeconds": 3600, "processes": 256, "diskMiB": 1024, "openFiles": 1024}
LIMITS_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "properties": {name: {"type": "integer", "minimum": 1} for name in LIMIT_DEFAULTS},
}


@dataclass(frozen=True)
class Limits:
    memory_bytes: int
    cpu_seconds: int
    processes: int
    disk_bytes: int
    open_files: int

    @classmethod
    def parse(cls, config: dict | None) -> Limits:
        values = {**LIMIT_DEFAULTS, **(config or {})}
        return cls(
            memory_bytes=int(values["memoryMiB"]) * MiB,
            cpu_seconds=int(values["cpuSeconds"]),
            processes=int(values["processes"]),
            disk_bytes=int(values["diskMiB"]) * MiB,
            open_files=int(values["openFiles"]),
        )


_PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class Snapshot:
    """Every process on the host at one moment, by uid and by process group: (pid, threads)."""

    by_uid: dict[int, list[tuple[int, int]]]
    by_pgid: dict[int, list[tuple[int, int]]]

    def unit(self, *, uid: int | None, pgid: int | None) -> tuple[list[int], int]:
        """A unit's processes (by its uid, or by process group without one) and their task count."""
        members = self.by_uid.get(uid, []) if uid is not None else self.by_pgid.get(pgid, [])
        return [pid for pid, _ in members], sum(threads for _, threads in members)


def snapshot() -> Snapshot:
    """One pass over /proc (shared by every unit's check: one pass per interval, not per unit)."""
    by_uid: dict[int, list[tuple[int, int]]] = {}
    by_pgid: dict[int, list[tuple[int, int]]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            status = Path(f"/proc/{name}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        try:
            entry = (int(name), int(fields.get("Threads", "1")))
            by_uid.setdefault(int(fields["Uid"].split()[0]), []).append(entry)
            by_pgid.setdefault(int(fields["NSpgid"].split()[0]), []).append(entry)
        except (KeyError, ValueError, IndexError):
            continue
    return Snapshot(by_uid, by_pgid)


def resident_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * _PAGE
        except (OSError, IndexError, ValueError):
            continue
    return total


def disk_bytes(paths) -> int:
    """Bytes allocated under `paths` (links not followed; each inode counted once)."""
    seen, total = set(), 0
    stack = [str(path) for path in paths]
    while stack:
        top = stack.pop()
        try:
            with os.scandir(top) as entries:
                for entry in entries:
                    try:
                        info = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    if (info.st_dev, info.st_ino) in seen:
                        continue
                    seen.add((info.st_dev, info.st_ino))
                    total += info.st_blocks * 512
                    if stat.S_ISDIR(info.st_mode):
                        stack.append(entry.path)
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.ENOTDIR, errno.EACCES):
                raise
    return total


def mib(value: int) -> str:
    return f"{value / MiB:g} MiB"


_SIGNAL_SENTENCES = {
    24: "The agent used its CPU-time limit of {cpu} seconds; its process was stopped.",  # SIGXCPU
    25: "The agent wrote a file larger than its disk limit of {disk}; its process was stopped.",  # SIGXFSZ
}


def exit_sentence(code: int, limits: Limits) -> str | None:
    """A limit the exit code shows the agent ran into, as a sentence."""
    text = _SIGNAL_SENTENCES.get(-code) if code < 0 else None
    return text.format(cpu=limits.cpu_seconds, disk=mib(limits.disk_bytes)) if text else None
