"""The import layers of pyproject.toml's [tool.importlinter] hold: a wrong-way import fails here.

aap <- infra <- tenancy <- agents <- sessions_app <- hosting, with no import ignored; the turn
engine never imports the API, and runtimes never import the session layer. (The static check
runs as its own command: it reads the source, imports nothing.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support import ROOT


def test_imports_point_one_way():
    lint_imports = Path(sys.executable).parent / "lint-imports"
    result = subprocess.run([str(lint_imports), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout
