"""Tidewater: a partitioned, replicated log with Kafka's replication model."""

__version__ = "0.1.0"
