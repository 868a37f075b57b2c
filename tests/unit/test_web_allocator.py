"""The web process's C allocator (infra/webserver.py `return_large_blocks`); what the setting
does to memory is shown in tests/chaos/test_large_bodies.py."""

from __future__ import annotations

from infra import webserver


def test_the_threshold_is_held_unless_the_operator_chose_one(monkeypatch):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    assert webserver.return_large_blocks() is True  # glibc, as in every image this ships in

    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "4194304")  # glibc read it at start: it stands
    assert webserver.return_large_blocks() is False


def test_another_c_library_is_left_as_it_is(monkeypatch):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)

    class NoMallopt:
        def __init__(self, name):
            pass

    monkeypatch.setattr(webserver.ctypes, "CDLL", NoMallopt)
    assert webserver.return_large_blocks() is False
