"""`make bench` (`python -m bench`): start a stack, run the scenarios, print the table, write
bench/results/<date>-<profile>.json.

    python -m bench              the quick profile (about 6 minutes on 2 cores)
    FULL=1 python -m bench       the long profile
    python -m bench --smoke      a second or two per scenario: checks the harness, not the service
    python -m bench --only 2,5   some scenarios only

BENCH_DATABASE_URL (default: DATABASE_URL's server, database aap_bench; created, migrated and
emptied) and BENCH_REDIS_URL (default: REDIS_URL's server, db 13; flushed) choose where the
stack keeps its data. Errors are counted and reported beside each figure; the exit status is
non-zero only when the harness itself broke.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import sys
import tempfile
import time
import traceback
from dataclasses import asdict
from pathlib import Path

from .fairness import fair_share
from .llm import LlmScenarios
from .profiles import FULL, QUICK, SMOKE
from .report import Row, machine, markdown_table, service_versions, table, write_results
from .scenarios import Bench
from .stack import ROOT, BenchStack, raise_fd_limit

# 11 and 5 last: they replace the Celery workers (with a thread for every stream's turn).
ORDER = ["1", "2", "3", "4", "6", "7", "8", "9", "10", "12", "13", "11", "5"]
QUICK_BUDGET_SECONDS = 400.0


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in {"1", "true", "yes", "on"}


async def run(bench: Bench, only: list[str], started: float, budget: float) -> bool:
    """Run the scenarios; returns False when one of them crashed (a harness failure)."""
    from .load import Api

    stack, profile = bench.stack, bench.p
    bench.api = Api(stack.base_url, stack.token)
    healthy = True
    llm = LlmScenarios(bench)
    scenarios = {
        "1": ("session create rate", bench.session_create),
        "2": ("echo turns, stream none", bench.echo_turns),
        "3": ("time to first byte", bench.first_byte),
        "4": ("relay latency", bench.relay),
        "6": ("history growth", bench.history_growth),
        "7": ("openai runtime overhead", bench.llm),
        "8": ("fair share between tenants", lambda: fair_share(bench)),
        "9": ("LLM turn latency by turn index", llm.session_length),
        "10": ("short LLM turns", llm.short_turns),
        "11": ("concurrent LLM streams", llm.concurrent_streams),
        "12": ("create + tool + answer conversation", llm.conversation),
        "13": ("oversized request refused", bench.oversized_refusal),
        "5": ("open streams", None),
    }
    try:
        for key in ORDER:
            if key not in only:
                continue
            title, call = scenarios[key]
            log(f"==> scenario {key}: {title} ({time.monotonic() - started:.0f} s elapsed)")
            # The load generator's own pauses must not count against the service: what the
            # earlier scenarios left is frozen, so a full collection does not walk it again.
            gc.collect()
            gc.freeze()
            try:
                if key == "5":
                    deadline = min(time.monotonic() + profile.stream_budget, started + budget)
                    await bench.open_streams(deadline)
                else:
                    await call()
            except Exception as exc:
                healthy = False
                log(traceback.format_exc())
                bench.rows.append(
                    Row(
                        key,
                        f"scenario {key} ({title})",
                        "",
                        errors=1,
                        skipped=f"the harness crashed: {type(exc).__name__}: {exc}"[:300],
                    )
                )
    finally:
        await bench.api.close()
    return healthy


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny runs that check the harness")
    parser.add_argument("--only", default="", help="comma-separated scenario numbers (default: all)")
    args = parser.parse_args()
    profile = (
        SMOKE
        if args.smoke or _truthy(os.environ.get("BENCH_SMOKE"))
        else (FULL if _truthy(os.environ.get("FULL")) else QUICK)
    )
    only = [s.strip() for s in args.only.split(",") if s.strip()] or ORDER
    budget = QUICK_BUDGET_SECONDS if profile is not FULL else 3 * 3600.0
    started = time.monotonic()
    machine_at_start = machine()  # its load average: others' work shares the cores
    os.chdir(ROOT)

    fd_limit = raise_fd_limit()
    log_dir = Path(tempfile.mkdtemp(prefix="aap-bench-logs-"))
    stack = BenchStack(log_dir=log_dir)
    # Scenario 6 seeds sessions with up to 10,000 messages, more than the service lets a
    # tenant send by default (AAP_MAX_SEED_MESSAGES): the bench raises it as an operator would.
    stack.env["AAP_MAX_SEED_MESSAGES"] = str(max(profile.history_lengths))
    log(f"==> bench profile '{profile.name}', logs in {log_dir}, open-files limit {fd_limit}")
    bench = Bench(stack, profile, log)
    # Waiting for database room must leave time for the open-streams scenario and teardown.
    bench.deadline = started + budget - min(profile.stream_budget, 60.0)
    healthy = True
    try:
        log("==> preparing the database and Redis")
        stack.flush_redis()
        # Processes start while the database is prepared (they touch it only when asked).
        stack.start_web(wait=False)
        stack.start_workers(profile.workers, profile.worker_concurrency, wait=False)
        stack.prepare(ROOT / "bench" / "agents.yaml")
        stack.wait_workers()
        stack.wait_web()
        log(
            f"==> stack up in {time.monotonic() - started:.0f} s: Daphne pid {stack.web.pid} on {stack.base_url}, "
            f"{profile.workers} Celery workers × {profile.worker_concurrency} threads"
        )
        healthy = asyncio.run(run(bench, only, started, budget))
    except Exception:
        log(traceback.format_exc())
        healthy = False
    finally:
        stack.stop()

    rows = bench.rows
    elapsed = time.monotonic() - started
    payload = {
        "profile": profile.name,
        "preliminary": True,
        "elapsed_seconds": round(elapsed, 1),
        "machine": {**machine_at_start, "loadavg_at_end": os.getloadavg()},
        "services": service_versions(stack.database_url, stack.redis_url),
        "config": {"profile": asdict(profile), "fd_limit": fd_limit},
        "details": bench.details,
        "rows": rows,
    }
    path = write_results(payload, profile.name)
    print()
    print(table(rows))
    print()
    errors = sum(row.errors for row in rows)
    failing = [row for row in rows if row.errors]
    if errors:
        print("!" * 78)
        print(f"!!! THIS RUN HAD ERRORS: {errors} in {len(failing)} figure(s); those figures are not trustworthy:")
        for row in failing:
            print(f"!!!   [{row.scenario}] {row.name}: {row.errors} error(s), e.g. {row.error_samples[:1]}")
        print("!" * 78)
    skipped = [row for row in rows if row.skipped]
    for row in skipped:
        print(f"*** SKIPPED [{row.scenario}] {row.name}: {row.skipped}")
    loads = " → ".join(
        "/".join(f"{x:.2f}" for x in load) for load in (machine_at_start["loadavg_at_start"], os.getloadavg())
    )
    print(f"results: {path.relative_to(ROOT)}   ({elapsed:.0f} s, profile {profile.name}, load average {loads})")
    if os.environ.get("BENCH_MARKDOWN"):
        Path(os.environ["BENCH_MARKDOWN"]).write_text(markdown_table(rows) + "\n")
    if not healthy:
        print("the bench harness itself failed; see the traceback above", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
