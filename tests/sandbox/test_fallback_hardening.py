"""The fallback mode (Landlock and seccomp, no namespaces), attacked from inside: a unit started
by the launcher as the worker starts it there (as root: a uid of its own, rlimits, Landlock,
the seccomp filter) runs small probes, each beside a positive control in the same unit, so a
refusal means something. Then what a unit holds where no path leads (memfds, deleted files it
keeps open) against its limits, and what is left of a unit once it stopped, however it stopped.

`AAP_TEST_SANDBOX_OFF=1` runs the same probes as the unit's uid without the walls, and the
agents without a sandbox, to show each assertion fails then (except `hidden_bytes` measuring a
process of its own, which needs no sandbox).
"""

from __future__ import annotations

import asyncio
import errno
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import acp
import pytest

from agents.runtimes.acp_bridge import cgroups, limits, sandbox
from agents.runtimes.acp_bridge.process import AgentProcess, ProcessSpec

SANDBOX_OFF = os.environ.get("AAP_TEST_SANDBOX_OFF") == "1"
MiB = 1 << 20
FAKE = Path(__file__).parents[1] / "fakes" / "acp_agent.py"

# The system calls the probes make by number (no wrapper in Python's standard library).
NUMBERS = {
    "x86_64": {
        "clone": 56,
        "unshare": 272,
        "clone3": 435,
        "userfaultfd": 323,
        "keyctl": 250,
        "bpf": 321,
        "perf_event_open": 298,
        "io_uring_setup": 425,
        "process_vm_readv": 310,
        "shmget": 29,
        "shmctl": 31,
    },
    "aarch64": {
        "clone": 220,
        "unshare": 97,
        "clone3": 435,
        "userfaultfd": 282,
        "keyctl": 219,
        "bpf": 280,
        "perf_event_open": 241,
        "io_uring_setup": 425,
        "process_vm_readv": 270,
        "shmget": 194,
        "shmctl": 195,
    },
}.get(platform.machine())

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the unit a uid of its own (CI runs as root)"),
    pytest.mark.skipif(NUMBERS is None, reason="system call numbers known for x86_64 and aarch64 only"),
]


class Unit:
    """One isolation unit of the fallback mode in a directory of its own."""

    def __init__(self, root: Path, limits_: dict | None = None):
        self.name = f"session:test/{uuid.uuid4().hex[:12]}"
        self.workspace = root / "test" / self.name.split("/")[-1]
        self.home = root / "test" / ".homes" / self.name.split("/")[-1]
        self.spec = sandbox.SandboxSpec(
            unit=self.name,
            writable=(self.workspace, self.home),
            read_paths=(str(FAKE.parent),),
            egress=(),
            limits=limits.Limits.parse({"processes": 64, **(limits_ or {})}),
        )
        self.uid = sandbox.unit_uid(self.name)
        sandbox.prepare(self.spec, self.uid, self.home)

    def run(self, script: str, *, port: int | None = None, timeout=60) -> dict[str, str]:
        """Run a probe script in the unit (TCP connect allowed to `port` only); its `name=result` lines."""
        env = {"PATH": sandbox.sandbox_path(), "HOME": str(self.home), "LANG": "C.UTF-8"}
        argv = [sys.executable, "-c", PRELUDE.replace("NUMBERS", repr(NUMBERS)) + script]
        if SANDBOX_OFF:  # the unit's uid alone, no walls
            done = subprocess.run(
                ["setpriv", f"--reuid={self.uid}", f"--regid={self.uid}", "--clear-groups", *argv],
                capture_output=True,
                text=True,
                timeout=timeout,
                cwd=self.workspace,
                env=env,
            )
        else:
            policy = sandbox.policy(self.spec, sys.executable, uid=self.uid, cwd=self.workspace, proxy_port=port)
            fd = sandbox.env_descriptor(env)
            try:
                done = subprocess.run(
                    sandbox.launcher_argv({**policy, "mode": "fallback", "env_fd": fd}, argv),
                    capture_output=True,
                    text=True,
                    timeout=timeout,
                    cwd=self.workspace,
                    env=sandbox.launcher_environment(),
                    pass_fds=(fd,),
                )
            finally:
                os.close(fd)
        results = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
        assert results, done.stderr[-2000:]
        return results

    def close(self):
        sandbox.release_unit(self.name)


