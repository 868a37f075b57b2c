"""The sandbox launcher: confines itself, then execs the ACP agent in its place.

Run by the worker as `python -I sandbox_exec.py POLICY_JSON -- COMMAND ARGS...` (by file
path, never importing the service: nothing of Django or the settings is loaded here), with
a fixed environment. The agent's environment arrives as data on an inherited memfd
(`env_fd` in the policy) and is applied only by the final `execve`, after every wall is up:
nothing the agent or a tenant controls (`LD_PRELOAD`, ...) reaches code that runs as root.

Namespaces mode (`"mode": "namespaces"`), in this order:
1. join the unit's cgroups; resource limits; drop to the unit's uid (when started as root);
2. exec bubblewrap with a fixed environment: new user (no further ones), mount, PID, IPC,
   UTS, cgroup and network namespaces, a root of read-only system paths plus the writable
   workspace and HOME, its own /proc, /dev and tmpfs /tmp; the egress socket and this file
   mounted under /run/aap;
3. inside (`--inner`): read the agent's environment, fork the relay (127.0.0.1:relay_port
   -> the egress socket, the namespace's only way out), apply the seccomp filter, exec.

Fallback mode (no namespaces): cgroups, resource limits, uid drop, then Landlock (read-only
the system and the agent's installation, read-write its workspace and HOME, TCP connect
only to the egress proxy's port, no bind; signals and abstract unix sockets scoped), then
the seccomp filter (sockets as an allowlist: TCP/IP streams only; no listen, no TCP Fast
Open, no System V IPC), then exec.

In both, seccomp refuses new namespaces, clone3, userfaultfd, keyctl, bpf, perf_event_open,
io_uring, ptrace and the other calls listed in `_seccomp`.

Any failure exits with EXIT_SETUP_FAILED and one line on stderr starting with `aap-sandbox:`,
which the worker turns into the turn's error sentence. The line names no secret: the policy
holds paths, ports and numbers only.

`--kill-uid UID` (as root) becomes UID and kills every process of that uid: how the worker
stops an isolation unit, whatever process groups or sessions its processes made.
`--probe BWRAP UID` tries the namespaces once, as UID (-1: as itself).
"""

from __future__ import annotations

import contextlib
import errno
import itertools
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

AF_UNIX, AF_INET, AF_INET6, AF_NETLINK = 1, 2, 10, 16
SOCK_STREAM, SOCK_DGRAM = 1, 2
SOCK_TYPE_MASK = 0xF  # the type without SOCK_NONBLOCK / SOCK_CLOEXEC
IPPROTO_TCP, IPPROTO_UDP = 6, 17
MSG_FASTOPEN = 0x20000000
# CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET; NEWTIME (unshare only).
CLONE_NEW_FLAGS = (0x20000, 0x2000000, 0x4000000, 0x8000000, 0x10000000, 0x20000000, 0x40000000)
CLONE_NEWTIME = 0x80
REFUSED_CALLS = (  # kernel interfaces an agent has no use for, each a known way up or out
    "userfaultfd",
    "keyctl",
    "add_key",
    "request_key",
    "bpf",
    "perf_event_open",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "kexec_load",
    "kexec_file_load",
    "open_by_handle_at",
    "name_to_handle_at",
)


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


def _outside(arg: int, allowed, mask: int | None = None) -> list:
    """Comparisons of argument `arg` that together match every value not in `allowed` (of
    `arg & mask` when given): libseccomp cannot allow below an ALLOW default, only refuse, and
    takes one comparison per argument and rule. Values are compared on all 64 bits."""
    if mask is not None:
        return [seccomp.Arg(arg, seccomp.MASKED_EQ, mask, value) for value in range(mask + 1) if value not in allowed]
    values = sorted(allowed)
    found = [seccomp.Arg(arg, seccomp.LT, values[0])] if values[0] > 0 else []
    for low, high in itertools.pairwise(values):
        found += [seccomp.Arg(arg, seccomp.EQ, value) for value in range(low + 1, high)]
    return [*found, seccomp.Arg(arg, seccomp.GT, values[-1])]


