"""The turn engine: waking workers and claiming turns, the worker, the host every runtime
shares, the turn path's SQL, history, endings, recovery, live events and the streams that
follow them. It never imports the API."""
