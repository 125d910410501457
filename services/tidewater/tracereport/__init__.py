"""`tidewater trace report`: produce-to-ack latency per stage, from recorded trace files."""


class ReportError(Exception):
    """What stops a report: the message says what to do, for the command line to print."""
