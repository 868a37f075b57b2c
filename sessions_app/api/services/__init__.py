"""Writes of AAP sessions and turns that requests make: the rules of the protocol live here,
one module per job.

Views validate shapes (protocol serializers) and call one service; a worker runs the turn
(sessions_app.engine.worker). Several rows that change together change in one transaction.
"""
