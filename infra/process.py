"""Start-up of a long-running process (web or worker)."""

import gc

#: This worker's Celery node name ('' outside a worker): turns pinned to this process are routed to it.
worker_node = ""
# How many turns this worker runs at once (its pool's size); 0 outside a worker.
worker_concurrency = 0


def freeze_startup_heap() -> None:
    """Move everything start-up built (Django, Celery, the runtimes: most of the heap) out of
    the garbage collector's reach, so that no full collection walks it: while a collection
    runs, every event of every running turn in the process waits (scenario 5 of
    docs/performance.md shows such pauses as late ticks). What turns allocate later is
    collected as usual."""
    gc.collect()
    gc.freeze()
