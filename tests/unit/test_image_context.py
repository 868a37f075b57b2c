"""What `docker build .` sends to the daemon: .dockerignore read with Docker's own pattern rules.

The `docker` SDK's `exclude_paths` implements the daemon's matching (Go's filepath.Match plus
`**` and `!` exceptions, patterns relative to the context root), so the context computed here
is the one `docker compose build` sends. The operator's local files — the README's backups,
`.env`, `var/`, the agents file, compose overrides — are planted beside the tracked files and
must all stay out; everything the image runs must stay in.
"""

from __future__ import annotations

import subprocess

from docker.utils.build import exclude_paths

from tests.support import ROOT

# What an operator's checkout holds beside the tracked files after following the README.
LOCAL_FILES = (
    ".env",
    ".env.local",
    ".env.production",
    "backups/aap-2026-11-27.dump",
    "aap-2026-11-27.dump",  # the README's old backup command wrote here
    "deploy/aap.dump.gz",
    "dump.sql",
    "scripts/restore-test.sql.gz",
    "var/aap.sqlite3",
    "var/secret_key",
    "var/metrics/counter_1.db",
    "var/test/workspaces/t1/notes.txt",
    "deploy/agents.yaml",
    "docker-compose.override.yml",
    "compose.override.yaml",
    "celerybeat-schedule.db",
    ".venv/bin/python",
)
# What the image needs (Dockerfile COPY/RUN and the entrypoint's roles).
IMAGE_FILES = (
    "manage.py",
    "pyproject.toml",
    "requirements.lock",
    "deploy/entrypoint.sh",
    "deploy/healthcheck.py",
    "deploy/agents.example.yaml",
    "hosting/settings.py",
    "hosting/asgi.py",
    "sessions_app/apps.py",
    "agents/services.py",
    "sdk/pyproject.toml",
    "sdk/aap/__init__.py",
)


def patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def context_of(root) -> set[str]:
    return set(exclude_paths(str(root), patterns(), dockerfile="Dockerfile"))


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if line]


def test_backups_secrets_and_local_state_never_reach_the_image(tmp_path):
    for name in (*tracked_files(), *LOCAL_FILES, *IMAGE_FILES):
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x")
    context = context_of(tmp_path)

    leaked = sorted(name for name in LOCAL_FILES if name in context)
    assert not leaked, f"the image would contain {leaked}: exclude them in .dockerignore"
    assert not any(p.startswith(("var/", "backups/", ".venv/", ".git/")) for p in context)
    assert not any(p.endswith((".dump", ".sql", ".dump.gz", ".sql.gz")) for p in context)
    assert not any(p.rsplit("/", 1)[-1].startswith(".env") for p in context)

    missing = sorted(name for name in IMAGE_FILES if name not in context)
    assert not missing, f"the image needs {missing}: .dockerignore must not exclude them"


def test_the_checkout_as_it_is_sends_no_dump_env_or_var():
    """The real checkout (with its .venv, var/ and whatever else the developer has)."""
    context = context_of(ROOT)
    assert "manage.py" in context and "deploy/entrypoint.sh" in context
    bad = sorted(
        p
        for p in context
        if p.startswith(("var/", "backups/", ".venv/", ".git/"))
        or p.endswith((".dump", ".sql", ".dump.gz", ".sql.gz"))
        or p.rsplit("/", 1)[-1].startswith(".env")
        or p == "deploy/agents.yaml"
    )
    assert not bad, bad


def test_backups_and_local_files_are_ignored_by_git():
    for path in ("backups/aap-2026-11-27.dump", "aap-2026-11-27.dump", ".env", ".env.local", "var/aap.sqlite3"):
        done = subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT)
        assert done.returncode == 0, f"git would offer to commit {path}: add it to .gitignore"
    done = subprocess.run(["git", "check-ignore", "-q", ".env.example"], cwd=ROOT)
    assert done.returncode == 1, ".env.example is part of the repository"


def test_the_operators_agents_file_is_not_tracked_so_upgrades_never_conflict():
    assert "deploy/agents.yaml" not in tracked_files() and "deploy/agents.example.yaml" in tracked_files()
    done = subprocess.run(["git", "check-ignore", "-q", "deploy/agents.yaml"], cwd=ROOT)
    assert done.returncode == 0, "deploy/agents.yaml is the operator's: git must ignore it"
