"""Per-session workspaces and the confined `fs/*` file access ACP agents get.

A workspace is `AAP_WORKSPACE_ROOT/<tenant>/<session>`. An agent names files by absolute
path; a path is served only when it lies inside the session's workspace without `..` and
without following a symlink. Files are opened component by component relative to the
workspace directory with O_NOFOLLOW, so a symlink planted between the check and the open
cannot lead outside either.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import stat
from pathlib import Path

from django.conf import settings

SAFE_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}$")


class WorkspaceError(Exception):
    """A refused or failed file access; `code` is the JSON-RPC error code for the agent."""

    INVALID = -32602
    NOT_FOUND = -32002

    def __init__(self, message: str, code: int = INVALID):
        super().__init__(message)
        self.code = code


def root() -> Path:
    return Path(os.path.realpath(settings.AAP_WORKSPACE_ROOT))


def _safe(name: str) -> str:
    if not SAFE_NAME_RE.match(name or "") or name in (".", ".."):
        raise ValueError(f"{name!r} cannot name a workspace directory")
    return name


def workspace_path(tenant: str, session_id: str) -> Path:
    return root() / _safe(tenant) / _safe(session_id)


def tenant_path(tenant: str) -> Path:
    return root() / _safe(tenant)


def agent_home(tenant: str, agent_name: str) -> Path:
    """The HOME of a tenant's shared agent processes (isolation `tenant`): outside every
    session workspace."""
    return root() / _safe(tenant) / ".agents" / _safe(agent_name)


def session_home(tenant: str, session_id: str, agent_name: str) -> Path:
    """The HOME of a session's own agent process (isolation `session`): outside its workspace,
    removed with the session."""
    return root() / _safe(tenant) / ".session-homes" / _safe(session_id) / _safe(agent_name)


def ensure_dir(path: Path) -> Path:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def remove_workspace(tenant: str, session_id: str) -> None:
    shutil.rmtree(workspace_path(tenant, session_id), ignore_errors=True)
    shutil.rmtree(root() / _safe(tenant) / ".session-homes" / _safe(session_id), ignore_errors=True)


def relative_parts(workspace: Path, path: str) -> list[str]:
    """The components of `path` below `workspace`; raises WorkspaceError for any escape."""
    if not isinstance(path, str) or not path.startswith("/"):
        raise WorkspaceError("Paths must be absolute paths inside the session's workspace.")
    if "\x00" in path:
        raise WorkspaceError("Paths cannot contain NUL bytes.")
    if ".." in path.split("/"):
        raise WorkspaceError("Paths cannot contain '..'.")
    base = str(workspace)
    normal = os.path.normpath(path)
    if normal != base and not normal.startswith(base + "/"):
        raise WorkspaceError("The path is outside the session's workspace.")
    return [part for part in normal[len(base) :].split("/") if part not in ("", ".")]


def _open(workspace: Path, parts: list[str], flags: int, *, make_dirs: bool, owner: int | None = None) -> int:
    """Open `parts` below `workspace` without following any symlink; returns a file descriptor."""
    if not parts:
        raise WorkspaceError("The path names the workspace itself, not a file.")
    directory = os.open(workspace, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        for part in parts[:-1]:
            try:
                child = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=directory)
            except FileNotFoundError:
                if not make_dirs:
                    raise WorkspaceError("No such file in the workspace.", WorkspaceError.NOT_FOUND) from None
                os.mkdir(part, 0o700, dir_fd=directory)
                child = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=directory)
                if owner is not None:  # the sandboxed agent's uid must own what is made for it
                    os.fchown(child, owner, owner)
            except OSError as exc:
                raise _refusal(exc) from None
            os.close(directory)
            directory = child
        try:
            return os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600, dir_fd=directory)
        except FileNotFoundError:
            raise WorkspaceError("No such file in the workspace.", WorkspaceError.NOT_FOUND) from None
        except OSError as exc:
            raise _refusal(exc) from None
    finally:
        os.close(directory)


def _refusal(exc: OSError) -> WorkspaceError:
    if exc.errno in (errno.ELOOP, errno.EMLINK):
        return WorkspaceError("Symlinks are not followed in the workspace.")
    if exc.errno == errno.ENOTDIR:
        return WorkspaceError("A component of the path is not a directory.")
    if exc.errno == errno.EISDIR:
        return WorkspaceError("The path is a directory, not a file.")
    return WorkspaceError(f"The file cannot be opened ({errno.errorcode.get(exc.errno or 0, 'error')}).")


def _check_regular(fd: int) -> os.stat_result:
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise WorkspaceError("Only regular files can be read or written.")
    if info.st_nlink > 1:
        raise WorkspaceError("Files with several hard links are not served.")
    return info


def read_text(workspace: Path, path: str, *, line: int | None, limit: int | None, max_bytes: int) -> str:
    """The text of a workspace file (optionally `limit` lines from 1-based `line`)."""
    fd = _open(workspace, relative_parts(workspace, path), os.O_RDONLY, make_dirs=False)
    with os.fdopen(fd, "rb") as handle:
        info = _check_regular(fd)
        if info.st_size > max_bytes:
            raise WorkspaceError(f"The file is larger than {max_bytes} bytes.")
        data = handle.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise WorkspaceError(f"The file is larger than {max_bytes} bytes.")
    text = data.decode("utf-8", errors="replace")
    if line is None and limit is None:
        return text
    lines = text.splitlines(keepends=True)
    start = max(int(line or 1), 1) - 1
    end = start + int(limit) if limit is not None else None
    return "".join(lines[start:end])


def write_text(workspace: Path, path: str, content: str, *, max_bytes: int, owner: int | None = None) -> None:
    """Create or replace a workspace file (missing parent directories are created), owned by
    `owner` (the sandboxed agent's uid) when given."""
    data = content.encode("utf-8")
    if len(data) > max_bytes:
        raise WorkspaceError(f"The content is larger than {max_bytes} bytes.")
    fd = _open(workspace, relative_parts(workspace, path), os.O_WRONLY | os.O_CREAT, make_dirs=True, owner=owner)
    with os.fdopen(fd, "wb") as handle:
        _check_regular(fd)
        if owner is not None:
            os.fchown(fd, owner, owner)
        handle.truncate(0)
        handle.write(data)


def confined_dir(workspace: Path, path: str | None) -> Path:
    """A working directory for a terminal command: the workspace or a directory inside it."""
    if path is None:
        return workspace
    parts = relative_parts(workspace, path)
    current = workspace
    for part in parts:
        current = current / part
        if current.is_symlink() or not current.is_dir():
            raise WorkspaceError("The working directory must be a directory inside the workspace.")
    return current
