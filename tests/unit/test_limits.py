"""Tenant limits: defaults from settings, a tenant's own values, and fixed windows."""

from __future__ import annotations

import time

from infra.limits import MemoryWindows, RateState, limits_for, ratelimit_headers
from tenancy.models import Tenant


def test_limits_default_to_the_settings_and_a_tenant_overrides_them(settings):
    settings.AAP_TENANT_MAX_RUNNING_TURNS = 7
    settings.AAP_TENANT_TURNS_PER_MINUTE = 90
    defaults = limits_for(Tenant(name="a"))
    assert (defaults.max_running_turns, defaults.turns_per_minute) == (7, 90)
    own = limits_for(Tenant(name="b", max_running_turns=2, turns_per_minute=0))
    assert (own.max_running_turns, own.turns_per_minute) == (2, 0)  # 0: no limit


def test_a_window_admits_up_to_its_limit_then_refuses_until_it_resets():
    windows = MemoryWindows()
    taken = [windows.take("k", 3, 0.3)[0] for _ in range(5)]
    assert taken == [True, True, True, False, False]
    refused, state = windows.take("k", 3, 0.3)
    assert not refused and state.count == 3 and 0 < state.reset <= 0.3
    time.sleep(0.35)
    assert windows.take("k", 3, 0.3)[0]


def test_headers_follow_the_ietf_draft():
    headers = ratelimit_headers(RateState("turns", 60, 60, 12, 41.2))
    assert headers == {"RateLimit-Policy": '"turns";q=60;w=60', "RateLimit": '"turns";r=12;t=42'}


def test_turns_are_admitted_when_the_rate_window_cannot_be_read(monkeypatch):
    import infra.limits as limits

    class Unreachable:
        def take(self, *args):
            raise ConnectionError("redis is restarting")

        def peek(self, *args):
            raise ConnectionError("redis is restarting")

    monkeypatch.setattr(limits, "windows", lambda: Unreachable())
    tenant = Tenant(name="c", turns_per_minute=1)
    limits.take_turn(tenant)  # admitted: running turns stay bounded by PostgreSQL's count
    assert limits.turns_rate_state(tenant) is None  # no headers rather than a failed request