PRELUDE = r"""
import ctypes, errno, os, socket, struct, subprocess, threading
NR = NUMBERS
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long

def report(name, probe):
    try:
        probe()
        result = "ok"
    except OSError as exc:
        result = errno.errorcode.get(exc.errno, str(exc.errno))
    print(f"{name}={result}", flush=True)

def call(name, *args):
    done = libc.syscall(ctypes.c_long(NR[name]), *(ctypes.c_long(arg) for arg in args))
    if done < 0:
        number = ctypes.get_errno()
        raise OSError(number, os.strerror(number))
    return done

def connect(port, family=socket.AF_INET, kind=socket.SOCK_STREAM, proto=0):
    with socket.socket(family, kind, proto) as sock:
        sock.settimeout(5)
        sock.connect(("127.0.0.1", port))

def ordinary():  # what every agent does: threads, programs (glibc tries clone3 first), memfds
    thread = threading.Thread(target=lambda: None)
    thread.start()
    thread.join()
    subprocess.run(["/bin/true"], check=True)
    os.close(os.memfd_create("scratch"))

report("ordinary", ordinary)
"""


@pytest.fixture
def unit(settings):
    root = Path(tempfile.mkdtemp(prefix="aap-fallback-"))
    root.chmod(0o755)
    settings.AAP_WORKSPACE_ROOT = root
    made = []

    def make(limits_: dict | None = None) -> Unit:
        made.append(Unit(root, limits_))
        return made[-1]

    yield make
    for each in made:
        each.close()
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def host():
    """Services of the host: the unit's allowed port (its egress proxy), a TCP service it must
    not reach (stands in for PostgreSQL or Redis), a unix socket file and an abstract one."""
    directory = Path(tempfile.mkdtemp(prefix="aap-host-"))
    directory.chmod(0o755)
    servers = []

    def listen(family, address):
        server = socket.socket(family, socket.SOCK_STREAM)
        server.bind(address)
        server.listen(64)
        servers.append(server)

        def serve():
            while True:
                try:
                    conn, _ = server.accept()
                except OSError:
                    return
                servers.append(conn)  # open until the end: a client may write to it

        threading.Thread(target=serve, daemon=True).start()
        return server

    allowed = listen(socket.AF_INET, ("127.0.0.1", 0)).getsockname()[1]
    service = listen(socket.AF_INET, ("127.0.0.1", 0)).getsockname()[1]
    path = str(directory / "service.sock")
    listen(socket.AF_UNIX, path)
    os.chmod(path, 0o777)
    abstract = "\0aap-test-" + uuid.uuid4().hex
    listen(socket.AF_UNIX, abstract)
    try:
        yield {"allowed": allowed, "service": service, "path": path, "abstract": abstract}
    finally:
        for server in servers:
            server.close()
        shutil.rmtree(directory, ignore_errors=True)


def probe(unit, host, script: str) -> dict[str, str]:
    for name, value in host.items():
        script = script.replace(name.upper(), repr(value))
    results = unit().run(script, port=host["allowed"])
    assert results["ordinary"] == "ok"  # control: threads, programs and memfds work
    return results


# --- sockets --------------------------------------------------------------------------------


def test_tcp_reaches_the_allowed_port_and_mptcp_reaches_no_other(unit, host):
    results = probe(
        unit,
        host,
        """
report("tcp", lambda: connect(ALLOWED))
report("tcp_by_protocol", lambda: connect(ALLOWED, proto=socket.IPPROTO_TCP))
report("tcp_to_service", lambda: connect(SERVICE))
report("mptcp_to_service", lambda: connect(SERVICE, proto=262))
report("mptcp6", lambda: socket.socket(socket.AF_INET6, socket.SOCK_STREAM, 262).close())
""",
    )
    assert results["tcp"] == results["tcp_by_protocol"] == "ok"
    # MPTCP falls back to plain TCP with a server that does not speak it, past Landlock's TCP rules.
    assert results["mptcp_to_service"] == results["mptcp6"] == "EACCES"
    assert results["tcp_to_service"] == "EACCES"  # Landlock's port rule


