"""The AAP client (sdk/, `aap-client`) is a distribution of its own: installed alone into a fresh
virtualenv, it gives `import aap`, the `aap` command and its own tests, with httpx and without
Django or anything else of the server. pip takes httpx from the configured index."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

from tests.support import ROOT

# What the server needs and the client must not: none of it may come with `pip install ./sdk`.
SERVER_ONLY = {"django", "djangorestframework", "channels", "daphne", "celery", "openai", "aap-hosting"}


def run(*args: str, cwd, timeout: int = 120) -> subprocess.CompletedProcess[str]:
    # Nothing of the checkout's environment: no PYTHONPATH, no active virtualenv, no settings.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "DJANGO_SETTINGS_MODULE")}
    return subprocess.run(list(args), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_the_client_installs_and_runs_alone_in_a_fresh_virtualenv(tmp_path):
    # A copy of sdk/, so that the build leaves nothing in the checkout.
    source = tmp_path / "sdk"
    shutil.copytree(
        ROOT / "sdk",
        source,
        ignore=shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__", ".pytest_cache"),
    )
    venv = tmp_path / "venv"
    made = run(sys.executable, "-m", "venv", str(venv), cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    python, aap = str(venv / "bin" / "python"), str(venv / "bin" / "aap")

    install = run(
        python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", f"{source}[test]",
        cwd=tmp_path, timeout=600,
    )  # fmt: skip
    assert install.returncode == 0, install.stderr[-4000:]

    listed = run(python, "-m", "pip", "list", "--format", "json", "--disable-pip-version-check", cwd=tmp_path)
    installed = {p["name"].lower() for p in json.loads(listed.stdout)}
    assert {"aap-client", "httpx"} <= installed, installed
    assert not installed & SERVER_ONLY, installed & SERVER_ONLY

    # The package comes from the virtualenv, not from the checkout; httpx imports (the control
    # for the import that must fail), Django does not.
    where = run(python, "-c", "import aap, aap.cli, httpx; print(aap.__file__)", cwd=tmp_path)
    assert where.returncode == 0, where.stderr
    assert where.stdout.strip().startswith(str(venv)), where.stdout
    django = run(python, "-c", "import django", cwd=tmp_path)
    assert django.returncode != 0 and "No module named 'django'" in django.stderr, django.stderr

    helped = run(aap, "--help", cwd=tmp_path)
    assert helped.returncode == 0 and helped.stdout.startswith("usage: aap"), helped.stderr
    assert all(command in helped.stdout for command in ("meta", "sessions", "history", "chat"))
    # A server that does not answer is a sentence from the command, not a traceback.
    refused = run(aap, "--url", f"http://127.0.0.1:{closed_port()}/v1", "--token", "aap_x", "meta", cwd=tmp_path)
    assert refused.returncode == 1, refused.stderr
    assert refused.stderr.startswith("aap: cannot reach the server") and "Traceback" not in refused.stderr

    # The client's own tests pass where nothing of the server is installed.
    tests = run(python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests", cwd=source, timeout=300)
    assert tests.returncode == 0, tests.stdout[-4000:] + tests.stderr[-2000:]
    assert " passed" in tests.stdout and " failed" not in tests.stdout, tests.stdout[-2000:]
