"""The platform the apps stand on: errors and their HTTP mapping, logs, outages, metrics,
tracing, crypto, limits, Redis connections, the PostgreSQL backend and the web server's
configuration. It imports no app."""
