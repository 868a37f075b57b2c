"""Start-up of a long-running process (web or worker)."""

import gc

#: This worker's Celery node name ('' outside a worker): turns pinned to this process are routed to it.
worker_node = ""
# How many turns this worker runs at once (its pool's size); 0 outside a worker.
worker_concurrency = 0


def freeze_startup_heap() -> None:
    """Move everything start-up built (Django, Celery, the runtimes: most of the heap) out of
    the garbage collector's reach. Its full collections otherwise walked all of it, pausing
    a worker for 90-260 ms under load: every event of every running turn waited meanwhile
    (docs/performance.md, scenario 5). What turns allocate later is collected as usual."""
    gc.collect()
    gc.freeze()