def _seccomp(policy: dict) -> None:
    """Sockets by allowlist (family -> type -> protocols; None: any), refusing the rest with
    EACCES; new namespaces, clone3 and the calls in REFUSED_CALLS refused in every mode."""
    namespaces = policy.get("mode") == "namespaces"
    tcp = {SOCK_STREAM: (0, IPPROTO_TCP)}  # not MPTCP (262): it falls back to TCP past Landlock's port rules
    if namespaces:  # its own network namespace with only loopback (and the relay to the egress socket)
        inet = {**tcp, SOCK_DGRAM: (0, IPPROTO_UDP)}
        sockets = {AF_UNIX: None, AF_INET: inet, AF_INET6: inet, AF_NETLINK: {None: (0,)}}  # NETLINK_ROUTE
    else:
        sockets = {AF_INET: tcp, AF_INET6: tcp}
    refuse = seccomp.ERRNO(errno.EACCES)
    rules = seccomp.SyscallFilter(seccomp.ALLOW)
    for outside in _outside(0, sockets):
        rules.add_rule(refuse, "socket", outside)
    for family, kinds in sockets.items():
        if kinds is None:
            continue
        same = seccomp.Arg(0, seccomp.EQ, family)
        if None not in kinds:
            for outside in _outside(1, kinds, SOCK_TYPE_MASK):
                rules.add_rule(refuse, "socket", same, outside)
        for kind, protocols in kinds.items():
            of_kind = [] if kind is None else [seccomp.Arg(1, seccomp.MASKED_EQ, SOCK_TYPE_MASK, kind)]
            for outside in _outside(2, protocols):
                rules.add_rule(refuse, "socket", same, *of_kind, outside)
    if not namespaces:  # listen() without bind() binds an ephemeral port on every address
        rules.add_rule(refuse, "listen")
        # TCP Fast Open connects from sendto()/sendmsg(), past Landlock's connect check: refused as
        # on a host with its client side off (clients then connect() first).
        for name, flags in (("sendto", 3), ("sendmsg", 2), ("sendmmsg", 3)):
            rules.add_rule(
                seccomp.ERRNO(errno.EOPNOTSUPP), name, seccomp.Arg(flags, seccomp.MASKED_EQ, MSG_FASTOPEN, MSG_FASTOPEN)
            )
    denied = seccomp.ERRNO(errno.EPERM)
    for flag in (*CLONE_NEW_FLAGS, CLONE_NEWTIME):
        rules.add_rule(denied, "unshare", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    for flag in CLONE_NEW_FLAGS:  # clone()'s flags are its first argument on x86-64 and arm64
        rules.add_rule(denied, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    absent = seccomp.ERRNO(errno.ENOSYS)
    rules.add_rule(absent, "clone3")  # its flags are behind a pointer; glibc falls back to clone()
    for name in REFUSED_CALLS:
        rules.add_rule(denied, name)
    # io_uring can open sockets and files without the syscalls above.
    for name in ("io_uring_setup", "io_uring_enter", "io_uring_register"):
        rules.add_rule(absent, name)
    if not namespaces:  # System V objects outlive the unit's processes and its memory count
        for name in ("shmget", "semget", "msgget"):
            rules.add_rule(absent, name)
    rules.load()


def _limit_and_drop(policy: dict) -> None:
    """The resource limits, then the unit's own uid and gid (when started as root)."""
    try:
        _limits(policy.get("limits", {}))
    except (OSError, ValueError) as exc:
        _fail(f"the resource limits could not be set ({type(exc).__name__})")
    if policy.get("uid") is not None:
        try:
            _drop(int(policy["uid"]), int(policy["gid"]))
        except OSError as exc:
            _fail(f"the agent's user could not be set ({errno.errorcode.get(exc.errno or 0, 'error')})")


def confine(policy: dict) -> None:
    """Apply the whole policy to this process (single-threaded, before exec)."""
    _limit_and_drop(policy)
    try:
        _landlock(policy)
    except Exception as exc:  # py-landlock raises its own errors for a missing kernel feature
        _fail(f"Landlock could not be applied ({type(exc).__name__}: {exc})")
    try:
        _seccomp(policy)
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


# --- the namespaces mode: bubblewrap builds the walls, this file runs on both sides ------

INSIDE = "/run/aap"  # inside the sandbox: this launcher and the egress socket
INSIDE_LAUNCHER = INSIDE + "/sandbox_exec.py"
INSIDE_EGRESS = INSIDE + "/egress.sock"


def _read_env(policy: dict) -> dict:
    """The agent's environment, passed as data on an inherited descriptor (never applied to
    this process: a loader variable in it must not reach anything that runs before the walls)."""
    fd = policy.get("env_fd")
    if fd is None:
        return {}
    chunks = []
    os.lseek(int(fd), 0, os.SEEK_SET)
    while chunk := os.read(int(fd), 1 << 16):
        chunks.append(chunk)
    os.close(int(fd))  # read once: nothing the agent runs inherits it
    env = json.loads(b"".join(chunks) or b"{}")
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        _fail("the agent's environment is not a map of strings")
    return env


def _join_cgroups(policy: dict) -> None:
    """Move this process (and so everything it starts) into the unit's cgroups."""
    for procs in policy.get("cgroups", []):
        try:
            with open(procs, "w") as handle:
                handle.write(str(os.getpid()))
        except OSError as exc:
            _fail(f"the unit's cgroup could not be joined ({errno.errorcode.get(exc.errno or 0, 'error')})")


def _bwrap_argv(policy: dict, command: list[str]) -> list[str]:
    """bubblewrap's arguments: new user, mount, PID, IPC, UTS, cgroup and network namespaces;
    a root filesystem of the read-only system and installation, the writable workspace and
    HOME, a private /proc, /dev, /tmp; the egress socket; then this launcher's inner stage."""
    argv = [policy["bwrap"], "--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-net"]
    argv += ["--unshare-uts", "--unshare-cgroup-try", "--disable-userns", "--die-with-parent", "--new-session"]
    argv += ["--hostname", "aap-agent", "--proc", "/proc", "--dev", "/dev"]
    tmp_bytes = str(int(policy.get("tmp_bytes", 64 * 1024 * 1024)))
    # The unit's own fresh tmpfs mounts, inside its namespace: no file is created here.
    argv += ["--size", tmp_bytes, "--tmpfs", "/tmp", "--size", tmp_bytes, "--tmpfs", "/dev/shm"]  # noqa: S108
    for path in policy.get("read", []):
        if path == "/proc" or path.startswith("/proc/"):
            continue
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.exists(path):
            argv += ["--ro-bind", path, path]
    for path in policy.get("write", []):
        if not stat.S_ISDIR(os.stat(path).st_mode):
            _fail(f"the writable path {path} is not a directory")
        argv += ["--bind", path, path]
    argv += ["--dir", INSIDE, "--ro-bind", os.path.abspath(__file__), INSIDE_LAUNCHER]
    if policy.get("egress_socket"):
        argv += ["--bind", policy["egress_socket"], INSIDE_EGRESS]
    argv += ["--chdir", policy.get("cwd") or "/"]
    inner = {key: value for key, value in policy.items() if key not in ("read", "write", "cgroups")}
    argv += ["--", sys.executable, "-I", INSIDE_LAUNCHER, "--inner"]
    argv += [json.dumps(inner, separators=(",", ":")), "--", *command]
    return argv


def _relay(port: int, ready: int) -> None:
    """Inside the sandbox's network namespace: 127.0.0.1:`port` carried to the egress socket
    (the worker's proxy and gateway), the namespace's only way out. Runs in a child process;
    closes `ready` once it listens."""
    import socket
    import threading

    def pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while chunk := source.recv(65536):
                sink.sendall(chunk)
        except OSError:
            pass
        finally:
            for sock, how in ((sink, socket.SHUT_WR), (source, socket.SHUT_RD)):
                with contextlib.suppress(OSError):
                    sock.shutdown(how)

    def serve(client: socket.socket) -> None:
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            upstream.connect(INSIDE_EGRESS)
        except OSError:
            client.close()
            upstream.close()
            return
        back = threading.Thread(target=pipe, args=(upstream, client), daemon=True)
        back.start()
        pipe(client, upstream)
        back.join()
        client.close()
        upstream.close()

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(128)
    os.close(ready)
    while True:
        client, _ = listener.accept()
        threading.Thread(target=serve, args=(client,), daemon=True).start()


def _start_relay(policy: dict) -> None:
    """Fork the relay (confined like the agent) and wait until it listens."""
    port = policy.get("relay_port")
    if not port or not policy.get("egress_socket"):
        return
    ready_r, ready_w = os.pipe()
    if os.fork() == 0:
        os.close(ready_r)
        try:
            _seccomp(policy)
            _relay(int(port), ready_w)
        finally:
            os._exit(0)
    os.close(ready_w)
    os.read(ready_r, 1)  # EOF once it listens (or once it failed: the agent then finds no proxy)
    os.close(ready_r)


def _exec(command: list[str], env: dict, cwd: str) -> None:
    try:
        os.chdir(cwd or "/")
        os.execve(command[0], command, env)
    except OSError as exc:
        _fail(f"the agent command could not be started ({errno.errorcode.get(exc.errno or 0, 'error')})")


def probe(bwrap: str, uid: int) -> None:
    """Whether bubblewrap can build the namespaces here for `uid` (-1: this process's user)."""
    if uid >= 0:
        _drop(uid, uid)
    argv = [bwrap, "--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-net", "--unshare-uts"]
    argv += ["--disable-userns", "--die-with-parent", "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev"]
    os.execve(bwrap, [*argv, "--", "/bin/true"], {"PATH": "/usr/bin:/bin"})


def inner_main(policy: dict, command: list[str]) -> None:
    """Inside bubblewrap's namespaces: read the agent's environment, start the relay, apply the
    seccomp filter, exec the agent."""
    env = _read_env(policy)
    _start_relay(policy)
    try:
        _seccomp(policy)
    except Exception as exc:
        _fail(f"the seccomp filter could not be applied ({type(exc).__name__})")
    _exec(command, env, policy.get("cwd") or "/")


def main(argv: list[str]) -> None:
    if len(argv) == 2 and argv[0] == "--kill-uid":
        kill_uid(int(argv[1]))
        return
    if len(argv) == 3 and argv[0] == "--probe":
        probe(argv[1], int(argv[2]))
        return
    inner = bool(argv) and argv[0] == "--inner"
    if inner:
        argv = argv[1:]
    if len(argv) < 3 or argv[1] != "--":
        _fail("usage: sandbox_exec.py POLICY_JSON -- COMMAND ARGS...")
    policy = json.loads(argv[0])
    command = argv[2:]
    if inner:
        inner_main(policy, command)
        return
    if policy.get("mode") == "namespaces":
        _join_cgroups(policy)
        _limit_and_drop(policy)
        bwrap = _bwrap_argv(policy, command)
        try:
            os.execve(bwrap[0], bwrap, {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
        except OSError as exc:
            _fail(f"bubblewrap could not be started ({errno.errorcode.get(exc.errno or 0, 'error')})")
        return
    env = _read_env(policy)
    _join_cgroups(policy)
    confine(policy)
    _exec(command, env, policy.get("cwd") or "/")


if __name__ == "__main__":
    main(sys.argv[1:])
