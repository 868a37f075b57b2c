"""The namespaces mode, attacked from inside: a unit started by the launcher as the worker
starts it (as root: its own uid, cgroup, and bubblewrap's user, mount, PID, IPC, UTS and
network namespaces) tries to reach the host's services, files and processes. Each probe has
a positive control in the same unit, so a refusal means something.

`AAP_TEST_SANDBOX_OFF=1` runs the same scripts as the unit's uid without the walls (the
launcher's fallback with nothing applied but the uid), to show each assertion fails then.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from agents.runtimes.acp_bridge import cgroups, limits, sandbox

SANDBOX_OFF = os.environ.get("AAP_TEST_SANDBOX_OFF") == "1"

if os.environ.get("AAP_REQUIRE_NAMESPACES") == "1" and sandbox.namespaces_missing():
    raise RuntimeError("AAP_REQUIRE_NAMESPACES=1 but: " + "; ".join(sandbox.namespaces_missing()))

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the unit a uid of its own (CI runs as root)"),
    pytest.mark.skipif(
        not SANDBOX_OFF and bool(sandbox.namespaces_missing()),
        reason="this host cannot run the namespaces mode: " + "; ".join(sandbox.namespaces_missing()),
    ),
]


class Unit:
    """One isolation unit in a directory of its own, and a way to run a script in it."""

    def __init__(self, root: Path, limits_: dict | None = None):
        self.name = f"session:test/{uuid.uuid4().hex[:12]}"
        self.workspace = root / "test" / self.name.split("/")[-1]
        self.home = root / "test" / ".homes" / self.name.split("/")[-1]
        self.spec = sandbox.SandboxSpec(
            unit=self.name,
            writable=(self.workspace, self.home),
            read_paths=(),
            egress=(),
            limits=limits.Limits.parse({"processes": 64, **(limits_ or {})}),
        )
        self.uid = sandbox.unit_uid(self.name)
        self.tmp = sandbox.prepare(self.spec, self.uid, self.home)
        self.group = cgroups.create(self.name, self.spec.limits)

    def run(self, script: str, *, env: dict | None = None, egress_socket: str | None = None, timeout=60):
        env = {"PATH": sandbox.sandbox_path(), "HOME": str(self.home), "LANG": "C.UTF-8", **(env or {})}
        argv = [sys.executable, "-c", script]
        if SANDBOX_OFF:  # the unit's uid alone, no walls
            return subprocess.run(
                ["setpriv", f"--reuid={self.uid}", f"--regid={self.uid}", "--clear-groups", *argv],
                capture_output=True,
                text=True,
                timeout=timeout,
                cwd=self.workspace,
                env=env,
            )
        policy = sandbox.policy(self.spec, sys.executable, uid=self.uid, cwd=self.workspace, proxy_port=None)
        policy = sandbox.namespace_policy(
            policy, egress_socket=egress_socket, cgroup_procs=self.group.procs_files if self.group else []
        )
        fd = sandbox.env_descriptor(env)
        try:
            return subprocess.run(
                sandbox.launcher_argv({**policy, "env_fd": fd}, argv),
                capture_output=True,
                text=True,
                timeout=timeout,
                cwd=self.workspace,
                env=sandbox.launcher_environment(),
                pass_fds=(fd,),
            )
        finally:
            os.close(fd)

    def close(self):
        if self.group:
            self.group.remove()
        sandbox.release_unit(self.name)


@pytest.fixture
def unit(settings):
    root = Path(tempfile.mkdtemp(prefix="aap-ns-"))
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
def host_listener():
    """A TCP service on the host's loopback (stands in for PostgreSQL or Redis)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    accepted = []

    def serve():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            accepted.append(conn)
            conn.sendall(b"host-service-banner\n")

    threading.Thread(target=serve, daemon=True).start()
    yield server.getsockname()[1], accepted
    server.close()


