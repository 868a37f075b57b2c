"""CPU time of every process of the stack, to state what one operation costs each of them.

`CpuMeter(stack).snapshot()` reads /proc/<pid>/stat of Daphne, each Celery worker, the
PostgreSQL backends serving the bench database and the fake model; Redis reports its own
CPU (`INFO cpu`), for the whole server: when the server is shared, that figure includes
whatever else used it meanwhile, and the row says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from .stack import BenchStack, cpu_seconds

GROUPS = ("daphne", "workers", "postgres", "redis", "fake model")


@dataclass
class Snapshot:
    per_pid: dict[tuple[str, int], float]
    redis: float | None


class CpuMeter:
    def __init__(self, stack: BenchStack):
        self.stack = stack
        self.database = urlsplit(stack.database_url).path.lstrip("/")

    def _pg_backends(self) -> list[int]:
        import psycopg

        try:
            with psycopg.connect(self.stack.database_url, connect_timeout=5) as conn:
                rows = conn.execute(
                    "SELECT pid FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
                    (self.database,),
                ).fetchall()
        except psycopg.Error:
            return []
        return [row[0] for row in rows]

    def _redis_cpu(self) -> float | None:
        import redis

        try:
            info = redis.Redis.from_url(self.stack.redis_url, socket_timeout=5).info("cpu")
        except redis.RedisError:
            return None
        return float(info.get("used_cpu_user", 0)) + float(info.get("used_cpu_sys", 0))

    def snapshot(self) -> Snapshot:
        pids: list[tuple[str, int]] = []
        if self.stack.web is not None:
            pids.append(("daphne", self.stack.web.pid))
        pids += [("workers", worker.pid) for worker in self.stack.workers]
        pids += [("postgres", pid) for pid in self._pg_backends()]
        pids += [("fake model", pid) for pid in self.stack.fake_pids]
        per_pid = {}
        for group, pid in pids:
            try:
                per_pid[(group, pid)] = cpu_seconds(pid)
            except OSError:  # gone, or another machine's PostgreSQL
                continue
        return Snapshot(per_pid, self._redis_cpu())

    @staticmethod
    def per_operation(before: Snapshot, after: Snapshot, operations: int) -> dict[str, float]:
        """Milliseconds of CPU per operation, by group, and their sum over the service
        (the fake model and the load generator are not the service)."""
        if operations <= 0:
            return {}
        spent = {group: 0.0 for group in GROUPS}
        for (group, pid), seconds in after.per_pid.items():
            spent[group] += seconds - before.per_pid.get((group, pid), 0.0)
        if before.redis is not None and after.redis is not None:
            spent["redis"] = after.redis - before.redis
        result = {group: value * 1000 / operations for group, value in spent.items()}
        result["service"] = sum(result[g] for g in ("daphne", "workers", "postgres", "redis"))
        return result


def describe(cost: dict[str, float]) -> str:
    """`CPU/op ms: service 15.2 = Daphne 4.6 + workers 8.7 + PostgreSQL 1.6 + Redis* 0.3; fake 0.5`."""
    if not cost:
        return "CPU per operation: nothing measured"
    return (
        f"CPU ms/op: service {cost['service']:.2f} = Daphne {cost['daphne']:.2f} + workers "
        f"{cost['workers']:.2f} + PostgreSQL {cost['postgres']:.2f} + Redis {cost['redis']:.2f} "
        f"(whole server); fake model {cost['fake model']:.2f}"
    )
