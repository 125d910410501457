"""Kafka's replication rules as pure state machines: no gRPC, no files, no asyncio, no clock.

Inputs are requests, responses and the current time; outputs are state changes and what the
edges (the broker's replica manager, fetchers, log) must do. See partition.py.
"""
