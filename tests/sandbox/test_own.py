"""Root gives a unit its workspace (sandbox.own) while the unit may be changing that tree: a
directory swapped for a symlink, a hard link to a file outside, a link planted above the
workspace. Nothing outside the workspace may change owner or mode, whatever the timing;
what is inside is given to the unit (the positive control).

`AAP_TEST_SANDBOX_OFF=1` runs the same attacks against the path-based walk the service used
before (os.walk + lchown + chmod by name), to show the race tests fail then.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
import threading
import time
from pathlib import Path

import pytest

from agents.runtimes.acp_bridge import sandbox

SANDBOX_OFF = os.environ.get("AAP_TEST_SANDBOX_OFF") == "1"
UNIT_UID = 299_991

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown (CI runs as root)")


def path_based_own(path: Path, uid: int) -> None:
    """The walk the service used before: every step by name."""
    os.lchown(path, uid, uid)
    os.chmod(path, 0o700)
    for top, dirs, files in os.walk(path):
        for name in dirs + files:
            child = os.path.join(top, name)
            try:
                info = os.lstat(child)
                if info.st_uid == uid or (not stat.S_ISDIR(info.st_mode) and info.st_nlink > 1):
                    continue
                os.lchown(child, uid, uid)
            except OSError:
                continue


def own(path: Path, uid: int) -> None:
    (path_based_own if SANDBOX_OFF else sandbox.own)(path, uid)


@pytest.fixture
def tree(settings):
    root = Path(tempfile.mkdtemp(prefix="aap-own-"))
    settings.AAP_WORKSPACE_ROOT = root
    outside = Path(tempfile.mkdtemp(prefix="aap-outside-"))
    outside.chmod(0o755)
    for index in range(50):
        (outside / f"f{index}").write_text("outside")
    workspace = root / "tenant" / "sess"
    workspace.mkdir(parents=True)
    yield root, workspace, outside
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(outside, ignore_errors=True)


def outside_changed(outside: Path) -> list[str]:
    changed = [str(p) for p in outside.iterdir() if p.lstat().st_uid != 0]
    if outside.stat().st_uid != 0 or stat.S_IMODE(outside.stat().st_mode) == 0o700:
        changed.append(str(outside))
    return changed


def test_links_in_the_tree_are_never_followed_and_the_rest_is_given(tree):
    root, workspace, outside = tree
    (workspace / "inside.txt").write_text("mine")
    (workspace / "sub").mkdir()
    (workspace / "sub" / "deep.txt").write_text("mine")
    (workspace / "link-to-outside").symlink_to(outside)
    os.link(outside / "f0", workspace / "hardlink")
    own(workspace, UNIT_UID)
    assert (workspace / "inside.txt").stat().st_uid == UNIT_UID  # control
    assert (workspace / "sub" / "deep.txt").stat().st_uid == UNIT_UID
    assert outside_changed(outside) == []


def test_a_link_planted_above_the_workspace_is_not_followed(tree):
    root, workspace, outside = tree
    shutil.rmtree(workspace)
    workspace.symlink_to(outside, target_is_directory=True)  # the unit swapped its workspace
    own(workspace, UNIT_UID)
    assert outside_changed(outside) == []


def test_a_directory_swapped_for_a_symlink_during_the_walk_leads_nowhere(tree):
    root, workspace, outside = tree
    stop = threading.Event()
    victim = workspace / "swap"

    def swapper():
        while not stop.is_set():
            try:
                if victim.is_symlink():
                    victim.unlink()
                    victim.mkdir()
                else:
                    victim.rmdir()
                    victim.symlink_to(outside, target_is_directory=True)
            except OSError:
                pass
            time.sleep(0.0005)

    for index in range(200):
        (workspace / f"file{index}").write_text("mine")
    victim.mkdir()
    thread = threading.Thread(target=swapper, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline and not outside_changed(outside):
            for entry in workspace.iterdir():
                with contextlib.suppress(OSError):
                    os.lchown(entry, 0, 0)
            own(workspace, UNIT_UID)
    finally:
        stop.set()
        thread.join()
    assert (workspace / "file0").stat().st_uid == UNIT_UID  # control
    assert outside_changed(outside) == []
