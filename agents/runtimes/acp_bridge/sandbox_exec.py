"""The sandbox launcher: confines itself, then execs the ACP agent in its place.

Run by the worker as `python -I sandbox_exec.py POLICY_JSON -- COMMAND ARGS...` (by file
path, never importing the service: nothing of Django or the settings is loaded here). In
this order, before any code of the agent runs:

1. resource limits (memory, CPU time, processes, file size, open files, no core dumps);
2. when started as root: drop to the isolation unit's own uid and gid, no supplementary groups;
3. Landlock: read-only the system and the agent's installation, read-write its workspace and
   HOME, TCP connect only to the egress proxy's port, no bind; signals and abstract unix
   sockets scoped to the sandbox; ptrace of anything outside is refused by Landlock itself;
4. seccomp: sockets only of the families TCP/IP uses, as streams (no unix sockets to the
   database's socket file, no UDP, no netlink, no raw sockets); no io_uring;
5. exec the agent (the resolved absolute path) with the environment the worker built.

Any failure exits with EXIT_SETUP_FAILED and one line on stderr starting with `aap-sandbox:`,
which the worker turns into the turn's error sentence. The line names no secret: the policy
holds paths, ports and numbers only.

`--kill-uid UID` (as root) becomes UID and kills every process of that uid: how the worker
stops an isolation unit, whatever process groups or sessions its processes made.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import signal
import stat
import sys

# Imported before the uid drop: the new uid may not read the service's own libraries.
import pyseccomp as seccomp
from py_landlock import AccessFs, Landlock

EXIT_SETUP_FAILED = 125
PREFIX = "aap-sandbox: "

AF_INET, AF_INET6 = 2, 10
SOCK_STREAM = 1
SOCK_TYPE_MASK = 0xF  # the type without SOCK_NONBLOCK / SOCK_CLOEXEC


def _fail(message: str) -> None:
    sys.stderr.write(PREFIX + message + "\n")
    sys.stderr.flush()
    os._exit(EXIT_SETUP_FAILED)


def _limits(limits: dict) -> None:
    names = {
        "data": resource.RLIMIT_DATA,
        "cpu": resource.RLIMIT_CPU,
        "nproc": resource.RLIMIT_NPROC,
        "fsize": resource.RLIMIT_FSIZE,
        "nofile": resource.RLIMIT_NOFILE,
        "core": resource.RLIMIT_CORE,
    }
    for name, value in limits.items():
        value = int(value)
        if name == "cpu":  # SIGXCPU at the limit, SIGKILL a few seconds later
            resource.setrlimit(names[name], (value, value + 5))
        else:
            resource.setrlimit(names[name], (value, value))


def _drop(uid: int, gid: int) -> None:
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    if os.getuid() != uid or os.geteuid() != uid or os.getgid() != gid:
        _fail("the agent's user could not be set")
    try:  # a process that can become root again is not confined
        os.setuid(0)
    except PermissionError:
        return
    _fail("the agent could regain root after dropping it")


def _landlock(policy: dict) -> None:
    file_read = AccessFs.READ_FILE | AccessFs.EXECUTE
    dir_read = file_read | AccessFs.READ_DIR
    dir_write = _all_fs()  # every right py-landlock knows, filtered to the kernel's ABI
    ruleset = Landlock(strict=True)
    for path in policy.get("read", []):
        if not os.path.exists(path):
            continue  # e.g. /lib32 on a system without it
        ruleset.add_path_rule(path, access=dir_read if os.path.isdir(path) else file_read)
    for path in policy.get("devices", []):
        if os.path.exists(path):
            ruleset.add_path_rule(path, access=AccessFs.READ_FILE | AccessFs.WRITE_FILE)
    for path in policy.get("write", []):
        if not stat.S_ISDIR(os.stat(path).st_mode):
            _fail(f"the writable path {path} is not a directory")
        ruleset.add_path_rule(path, access=dir_write)
    ports = [int(port) for port in policy.get("connect", [])]
    if ports:
        ruleset.allow_network(*ports, bind=False, connect=True)
    ruleset.apply()  # also sets no_new_privs; scopes signals and abstract sockets by default


def _all_fs():
    rights = AccessFs(0)
    for right in AccessFs:
        rights |= right
    return rights


def _seccomp() -> None:
    refuse = seccomp.ERRNO(errno.EACCES)
    rules = seccomp.SyscallFilter(seccomp.ALLOW)
    # socket(): only AF_INET / AF_INET6 streams; everything else (unix, netlink, packet...) refused.
    rules.add_rule(refuse, "socket", seccomp.Arg(0, seccomp.LT, AF_INET))
    for family in range(AF_INET + 1, AF_INET6):  # libseccomp takes one comparison per argument
        rules.add_rule(refuse, "socket", seccomp.Arg(0, seccomp.EQ, family))
    rules.add_rule(refuse, "socket", seccomp.Arg(0, seccomp.GT, AF_INET6))
    for family in (AF_INET, AF_INET6):
        for kind in (2, 3, 4, 5, 6, 10):  # dgram, raw, rdm, seqpacket, dccp, packet
            rules.add_rule(
                refuse,
                "socket",
                seccomp.Arg(0, seccomp.EQ, family),
                seccomp.Arg(1, seccomp.MASKED_EQ, SOCK_TYPE_MASK, kind),
            )
    # io_uring can open sockets and files without the syscalls above.
    for name in ("io_uring_setup", "io_uring_enter", "io_uring_register"):
        rules.add_rule(seccomp.ERRNO(errno.ENOSYS), name)
    rules.load()


def confine(policy: dict) -> None:
    """Apply the whole policy to this process (single-threaded, before exec)."""
    try:
        _limits(policy.get("limits", {}))
    except (OSError, ValueError) as exc:
        _fail(f"the resource limits could not be set ({type(exc).__name__})")
    if policy.get("uid") is not None:
        try:
            _drop(int(policy["uid"]), int(policy["gid"]))
        except OSError as exc:
            _fail(f"the agent's user could not be set ({errno.errorcode.get(exc.errno, 'error')})")
    try:
        _landlock(policy)
    except Exception as exc:  # py-landlock raises its own errors for a missing kernel feature
        _fail(f"Landlock could not be applied ({type(exc).__name__}: {exc})")
    try:
        _seccomp()
    except Exception as exc:
        _fail(f"the seccomp filter could not be applied ({type(exc).__name__})")


def kill_uid(uid: int) -> None:
    """Become `uid` and signal every process of it (kill(-1) reaches exactly those)."""
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    for _ in range(3):  # a fork bomb may fork between rounds
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            break


def main(argv: list[str]) -> None:
    if len(argv) == 2 and argv[0] == "--kill-uid":
        kill_uid(int(argv[1]))
        return
    if len(argv) < 3 or argv[1] != "--":
        _fail("usage: sandbox_exec.py POLICY_JSON -- COMMAND ARGS...")
    policy = json.loads(argv[0])
    command = argv[2:]
    confine(policy)
    try:
        os.chdir(policy.get("cwd") or "/")
        os.execv(command[0], command)
    except OSError as exc:
        _fail(f"the agent command could not be started ({errno.errorcode.get(exc.errno, 'error')})")


if __name__ == "__main__":
    main(sys.argv[1:])
