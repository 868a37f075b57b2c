"""Rows of figures, the printed table, the machine description and the JSON results file."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import subprocess
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclass
class Row:
    scenario: str
    name: str
    unit: str  # of the figures: "ms", "turns/s", "KB", "x", ...
    p50: float | None = None
    p95: float | None = None
    p99: float | None = None
    max: float | None = None
    value: float | None = None  # a rate, a ratio, a count
    value_unit: str = ""  # of `value` when it differs from `unit` (a rate beside latencies: "/s")
    n: int = 0  # how many samples the figures summarise
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    target: str = ""
    met: bool | None = None  # None: no target, or not measured
    note: str = ""
    skipped: str = ""  # why the figure could not be measured

    @property
    def status(self) -> str:
        if self.skipped:
            return "SKIPPED"
        if self.met is None:
            return "-" if not self.errors else "ERRORS"
        return ("met" if self.met else "MISSED") + (" (errors)" if self.errors else "")


def _fmt(value: float | None) -> str:
    if value is None:
        return ""
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def _ordered(rows: list[Row]) -> list[Row]:
    # Numerically (10 after 9); stable: run order within a scenario.
    return sorted(rows, key=lambda row: (int(row.scenario) if row.scenario.isdigit() else 99, row.scenario))


def table(rows: list[Row]) -> str:
    rows = _ordered(rows)
    headers = ["#", "measure", "unit", "p50", "p95", "p99", "rate/value", "n", "errors", "target", "status"]
    lines = []
    for row in rows:
        if row.skipped:
            why = row.skipped if len(row.skipped) <= 60 else row.skipped[:57] + "..."  # in full below the table
            lines.append([row.scenario, row.name, "", "", "", "", "", "", "", row.target, f"SKIPPED: {why}"])
            continue
        lines.append(
            [
                row.scenario,
                row.name,
                row.unit,
                _fmt(row.p50),
                _fmt(row.p95),
                _fmt(row.p99),
                _fmt(row.value),
                str(row.n or ""),
                str(row.errors),
                row.target,
                row.status,
            ]
        )
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(headers)]
    out = [" | ".join(h.ljust(w) for h, w in zip(headers, widths)), "-+-".join("-" * w for w in widths)]
    out += [" | ".join(cell.ljust(w) for cell, w in zip(line, widths)) for line in lines]
    return "\n".join(out)


def markdown_table(rows: list[Row]) -> str:
    """The same table in Markdown, for docs/performance.md."""
    out = [
        "| # | measure | p50 | p95 | p99 | rate / value | errors | target | status |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in _ordered(rows):
        unit = f" {row.unit}" if row.unit else ""
        if row.skipped:
            out.append(f"| {row.scenario} | {row.name} | | | | | | {row.target} | **skipped: {row.skipped}** |")
            continue
        cells = [_fmt(row.p50), _fmt(row.p95), _fmt(row.p99)]
        cells = [c + unit if c else "" for c in cells]
        value_unit = row.value_unit or unit
        value = _fmt(row.value) + value_unit if row.value is not None else ""
        out.append(
            f"| {row.scenario} | {row.name} | {' | '.join(cells)} | {value} | {row.errors} | {row.target} | {row.status} |"
        )
    return "\n".join(out)


def machine() -> dict:
    info = {
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "loadavg_at_start": os.getloadavg(),
    }
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as meminfo:
            info["memory_mib"] = int(meminfo.readline().split()[1]) // 1024
    except OSError:
        pass
    return info


def service_versions(database_url: str, redis_url: str) -> dict:
    versions = {}
    try:
        import psycopg

        with psycopg.connect(database_url) as conn:
            versions["postgresql"] = conn.execute("SHOW server_version").fetchone()[0]
            versions["postgresql_max_connections"] = int(conn.execute("SHOW max_connections").fetchone()[0])
    except Exception as exc:
        versions["postgresql"] = f"unknown ({type(exc).__name__})"
    try:
        import redis

        versions["redis"] = redis.Redis.from_url(redis_url).info("server")["redis_version"]
    except Exception as exc:
        versions["redis"] = f"unknown ({type(exc).__name__})"
    with contextlib.suppress(Exception):
        versions["git_commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=RESULTS_DIR.parent.parent,
        ).stdout.strip()
    return versions


def write_results(payload: dict, profile: str) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now().strftime("%Y-%m-%d-%H%M%S")
    path = RESULTS_DIR / f"{stamp}-{profile}.json"
    payload = {**payload, "rows": [asdict(row) for row in payload["rows"]]}
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return path