def test_the_hosts_tcp_services_do_not_exist_for_the_unit_by_any_protocol(unit, host_listener):
    port, accepted = host_listener
    script = f"""
import socket
for name, proto in (("tcp", 0), ("mptcp", 262)):
    try:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM, proto)
        s.settimeout(3)
        s.connect(("127.0.0.1", {port}))
        print(name, "reached", s.recv(100))
    except OSError as exc:
        print(name, "refused", exc.errno)
# the positive control: its own loopback works, listen without bind included
own = socket.socket()
own.listen(1)
c = socket.create_connection(own.getsockname()[:2], timeout=3)
peer, _ = own.accept()
peer.sendall(b"own-loopback")
print("own", c.recv(100))
"""
    done = unit().run(script)
    assert "own b'own-loopback'" in done.stdout, done.stderr  # control
    assert "reached" not in done.stdout
    assert not accepted


def test_udp_and_abstract_unix_sockets_of_the_host_are_out_of_reach(unit):
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    udp.settimeout(2)
    name = f"aap-test-{uuid.uuid4().hex}"
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    abstract.bind("\0" + name)
    abstract.listen(1)
    script = f"""
import socket
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
try:
    u.sendto(b"udp-probe", ("127.0.0.1", {udp.getsockname()[1]}))
    print("udp sent")
except OSError as exc:
    print("udp refused", exc.errno)
a = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    a.connect("\\0{name}")
    print("abstract reached")
except OSError as exc:
    print("abstract refused", exc.errno)
own = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
own.bind("\\0own-{name}")
own.listen(1)
b = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
b.connect("\\0own-{name}")
print("own abstract works")
"""
    try:
        done = unit().run(script)
        assert "own abstract works" in done.stdout, done.stderr  # control
        assert "abstract reached" not in done.stdout
        with pytest.raises(TimeoutError):
            udp.recvfrom(100)
    finally:
        udp.close()
        abstract.close()


def test_the_unit_sees_its_own_files_and_processes_only(unit, tmp_path):
    secret_file = Path(tempfile.mkdtemp(prefix="aap-host-")) / "service-key"
    secret_file.write_text("host-secret-" + uuid.uuid4().hex)
    secret_file.chmod(0o644)  # readable by any user on the host: only the mount namespace hides it
    worker = subprocess.Popen(["sleep", "60"])
    script = f"""
import os
print("mine", open("mine.txt", "w").write("ok"), open("mine.txt").read())
try:
    print("host file", open({str(secret_file)!r}).read())
except OSError as exc:
    print("host file refused", exc.errno)
pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
print("pids", pids)
try:
    os.kill({worker.pid}, 0)
    print("signalled")
except OSError as exc:
    print("signal refused", exc.errno)
print("hostname", os.uname().nodename)
"""
    try:
        done = unit().run(script)
        assert "mine 2 ok" in done.stdout, done.stderr  # control: its workspace works
        assert "host-secret" not in done.stdout
        assert "signalled" not in done.stdout
        pids = eval(done.stdout.split("pids ")[1].splitlines()[0])
        assert max(pids) < 10  # its own PID namespace: a handful of processes numbered from 1
    finally:
        worker.kill()
        worker.wait()
        shutil.rmtree(secret_file.parent, ignore_errors=True)


def test_nothing_of_a_unit_outlives_its_first_process(unit):
    one = unit()
    script = """
import os, subprocess
subprocess.Popen(["sleep", "300"], start_new_session=True)
if os.fork() == 0:
    os.setsid()
    os.execvp("sleep", ["sleep", "301"])
print("started")
"""
    done = one.run(script)
    assert "started" in done.stdout, done.stderr
    time.sleep(0.5)
    left = subprocess.run(["pgrep", "-u", str(one.uid), "sleep"], capture_output=True, text=True).stdout
    subprocess.run(["pkill", "-9", "-u", str(one.uid)], check=False)  # whatever the sandbox did not end
    assert left == ""


@pytest.mark.skipif(isinstance(cgroups.layout(), str), reason="no writable cgroup here")
def test_memory_held_in_memfds_and_tmpfs_counts_against_the_units_limit(unit):
    script = """
import os
held = []
def hold(mib):
    fd = os.memfd_create("hoard")
    block = b"x" * (1 << 20)
    for _ in range(mib):
        os.write(fd, block)
    held.append(fd)
hold(MIB)
print("held", MIB)
"""
    small = unit({"memoryMiB": 128})
    done = small.run(script.replace("MIB", "32"))
    assert "held 32" in done.stdout, done.stderr  # control: under the limit it works
    big = unit({"memoryMiB": 128})
    done = big.run(script.replace("MIB", "400"))
    assert "held 400" not in done.stdout
    assert big.group is not None and big.group.oom_kills() >= 1


