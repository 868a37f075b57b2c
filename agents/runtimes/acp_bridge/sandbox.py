"""The ACP sandbox, worker side: what an agent process may reach, and how it is started.

Every ACP agent process (and every `terminal/*` command) is started through the launcher
`sandbox_exec.py`, which confines itself before it execs the agent (see its docstring).
This module decides the policy: the mode (`mode()`: namespaces under bubblewrap where the
host allows it, else the Landlock + seccomp fallback, logged with the reason), the
isolation unit and its uid (when the service runs as root), the directories it may write
(its workspace(s) and HOME) and read (the system and the agent's installation), its way out
(the egress proxy: a unix socket mounted into its network namespace, or a TCP port in the
fallback), its resource limits, and its environment, built from scratch and handed to the
launcher as data (`env_descriptor`), never as the launcher's own.

Where the host lacks what the mode in force needs, `gaps()` names it and the agent refuses
to start, unless the operator set `unsafeWithoutSandbox` for that agent.

Longer than ~400 lines on purpose: the policy is one security boundary, and its parts (the
mode, the unit's uid, its paths, its environment) are reviewed together.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings

from . import workspace
from .limits import Limits

logger = logging.getLogger("agents.runtimes.acp")

LAUNCHER = Path(__file__).with_name("sandbox_exec.py")
EXIT_SETUP_FAILED = 125  # sandbox_exec.EXIT_SETUP_FAILED
SETUP_PREFIX = "aap-sandbox: "
LANDLOCK_ABI_NEEDED = 6  # filesystem (1), TCP ports (4), signal and abstract-socket scoping (6)

EGRESS_SCHEMA = {
    "type": "array",
    "items": {"type": "string", "pattern": r"^([A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\]):[0-9]{1,5}$"},
}

SYSTEM_READ = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/proc", "/sys/devices/system/cpu")
DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
# /etc entries never granted, even when world-readable (unreadable ones are never granted).
ETC_HIDDEN = {
    "shadow",
    "shadow-",
    "gshadow",
    "gshadow-",
    "sudoers",
    "sudoers.d",
    "ssh",
    "ssl",
    "security",
    "credstore",
    "credstore.encrypted",
    ".pwd.lock",
}
ETC_SSL = ("/etc/ssl/certs", "/etc/ssl/openssl.cnf")


class SandboxError(Exception):
    """The sandbox cannot hold for this agent; the message is a sentence for the turn's error."""


@dataclass(frozen=True)
class SandboxSpec:
    """The confinement of one agent process (None on a ProcessSpec: the operator opted out)."""

    unit: str  # the isolation unit: "session:<tenant>/<session>" or "tenant:<tenant>/<key>"
    writable: tuple[Path, ...]  # read-write: workspace(s) and HOME
    read_paths: tuple[str, ...]  # the operator's extra read-only paths (the agent's installation)
    egress: tuple[str, ...]  # host:port the egress proxy lets through
    limits: Limits


# --- what the kernel offers -----------------------------------------------------------------


@functools.cache
def missing() -> tuple[str, ...]:
    """What this machine lacks for the sandbox, as phrases (empty when everything is there)."""
    gaps = []
    try:
        from py_landlock import get_abi_version

        abi = int(get_abi_version())
        if abi < LANDLOCK_ABI_NEEDED:
            gaps.append(f"Landlock ABI {LANDLOCK_ABI_NEEDED} (Linux 6.12 or later; this kernel offers ABI {abi})")
    except Exception as exc:  # a probe: any failure means the feature is missing
        logger.debug("sandbox probe: Landlock unavailable", exc_info=True)
        gaps.append(f"Landlock (Linux 6.12 or later with Landlock enabled; here: {type(exc).__name__})")
    try:
        import pyseccomp

        pyseccomp.get_api()
        if "Seccomp:" not in Path("/proc/self/status").read_text():
            gaps.append("seccomp filters in the kernel")
    except Exception as exc:  # a probe: any failure means the feature is missing
        logger.debug("sandbox probe: libseccomp unavailable", exc_info=True)
        gaps.append(f"libseccomp (the libseccomp2 package; here: {type(exc).__name__})")
    return tuple(gaps)


NAMESPACES_COST = (
    "agents share the host's network stack, process table and filesystem view, walled by Landlock and "
    "seccomp filters instead of namespaces of their own"
)


def _bwrap() -> str | None:
    return shutil.which("bwrap", path="/usr/bin:/bin:/usr/local/bin")


TRIAL_SECONDS = 30


@functools.cache
def namespaces_missing() -> tuple[str, ...]:
    """What this host lacks for the namespaces mode, as phrases (empty when it has it all):
    bubblewrap, and user namespaces for the user agents run as (tried once, for real).

    A trial run that does not finish in time proves nothing about the host (a busy one is
    slow): it raises SandboxError, which is not cached, so the next start tries again, and the
    `auto` mode never settles on the fallback because the host was busy."""
    bwrap = _bwrap()
    if bwrap is None:
        return ("bubblewrap (the bubblewrap package)",)
    try:
        import pyseccomp

        pyseccomp.get_api()
    except Exception as exc:  # a probe: any failure means the feature is missing
        logger.debug("sandbox probe: libseccomp unavailable", exc_info=True)
        return (f"libseccomp (the libseccomp2 package; here: {type(exc).__name__})",)
    probe_uid = settings.AAP_SANDBOX_UID_BASE + settings.AAP_SANDBOX_UID_COUNT if as_root() else -1
    try:
        done = subprocess.run(
            [sys.executable, "-I", str(LAUNCHER), "--probe", bwrap, str(probe_uid)],
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=TRIAL_SECONDS,
            check=False,
        )
    except subprocess.TimeoutExpired:  # the refused start logs this sentence (AgentProcess.spawn)
        raise SandboxError(
            f"The agent cannot start yet: the sandbox's trial run did not finish within {TRIAL_SECONDS} seconds "
            "(the host is busy). The next start tries again."
        ) from None
    except OSError as exc:
        return (f"user namespaces (the trial run failed: {type(exc).__name__})",)
    if done.returncode != 0:
        said = (done.stderr.strip().splitlines() or ["no message"])[-1][:200]
        return (f"user, PID and network namespaces for the agents' user (bubblewrap said: {said})",)
    return ()


@functools.cache
def mode() -> str:
    """The sandbox mode in force: "namespaces" or "fallback" (logged once, with the reason)."""
    wanted = settings.AAP_SANDBOX_MODE
    if wanted == "fallback":
        logger.warning("sandbox: the fallback mode is configured (AAP_SANDBOX_MODE=fallback): %s", NAMESPACES_COST)
        return "fallback"
    gaps = namespaces_missing()
    if not gaps or wanted == "namespaces":  # a configured mode that cannot hold refuses agents
        if not gaps:
            logger.info("sandbox: agents run in namespaces of their own (bubblewrap)")
        return "namespaces"
    logger.warning(
        "sandbox: this host lacks %s, so agents run in the fallback mode: %s", "; ".join(gaps), NAMESPACES_COST
    )
    return "fallback"


def gaps() -> tuple[str, ...]:
    """What the mode in force lacks here (empty when agents may start)."""
    return namespaces_missing() if mode() == "namespaces" else missing()


def refuse_sentence(gaps: tuple[str, ...]) -> str:
    return (
        "The agent cannot start: its sandbox needs " + "; ".join(gaps) + ". An operator can run it unconfined "
        "only by setting unsafeWithoutSandbox for this agent."
    )


def as_root() -> bool:
    return os.geteuid() == 0


def harden_host() -> None:
    """Make this process (a worker that starts agents) not dumpable: no same-uid process can
    read its memory or /proc/<pid>/environ, nor attach to it."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE
            logger.warning("could not make this process non-dumpable (errno %s)", ctypes.get_errno())
    except OSError as exc:
        logger.warning("could not make this process non-dumpable (%s)", type(exc).__name__)


# --- uids: one per isolation unit when the service runs as root -----------------------------


def _uid_dir() -> Path:
    return workspace.root() / ".uids"  # never a tenant: tenant names cannot start with a dot


def _uid_start(unit: str, count: int) -> int:
    """Where a unit's uid search starts: its name within this installation (the workspace
    root), so two services on one host seldom probe the same uids."""
    scoped = f"{os.path.realpath(workspace.root())}\0{unit}"
    return int.from_bytes(hashlib.sha256(scoped.encode()).digest()[:8], "big") % count


def unit_uid(unit: str) -> int:
    """The uid of an isolation unit: the same on every worker sharing the workspace root, and
    never another unit's (claimed with O_EXCL in `<root>/.uids/`, probing linearly)."""
    base, count = settings.AAP_SANDBOX_UID_BASE, settings.AAP_SANDBOX_UID_COUNT
    directory = workspace.ensure_dir(_uid_dir())
    start = _uid_start(unit, count)
    for step in range(count):
        uid = base + (start + step) % count
        path = directory / str(uid)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            if path.read_text() == unit:
                return uid
            continue
        with os.fdopen(fd, "w") as handle:
            handle.write(unit)
        kill_uid(uid)  # a uid claimed anew carries nothing of a unit that had it before
        return uid
    raise SandboxError("The agent cannot start: every sandbox uid is in use (AAP_SANDBOX_UID_COUNT).")


