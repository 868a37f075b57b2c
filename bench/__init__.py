"""The benchmark harness: a real stack on this machine, an async load generator over HTTP,
seven scenarios, a table and a JSON results file (`make bench`; see docs/performance.md)."""
