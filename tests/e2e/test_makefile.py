"""The Makefile's install targets: `make run` installs the service's runtime dependencies
only; the test extras come with `make test`; a second run installs nothing."""

from __future__ import annotations

import subprocess

from ..support import ROOT


def dry_run(target: str, venv) -> str:
    result = subprocess.run(
        ["make", "-n", target, f"VENV={venv}"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def installs(output: str) -> list[str]:
    return [line for line in output.splitlines() if "pip install" in line]


def test_make_run_installs_the_runtime_dependencies_only(tmp_path):
    venv = tmp_path / "venv"
    run = installs(dry_run("run", venv))
    assert len(run) == 1 and run[0].rstrip().endswith("-e ./sdk -e ."), run  # the AAP client beside
    test = installs(dry_run("test", venv))
    assert any("-e './sdk[test]' -e '.[test]'" in line for line in test), test


def test_a_second_make_run_installs_nothing(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to("/usr/bin/python3")
    (venv / ".installed-run").touch()  # after pyproject.toml: up to date
    assert installs(dry_run("run", venv)) == []
    assert installs(dry_run("test", venv)), "the test extras still come with make test"