def test_tcp_fast_open_connects_nowhere_while_sending_on_a_connection_works(unit, host):
    # sendto(MSG_FASTOPEN) connects without connect(), past Landlock's port rule.
    results = probe(
        unit,
        host,
        """
def send(port):
    with socket.socket() as sock:
        sock.connect(("127.0.0.1", port))
        sock.send(b"x")
        sock.sendmsg([b"x"])
def fast_open(port):
    with socket.socket() as sock:  # blocking: sendto() returns once connected
        sock.sendto(b"x", socket.MSG_FASTOPEN, ("127.0.0.1", port))
report("send", lambda: send(ALLOWED))
report("fast_open_to_service", lambda: fast_open(SERVICE))
report("fast_open_to_allowed", lambda: fast_open(ALLOWED))
""",
    )
    assert results["send"] == "ok"
    assert results["fast_open_to_service"] == results["fast_open_to_allowed"] == errno.errorcode[errno.EOPNOTSUPP]


def test_sctp_is_refused(unit, host):
    results = probe(
        unit,
        host,
        """
report("tcp", lambda: connect(ALLOWED))
report("sctp_stream", lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM, 132).close())
report("sctp_seqpacket", lambda: socket.socket(socket.AF_INET, socket.SOCK_SEQPACKET, 132).close())
""",
    )
    assert results["tcp"] == "ok"
    assert results["sctp_stream"] == results["sctp_seqpacket"] == "EACCES"


def test_udp_is_refused(unit, host):
    results = probe(
        unit,
        host,
        """
report("tcp", lambda: connect(ALLOWED))
def udp(family):
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.sendto(b"x", ("127.0.0.1", SERVICE) if family == socket.AF_INET else ("::1", SERVICE))
report("udp", lambda: udp(socket.AF_INET))
report("udp6", lambda: udp(socket.AF_INET6))
report("udp_by_protocol", lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_UDP).close())
""",
    )
    assert results["tcp"] == "ok"
    assert results["udp"] == results["udp6"] == results["udp_by_protocol"] == "EACCES"


def test_raw_and_packet_sockets_are_refused(unit, host):
    results = probe(
        unit,
        host,
        """
report("tcp", lambda: connect(ALLOWED))
report("raw", lambda: socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP).close())
report("ping", lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP).close())
report("packet", lambda: socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0).close())
""",
    )
    assert results["tcp"] == "ok"
    assert results["raw"] == results["ping"] == results["packet"] == "EACCES"


def test_netlink_is_refused(unit, host):
    results = probe(
        unit,
        host,
        """
report("tcp", lambda: connect(ALLOWED))
report("route", lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0).close())
report("route_dgram", lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, 0).close())
report("audit", lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 9).close())
""",
    )
    assert results["tcp"] == "ok"
    assert results["route"] == results["route_dgram"] == results["audit"] == "EACCES"


def test_unix_sockets_reach_neither_a_socket_file_nor_an_abstract_name(unit, host):
    results = probe(
        unit,
        host,
        """
report("tcp", lambda: connect(ALLOWED))
def unix(address):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(address)
report("file", lambda: unix(PATH))
report("abstract", lambda: unix(ABSTRACT))
report("datagram", lambda: socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM).close())
def pair():  # a connected pair reaches nothing else (event loops wake themselves with one)
    one, two = socket.socketpair()
    one.sendall(b"x")
    assert two.recv(1) == b"x"
report("pair", pair)
""",
    )
    assert results["tcp"] == results["pair"] == "ok"
    assert results["file"] == results["abstract"] == results["datagram"] == "EACCES"