def release_unit(unit: str) -> None:
    """Stop every process of a unit and give its uid back (a deleted session)."""
    if not as_root():
        return
    directory = _uid_dir()
    base, count = settings.AAP_SANDBOX_UID_BASE, settings.AAP_SANDBOX_UID_COUNT
    start = _uid_start(unit, count)
    for step in range(count):
        path = directory / str(base + (start + step) % count)
        try:
            owner = path.read_text()
        except FileNotFoundError:
            return
        if owner == unit:
            kill_uid(int(path.name))
            path.unlink(missing_ok=True)
            return


def kill_uid(uid: int) -> None:
    """Kill every process of `uid` (whatever sessions or groups they made), as that uid."""
    if not as_root():
        return
    subprocess.run(
        [sys.executable, "-I", str(LAUNCHER), "--kill-uid", str(uid)],
        check=False,
        timeout=30,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    # Killed processes count against the uid's RLIMIT_NPROC until they are reaped (by init,
    # once their parent is gone): wait for them, or the unit's next process may not fork.
    deadline = time.monotonic() + UID_GONE_SECONDS
    while _uid_has_processes(uid) and time.monotonic() < deadline:
        time.sleep(0.05)


UID_GONE_SECONDS = 10.0


def _uid_has_processes(uid: int) -> bool:
    """Whether any process (zombies included) has `uid` as its real uid."""
    wanted = str(uid)
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status", encoding="ascii", errors="replace") as status:
                for line in status:
                    if line.startswith("Uid:"):
                        if line.split()[1] == wanted:
                            return True
                        break
        except OSError:
            continue  # gone meanwhile
    return False


# --- directories ----------------------------------------------------------------------------


def _searchable(path: Path) -> None:
    """Let other users traverse (never list or read) `path` and its parents: an agent's uid
    must reach its workspace and installation by name; Landlock decides what it may open."""
    for directory in [path, *path.parents]:
        try:
            mode = directory.stat().st_mode
        except OSError:
            continue
        if stat.S_ISDIR(mode) and not mode & stat.S_IXOTH:
            os.chmod(directory, stat.S_IMODE(mode) | stat.S_IXOTH)
            logger.warning(
                "sandbox: made %s searchable by other users (o+x) so agents can reach what they are allowed", directory
            )


def own(path: Path, uid: int | None) -> None:
    """Give a writable directory (and what is in it) to the unit's uid, mode 0700.

    The tree may be the agent's to change while this runs (a tenant's unit writes the tenant
    directory), so nothing here acts on a name: every directory is opened without following
    links (os.fwalk, which also checks each opened directory is the one it listed), every
    entry is opened with O_PATH | O_NOFOLLOW and checked through that descriptor, and the
    change is made through the descriptor (/proc/self/fd/N names exactly the opened inode).
    Symlinks are left alone, and so is a file with several hard links (it may be a link to a
    file outside)."""
    if uid is None:
        return
    top = _open_beneath(path)
    if top is None:
        return  # gone, or reached through a link: never followed
    try:
        os.fchown(top, uid, uid)
        os.fchmod(top, 0o700)
        for _, dirs, files, dirfd in os.fwalk(".", follow_symlinks=False, dir_fd=top):
            for name in dirs + files:
                _own_entry(name, dirfd, uid)
    finally:
        os.close(top)


def _own_entry(name: str, dirfd: int, uid: int) -> None:
    try:
        fd = os.open(name, os.O_PATH | os.O_NOFOLLOW, dir_fd=dirfd)
    except OSError:
        return
    try:
        info = os.fstat(fd)
        if info.st_uid == uid or stat.S_ISLNK(info.st_mode):
            return
        if not stat.S_ISDIR(info.st_mode) and (info.st_nlink > 1 or not stat.S_ISREG(info.st_mode)):
            return
        os.chown(f"/proc/self/fd/{fd}", uid, uid)
    except OSError:
        return
    finally:
        os.close(fd)


def prepare(spec: SandboxSpec, uid: int | None, home: Path) -> Path:
    """Create the unit's directories, owned by its uid; returns its temporary directory.

    Directories between the workspace root and the unit's own stay the service's, mode 0711
    (traversable, not listable); a tenant's directory (isolation `tenant`, writable as a
    whole by Landlock) stays the service's too, so its sessions' workspaces are given to the
    unit one by one as they open (AgentProcess.own)."""
    root = workspace.root()
    workspace.ensure_dir(root)
    tmp = home / ".tmp"
    for path in (*spec.writable, home, tmp):
        workspace.ensure_dir(path)
    if uid is None:
        return tmp
    for path in (*spec.writable, home):
        for parent in path.parents:
            if parent == root or root not in parent.parents:
                break
            _change_beneath(parent, mode=0o711)
    _searchable(root)
    for path in (*spec.writable, home):
        if path.parent == root:
            _change_beneath(path, mode=0o711, owner=(os.getuid(), os.getgid()))
        else:
            own(path, uid)
    return tmp


def _open_beneath(path: Path) -> int | None:
    """A descriptor of the directory `path` under the workspace root, reached component by
    component without following any link (None when a component is a link or missing): the
    tree below the root may be an agent's to change."""
    root = workspace.root()
    try:
        parts = Path(path).relative_to(root).parts
    except ValueError:
        return None
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    for part in parts:
        try:
            following = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
        except OSError:
            os.close(fd)
            return None
        os.close(fd)
        fd = following
    return fd


def _change_beneath(path: Path, *, mode: int, owner: tuple[int, int] | None = None) -> None:
    fd = _open_beneath(path)
    if fd is None:
        return
    try:
        if owner is not None:
            os.fchown(fd, *owner)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


# --- the policy and the command -------------------------------------------------------------


def sandbox_path() -> str:
    """The agents' PATH: the service's own environment first, then the system's."""
    return os.pathsep.join([os.path.dirname(sys.executable), "/usr/local/bin", "/usr/bin", "/bin"])


def resolve(command: str, path: str) -> str:
    """The executable for `command` on the sandbox's PATH (or as given when it is a path)."""
    if "/" in command:
        if not os.path.isabs(command):
            raise SandboxError("The agent command must be a name found on PATH or an absolute path.")
        found = command if os.access(command, os.X_OK) and os.path.isfile(command) else None
    else:
        found = shutil.which(command, path=path)
    if found is None:
        raise SandboxError(
            f"The agent command '{command}' was not found on the sandbox's PATH ({path}); install it into the "
            "service's environment or name it by absolute path."
        )
    return found


def _etc() -> list[str]:
    granted = [path for path in ETC_SSL if os.path.exists(path)]
    try:
        names = sorted(os.listdir("/etc"))
    except OSError:
        return granted
    for name in names:
        if name in ETC_HIDDEN or name.endswith((".key", ".pem")):
            continue
        path = os.path.join("/etc", name)
        try:
            info = os.stat(path)
        except OSError:
            continue
        if info.st_mode & stat.S_IROTH:  # what other users may not read stays unreadable here too
            granted.append(path)
    return granted


def _installation(executable: str) -> list[str]:
    """The executable's directory (and the one above it when that is a `bin`), the service's
    interpreter and its environment: what a program found on the sandbox's PATH runs from."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(sys.executable))}
    for candidate in (executable, os.path.realpath(executable)):
        directory = os.path.dirname(candidate)
        paths.add(directory)
        if os.path.basename(directory) == "bin":
            paths.add(os.path.dirname(directory))
    return sorted(path for path in paths if path != "/")


def _reads_protected(path: str) -> bool:
    """Whether granting `path` would grant the workspaces or the service's var/ (key files)."""
    real = os.path.realpath(path)
    for protected in (workspace.root(), Path(os.path.realpath(settings.VAR_DIR))):
        if Path(real) == protected or Path(real) in protected.parents:
            return True
    return False


def policy(
    spec: SandboxSpec, executable: str, *, uid: int | None, cwd: Path, proxy_port: int | None, base_tasks: int = 0
) -> dict:
    """The launcher's policy (paths, ports and numbers only: it travels in argv)."""
    limits = spec.limits
    read = []
    for path in [*SYSTEM_READ, *_etc(), *_installation(executable), *spec.read_paths]:
        if _reads_protected(path):  # e.g. a readPaths entry or a command's directory above var/
            logger.warning("sandbox: %s is not granted to agents: it holds the workspaces or the service's var/", path)
            continue
        read.append(path)
    if uid is not None:
        for path in read:
            if path.startswith(("/etc/", "/proc", "/sys/")) or path in SYSTEM_READ or not os.path.exists(path):
                continue  # the system's own directories are searchable already
            _searchable(Path(path) if os.path.isdir(path) else Path(path).parent)
    return {
        "uid": uid,
        "gid": uid,
        "cwd": str(cwd),
        "read": read,
        "devices": list(DEVICES),
        "write": [str(path) for path in spec.writable],
        "connect": [proxy_port] if proxy_port else [],
        "limits": {
            "data": limits.memory_bytes,
            "cpu": limits.cpu_seconds,
            "fsize": limits.disk_bytes,
            "nofile": limits.open_files,
            "core": 0,
            # Per uid: with a uid of its own the unit counts only its own tasks.
            "nproc": limits.processes + base_tasks,
        },
    }


RELAY_PORT = 3128  # inside a unit's own network namespace: where its proxy variables point
TMP_BYTES = 64 * 1024 * 1024  # /tmp and /dev/shm of a unit (tmpfs: counted as its memory)


def egress_socket_dir() -> Path:
    """Where the egress proxies' sockets live (never inside a unit's view but its own socket)."""
    directory = workspace.ensure_dir(workspace.root() / ".egress")
    os.chmod(directory, 0o711)  # noqa: S103 (traversable by the agents' uids, not listable)
    return directory


def give_socket(path: str, uid: int | None) -> None:
    """Let the unit's user (alone) connect to its egress socket."""
    if uid is not None:
        os.chown(path, uid, uid)
    os.chmod(path, 0o600)


def namespace_policy(policy_: dict, *, egress_socket: str | None, cgroup_procs: list[str]) -> dict:
    """The namespaces mode's additions to a policy."""
    return {
        **policy_,
        "mode": "namespaces",
        "bwrap": _bwrap(),
        "egress_socket": egress_socket,
        "relay_port": RELAY_PORT if egress_socket else None,
        "cgroups": cgroup_procs,
        "tmp_bytes": TMP_BYTES,
    }


def env_descriptor(env: dict) -> int:
    """The agent's environment as data: a memfd the launcher reads after the walls are
    up (the launcher itself starts with a fixed environment, see launcher_environment())."""
    fd = os.memfd_create("aap-agent-env", os.MFD_CLOEXEC)
    os.write(fd, json.dumps(env, separators=(",", ":")).encode())
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def launcher_environment() -> dict:
    """The launcher's own environment: fixed, nothing of the agent's or the operator's."""
    return {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}


def launcher_argv(policy_: dict, argv: list[str]) -> list[str]:
    return [sys.executable, "-I", str(LAUNCHER), json.dumps(policy_, separators=(",", ":")), "--", *argv]


def environment(home: Path, tmp: Path, proxy_url: str | None) -> dict:
    """The base environment of a sandboxed agent: built from scratch, nothing of the service's."""
    env = {
        "PATH": sandbox_path(),
        "HOME": str(home),
        "TMPDIR": str(tmp),
        "LANG": "C.UTF-8",
        "SHELL": "/bin/sh",
        "USER": "aap-agent",
        "LOGNAME": "aap-agent",
        "TERM": "dumb",
    }
    if proxy_url:
        for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
            env[name] = env[name.lower()] = proxy_url
    return env


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def fixed_environment(home: Path, tmp: Path, proxy_url: str | None, *, own_loopback: bool = False) -> dict:
    """What the operator's `env` cannot override: where the agent may write and its only route out.

    `own_loopback` (the namespaces mode, with no `egress` entry naming a loopback host): the
    unit's loopback is its own, so requests to it (an agent's own local server, the relay)
    skip the proxy; otherwise every request goes through it (a loopback egress entry means
    the host's loopback, reached only through the proxy)."""
    fixed = {"HOME": str(home), "TMPDIR": str(tmp)}
    if proxy_url:
        for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
            fixed[name] = fixed[name.lower()] = proxy_url
        fixed["NO_PROXY"] = fixed["no_proxy"] = ",".join(LOOPBACK_NAMES) if own_loopback else ""
    return fixed


def names_loopback(egress: tuple[str, ...]) -> bool:
    """Whether an egress entry names a loopback host (the host's, through the proxy)."""
    from .egress import parse_destination

    for entry in egress:
        host = parse_destination(entry)[0]
        if host in LOOPBACK_NAMES or host.startswith("127."):
            return True
    return False


def setup_failure(stderr_lines) -> str | None:
    """The launcher's own sentence, when it failed before the agent ran."""
    for line in stderr_lines:
        if line.startswith(SETUP_PREFIX):
            return f"The agent's sandbox could not be set up: {line[len(SETUP_PREFIX) :].strip()}."
    return None


_UNIT_RE = re.compile(r"[^A-Za-z0-9_.:/-]")


def unit_name(kind: str, tenant: str, detail: str) -> str:
    return _UNIT_RE.sub("_", f"{kind}:{tenant}/{detail}")
