"""Writes of AAP sessions and turns: the rules of the protocol live here, one module per job.

Views validate shapes (protocol serializers) and call one service; tasks call
`execution.turn_execute`. Several rows that change together change in one transaction.
"""