def test_listen_without_bind_is_refused(unit, host):
    # listen() on an unbound socket binds an ephemeral port on every address (Landlock checks bind()).
    results = probe(
        unit,
        host,
        """
report("tcp", lambda: connect(ALLOWED))
def listen():
    with socket.socket() as sock:
        sock.listen(1)
        print("listening_on=" + str(sock.getsockname()), flush=True)
report("listen", listen)
""",
    )
    assert results["tcp"] == "ok"
    assert results["listen"] == "EACCES"


# --- kernel interfaces ----------------------------------------------------------------------


def test_no_new_namespaces_and_clone3_is_absent(unit, host):
    results = probe(
        unit,
        host,
        """
CLONE_NEWUSER, CLONE_NEWNET, SIGCHLD = 0x10000000, 0x40000000, 17
def clone(flags):
    pid = call("clone", flags | SIGCHLD, 0, 0, 0, 0)
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
report("fork", lambda: clone(0))
report("clone_newuser", lambda: clone(CLONE_NEWUSER))
report("clone_newuser_newnet", lambda: clone(CLONE_NEWUSER | CLONE_NEWNET))
report("clone3", lambda: call("clone3", 0, 0))
report("unshare_newuser", lambda: call("unshare", CLONE_NEWUSER))  # last: unconfined it succeeds
""",
    )
    assert results["fork"] == "ok"
    assert results["clone_newuser"] == results["clone_newuser_newnet"] == results["unshare_newuser"] == "EPERM"
    assert results["clone3"] == "ENOSYS"  # glibc and the control above fall back to clone()


KERNEL_INTERFACES = {
    "userfaultfd": ('call("userfaultfd", 1 | os.O_CLOEXEC)', "EPERM"),  # UFFD_USER_MODE_ONLY
    "keyctl": ('call("keyctl", 0, -3, 1)', "EPERM"),  # the session keyring's id
    "bpf": ('call("bpf", 15, 0, 0)', "EPERM"),  # BPF_OBJ_GET_INFO_BY_FD
    "perf_event_open": (
        'call("perf_event_open", ctypes.addressof(PERF), 0, -1, -1, 0)',  # its own task clock
        "EPERM",
    ),
    "io_uring_setup": ('call("io_uring_setup", 4, ctypes.addressof(ctypes.create_string_buffer(120)))', "ENOSYS"),
    "process_vm_readv": ('call("process_vm_readv", os.getpid(), IOV, 1, IOV, 1, 0)', "EPERM"),
    "shmget": ("System_V()", "ENOSYS"),  # a segment outlives the unit's processes and its memory count
}


@pytest.mark.parametrize("name", KERNEL_INTERFACES)
def test_kernel_interfaces_an_agent_has_no_use_for_are_refused(unit, host, name):
    expression, refused = KERNEL_INTERFACES[name]
    results = probe(
        unit,
        host,
        f"""
PERF = ctypes.create_string_buffer(128)
struct.pack_into("IIQ", PERF, 0, 1, 128, 1)  # PERF_TYPE_SOFTWARE, its size, PERF_COUNT_SW_TASK_CLOCK
struct.pack_into("Q", PERF, 40, (1 << 5) | (1 << 6))  # exclude_kernel, exclude_hv
BUFFER = ctypes.create_string_buffer(64)
IOV = ctypes.addressof((ctypes.c_void_p * 2)(ctypes.addressof(BUFFER), 64))
def System_V():
    segment = call("shmget", 0, 4096, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600
    call("shmctl", segment, 0, 0)  # IPC_RMID
report("tcp", lambda: connect(ALLOWED))
report("probe", lambda: {expression})
""",
    )
    assert results["tcp"] == "ok"
    assert results["probe"] == refused


# --- what no path leads to ------------------------------------------------------------------

