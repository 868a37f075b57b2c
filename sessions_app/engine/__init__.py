"""The turn engine, in the order a turn crosses it: the queue (waking workers, claiming
turns), the worker, the host every runtime shares, the turn path's SQL (store: a turn's rows,
its ending, history), recovery, live events and the streams that follow them. It never
imports the API."""
