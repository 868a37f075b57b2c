import logging
import os

from celery import Celery
from celery.signals import celeryd_after_setup, worker_ready, worker_shutdown, worker_shutting_down

from infra import process
from infra.process import freeze_startup_heap

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "hosting.settings")

app = Celery("hosting")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@celeryd_after_setup.connect
def _remember_node_name(sender, instance=None, **kwargs):
    process.worker_node = str(sender)
    process.worker_concurrency = int(getattr(instance, "concurrency", 0) or app.conf.worker_concurrency or 1)


@worker_ready.connect
def _load_runtimes(**kwargs):
    from agents.runtimes.acp_bridge.sandbox import harden_host

    harden_host()  # not dumpable: no agent (nor any same-uid process) reads this worker's memory or environment
    # Import heavy runtime modules (the ACP SDK) now, not inside a first turn while its lease runs.
    from agents.runtimes import RUNTIME_KINDS, runtime_class

    for kind in RUNTIME_KINDS:
        try:
            runtime_class(kind)
        except Exception:  # the worker starts without it; its turns fail, saying so
            logging.getLogger(__name__).warning("runtime kind %s cannot be loaded", kind, exc_info=True)
    freeze_startup_heap()
    from sessions_app.engine import worker

    # Ready for turns: its threads take them from PostgreSQL.
    worker.start_worker(process.worker_node, process.worker_concurrency)


@worker_shutting_down.connect
def _stop_serving(**kwargs):
    from sessions_app.engine import worker

    worker.stop_worker()


@worker_shutdown.connect
def _stop_runtimes(**kwargs):
    # After the warm shutdown let the running turns end: agent processes (ACP) stop the way
    # they expect, stdin closed and time to save their sessions, for the next worker to load.
    from agents.runtimes import shutdown_all
    from sessions_app.engine import worker

    worker.drain_worker()
    shutdown_all()