HOLDER = r"""
import ctypes, mmap, os, sys, threading
MiB = 1 << 20
def memfd(mib):
    fd = os.memfd_create("held")
    for _ in range(mib):
        os.write(fd, b"x" * MiB)
    return fd
def written(path, mib, unlink):
    handle = open(path, "wb")
    handle.write(b"y" * mib * MiB)
    handle.flush()
    if unlink:
        os.unlink(path)
    return handle
disk, shm = sys.argv[1], sys.argv[2]
held = [memfd(24)]
held.append(os.dup(held[0]))  # the same memfd twice, and in a child below: counted once
mapped = memfd(8)
view = mmap.mmap(mapped, 8 * MiB, mmap.MAP_SHARED, mmap.PROT_READ)
os.close(mapped)  # held by the mapping alone
held.append(written(os.path.join(disk, "gone"), 16, True))
held.append(written(os.path.join(disk, "kept"), 2, False))  # control: a path leads to it
if shm:
    held.append(written(os.path.join(shm, "gone"), 4, True))  # a deleted file on tmpfs: memory
def own_table():  # a thread with a descriptor table of its own
    ctypes.CDLL(None).unshare(0x400)  # CLONE_FILES
    held.append(memfd(4))
    ready.set()
    threading.Event().wait()
ready = threading.Event()
threading.Thread(target=own_table, daemon=True).start()
ready.wait()
child = os.fork()
if child == 0:
    sys.stdin.read()
    os._exit(0)
print(child, flush=True)
sys.stdin.read()
"""


def _filesystem(path) -> str:
    return subprocess.run(["stat", "-f", "-c", "%T", str(path)], capture_output=True, text=True).stdout.strip()


def test_hidden_bytes_counts_memfds_as_memory_and_deleted_open_files_as_disk_each_once(settings):
    Path(settings.VAR_DIR).mkdir(parents=True, exist_ok=True)
    if _filesystem(settings.VAR_DIR) == "tmpfs":
        pytest.skip("needs a directory on a disk")
    disk = Path(tempfile.mkdtemp(prefix="aap-hidden-", dir=settings.VAR_DIR))
    shm = tempfile.mkdtemp(prefix="aap-hidden-", dir="/dev/shm") if _filesystem("/dev/shm") == "tmpfs" else ""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(disk), shm], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    child = 0
    try:
        child = int(holder.stdout.readline())
        memory, on_disk = limits.hidden_bytes([holder.pid, child])
        assert memory == (24 + 8 + 4 + (4 if shm else 0)) * MiB
        assert 16 * MiB <= on_disk <= 16 * MiB + 256 * 1024  # the file's blocks (and its extent tree)
        assert limits.hidden_bytes([]) == (0, 0)
    finally:
        holder.kill()
        holder.wait()
        if child:
            os.kill(child, 9)
        shutil.rmtree(disk, ignore_errors=True)
        if shm:
            shutil.rmtree(shm, ignore_errors=True)


class Collect:
    def __init__(self):
        self.text = []

    def on_update(self, update):
        content = getattr(update, "content", None)
        if getattr(content, "text", None):
            self.text.append(content.text)

    def close(self):
        pass


class Agent:
    """The scripted ACP agent in a fallback unit, as the worker runs it where there are no
    writable cgroups (the /proc poller is all that counts)."""

    def __init__(self, one: Unit):
        self.unit = one
        box = None if SANDBOX_OFF else one.spec
        argv = ("python", str(FAKE))
        self.process = AgentProcess(
            ProcessSpec(key=one.name, label="fallback/test", argv=argv, env={}, home=one.home, sandbox=box)
        )
        self.session = None

    async def start(self):
        await self.process.start()
        self.session = await self.process.conn.new_session(cwd=str(self.unit.workspace), mcp_servers=[])

    async def sh(self, command: str) -> str:
        collect = Collect()
        self.process.sessions[self.session.session_id] = collect
        await self.process.conn.prompt(session_id=self.session.session_id, prompt=[acp.text_block("/sh " + command)])
        return "".join(collect.text)


@pytest.fixture
def fallback(settings, monkeypatch):
    settings.AAP_SANDBOX_MODE = "fallback"
    monkeypatch.setattr(cgroups, "create", lambda unit, limits_: None)
    sandbox.mode.cache_clear()
    yield
    sandbox.mode.cache_clear()