LOADER_LIBRARY = r"""
#include <stdio.h>
#include <unistd.h>
__attribute__((constructor)) static void mark(void) {
    char path[256];
    snprintf(path, sizeof path, "%s/loaded-as-%d", MARK_DIR, (int)getuid());
    FILE *f = fopen(path, "w");
    if (f) fclose(f);
}
"""


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler to build the loader library")
def test_loader_variables_in_the_agents_environment_never_run_before_the_walls(unit):
    one = unit()
    marks = Path(tempfile.mkdtemp(prefix="aap-marks-"))
    marks.chmod(0o777)
    source = one.workspace / "evil.c"
    source.write_text(LOADER_LIBRARY.replace("MARK_DIR", f'"{marks}"'))
    library = one.workspace / "evil.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    os.chmod(library, 0o755)
    try:
        if SANDBOX_OFF:  # what the launcher did before: the agent's environment was its own, as root
            done = subprocess.run(
                [sys.executable, "-c", "print('agent ran')"],
                env={"PATH": "/usr/bin:/bin", "LD_PRELOAD": str(library)},
                capture_output=True,
                text=True,
            )
        else:
            done = one.run("print('agent ran')", env={"LD_PRELOAD": str(library)})
        assert "agent ran" in done.stdout, done.stderr
        assert not (marks / "loaded-as-0").exists()  # never as root (the launcher, bwrap)
    finally:
        shutil.rmtree(marks, ignore_errors=True)


def test_the_egress_socket_is_the_units_only_way_out(unit, tmp_path):
    """The relay inside the unit's network namespace reaches the worker's socket (control);
    nothing else of the host's network is there (the probes above)."""
    directory = Path(tempfile.mkdtemp(prefix="aap-egress-"))
    directory.chmod(0o711)
    path = str(directory / "egress.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(4)
    one = unit()
    sandbox.give_socket(path, one.uid)

    def serve():
        try:
            conn, _ = server.accept()
            conn.recv(1000)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 7\r\nConnection: close\r\n\r\nproxied")
            conn.close()
        except OSError:
            pass

    threading.Thread(target=serve, daemon=True).start()
    script = f"""
import urllib.request
print(urllib.request.urlopen("http://127.0.0.1:{sandbox.RELAY_PORT}/x", timeout=5).read())
"""
    try:
        done = one.run(script, egress_socket=path)
        assert "b'proxied'" in done.stdout, done.stderr
    finally:
        server.close()
        shutil.rmtree(directory, ignore_errors=True)


SPIN = """
import os, resource, time
def spin(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass
children = []
for _ in range(SPINNERS):
    pid = os.fork()
    if pid == 0:
        spin(4)
        os._exit(0)
    children.append(pid)
if not children:
    spin(4)
for pid in children:
    os.waitpid(pid, 0)
own = resource.getrusage(resource.RUSAGE_SELF)
kids = resource.getrusage(resource.RUSAGE_CHILDREN)
print("cpu", own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime)
"""


@pytest.mark.skipif(isinstance(cgroups.layout(), str), reason="no writable cgroup here")
def test_a_unit_full_of_spinners_gets_one_share_of_the_cpu_not_one_per_process(unit):
    """Eight spinners in one unit against one in another: with a CPU share per unit, each
    unit gets about half of what the two use (without, the lone spinner gets about 1/9).
    A ratio of CPU times the units report themselves, not a duration."""
    greedy, modest = unit(), unit()
    results = {}

    def run(name, one, spinners):
        results[name] = one.run(SPIN.replace("SPINNERS", str(spinners)), timeout=60)

    thread = threading.Thread(target=run, args=("greedy", greedy, 8))
    thread.start()
    run("modest", modest, 0)
    thread.join()
    cpu = {name: float(done.stdout.split("cpu ")[1]) for name, done in results.items()}
    share = cpu["modest"] / (cpu["modest"] + cpu["greedy"])
    assert share > 0.3, (share, cpu)
