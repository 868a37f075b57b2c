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
        if uid is not None:
            members = self.by_uid.get(uid, [])
        else:
            members = self.by_pgid.get(pgid, []) if pgid is not None else []
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


_MEMORY_FS = {"tmpfs", "ramfs", "hugetlbfs", "devtmpfs"}
_SHMEM = ("/memfd:", "/SYSV")  # memfds and System V segments: memory, whatever their link count


def hidden_bytes(pids: list[int]) -> tuple[int, int]:
    """(memory, disk) held by `pids` in files no path leads to, which neither their resident
    memory nor a walk of the workspace sees: memfds and deleted files on tmpfs as memory, other
    deleted-but-open files as disk. Found by descriptor (of every thread: a thread may have a
    table of its own) and by mapping (a mapped file stays after its descriptor is closed), each
    file once. A mapped memfd's touched pages count in the resident memory too, as shared pages
    do there: the sum is never less than what the unit holds."""
    seen: set[tuple[int, int]] = set()
    memory_fs: dict[str, set[int]] = {}  # devices of memory filesystems, by mount namespace
    memory = disk = 0
    for pid in pids:
        for path, shmem in _hidden_files(pid):
            try:
                info = os.stat(path)  # the open file itself (these links are followed by the kernel)
            except OSError:
                continue
            key = (info.st_dev, info.st_ino)
            if key in seen or not stat.S_ISREG(info.st_mode):
                continue
            seen.add(key)
            if not shmem and info.st_nlink:
                continue  # still reachable by a path: counted where that path is, if anywhere
            if shmem or info.st_dev in _memory_devices(pid, memory_fs):
                memory += info.st_blocks * 512
            else:
                disk += info.st_blocks * 512
    return memory, disk


def _hidden_files(pid: int):
    """(a path under /proc/<pid> that opens the file, whether it is a memfd or System V segment)
    for each descriptor and mapping of the process that holds a memfd or a deleted file."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return
    for tid in tasks:
        directory = f"/proc/{pid}/task/{tid}/fd"
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        for name in names:
            try:
                target = os.readlink(f"{directory}/{name}")
            except OSError:
                continue
            if target.startswith(_SHMEM) or target.endswith(" (deleted)"):
                yield f"{directory}/{name}", target.startswith(_SHMEM)
    try:
        with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as maps:
            lines = [line for line in maps if line.rstrip().endswith(" (deleted)")]
    except OSError:
        return
    for line in lines:
        fields = line.split(maxsplit=5)
        # Shared anonymous memory (/dev/zero) lives only while mapped: in the resident count.
        if len(fields) == 6 and fields[4] != "0" and not fields[5].startswith("/dev/zero"):
            yield f"/proc/{pid}/map_files/{fields[0]}", fields[5].startswith(_SHMEM)


def _memory_devices(pid: int, cache: dict[str, set[int]]) -> set[int]:
    try:
        namespace = os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        namespace = ""
    if namespace not in cache:
        devices = set()
        try:
            with open(f"/proc/{pid}/mountinfo", encoding="utf-8", errors="replace") as mounts:
                for line in mounts:
                    fields = line.split()
                    if " - " in line and fields[fields.index("-") + 1] in _MEMORY_FS:
                        major, minor = fields[2].split(":")
                        devices.add(os.makedev(int(major), int(minor)))
        except (OSError, ValueError):
            pass
        cache[namespace] = devices
    return cache[namespace]


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


def namespace_members(outer_pid: int) -> tuple[list[int], int]:
    """The processes of the PID namespace whose first process is a child of `outer_pid` (the
    launcher, become bubblewrap), and their task count."""
    try:
        children = Path(f"/proc/{outer_pid}/task/{outer_pid}/children").read_text().split()
        namespace = os.readlink(f"/proc/{children[0]}/ns/pid") if children else None
    except OSError:
        namespace = None
    if namespace is None:
        return [], 0
    pids, tasks = [], 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.readlink(f"/proc/{name}/ns/pid") != namespace:
                continue
            status = Path(f"/proc/{name}/status").read_text()
        except OSError:
            continue
        pids.append(int(name))
        for line in status.splitlines():
            if line.startswith("Threads:"):
                tasks += int(line.split()[1])
                break
    return pids, tasks