HOLD = (
    "import os, sys, time\nMIB, MARK = int(sys.argv[1]), sys.argv[2]\n{hold}\nopen(MARK, 'w').close()\ntime.sleep(300)"
)
HOLD_MEMFD = HOLD.format(
    hold="held = [os.memfd_create('hoard') for _ in range(MIB // 16)]\n"
    "for fd in held:\n    [os.write(fd, b'x' * (1 << 20)) for _ in range(16)]"
)
HOLD_DELETED = HOLD.format(
    hold="held = open('hoard', 'wb')\nos.unlink('hoard')\n[held.write(b'y' * (1 << 20)) for _ in range(MIB)]\n"
    "held.flush()"
)


def _hold(script: str, mib: int, mark: str) -> str:
    return f'python -c "{script}" {mib} {mark} >/dev/null 2>&1 </dev/null &'


async def _until(path: Path, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        await asyncio.sleep(0.05)


def test_a_unit_holding_more_than_its_memory_limit_in_memfds_is_stopped(unit, fallback):
    one = unit({"memoryMiB": 256, "diskMiB": 64})

    async def scenario():
        agent = Agent(one)
        await agent.start()
        try:
            await agent.sh(_hold(HOLD_MEMFD, 32, "small"))
            await _until(one.workspace / "small")
            under = await agent.process.check_limits()  # control: memfd_create works, under the limit
            alive = agent.process.alive
            await agent.sh(_hold(HOLD_MEMFD, 256, "big"))
            await _until(one.workspace / "big")
            return under, alive, await agent.process.check_limits()
        finally:
            await agent.process.stop("done", kill=True)

    under, alive, breach = asyncio.run(scenario())
    assert under is None and alive
    assert breach == "The agent used more than its memory limit of 256 MiB; its processes were stopped."


def test_a_unit_holding_deleted_files_past_its_disk_limit_is_stopped(unit, fallback):
    one = unit({"diskMiB": 32})

    async def scenario():
        agent = Agent(one)
        await agent.start()
        try:
            await agent.sh(_hold(HOLD_DELETED, 24, "first"))
            await _until(one.workspace / "first")
            under = await agent.process.check_limits()  # control: under the limit
            await agent.sh(_hold(HOLD_DELETED, 24, "second"))
            await _until(one.workspace / "second")
            return under, limits.disk_bytes(one.spec.writable), await agent.process.check_limits()
        finally:
            await agent.process.stop("done", kill=True)

    under, visible, breach = asyncio.run(scenario())
    assert under is None
    assert visible < 8 * MiB  # no path leads to what it holds
    assert (
        breach == "The agent's workspace and home hold more than its disk limit of 32 MiB; its processes were stopped."
    )


# --- what is left of a unit once it stopped -------------------------------------------------

BACKGROUND = "setsid sh -c 'echo $$ > background.pid; exec sleep 300' >/dev/null 2>&1 </dev/null &"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


async def _left(one: Unit, stop) -> bool:
    """Whether the background process (its own session and process group) outlives `stop`."""
    agent = Agent(one)
    await agent.start()
    pid = 0
    try:
        await agent.sh(BACKGROUND)
        await _until(one.workspace / "background.pid")
        await asyncio.sleep(0.1)
        pid = int((one.workspace / "background.pid").read_text())
        assert _alive(pid)  # control: it runs while the agent does
        await stop(agent)
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        return _alive(pid)
    finally:
        await agent.process.stop("done", kill=True)
        if pid and _alive(pid):
            os.kill(pid, 9)


def test_an_idle_stop_ends_every_process_of_the_unit(unit, fallback):
    async def idle(agent):
        await agent.process.stop("The agent process was idle.")

    assert asyncio.run(_left(unit(), idle)) is False


def test_an_agent_that_exits_on_its_own_leaves_nothing_running(unit, fallback):
    async def crash(agent):
        exiting = agent.process.conn.prompt(session_id=agent.session.session_id, prompt=[acp.text_block("/exit")])
        with pytest.raises(ConnectionError):
            await asyncio.wait_for(exiting, 10)

    assert asyncio.run(_left(unit(), crash)) is False
