"""The producer's spans of one batch (README, Tracing): `send <topic>` from the batch's first
record to its final ack or failure, and `batch.wait` for its time in the accumulator. Retries
send the same trace context, so every attempt's `Produce` on a leader is a child of `send`."""

from __future__ import annotations

from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer

from tidewater.telemetry import tracing


class BatchTrace:
    __slots__ = ("carrier", "span", "tracer")

    def __init__(self, tracer: Tracer, topic: str, partition: int, acks: int) -> None:
        self.tracer = tracer
        self.span: Span = tracer.start_span(
            f"send {topic}",
            kind=SpanKind.PRODUCER,
            attributes={
                "messaging.system": tracing.MESSAGING_SYSTEM,
                "messaging.operation.type": "send",
                "messaging.destination.name": topic,
                "messaging.destination.partition.id": str(partition),
                "tidewater.acks": acks,
            },
        )
        # What each attempt's request carries in PartitionProduceData.trace_context.
        self.carrier: dict[str, str] = {}
        tracing.inject(self.span, self.carrier)

    def drained(self) -> None:
        """The batch leaves the accumulator for its first attempt (sampled out: no span)."""
        start_ns: int = getattr(self.span, "start_time", 0)
        tracing.record_child(self.span, "batch.wait", start_ns, tracer=self.tracer)

    def end(
        self, records: int, size: int, base_offset: int | None, error: BaseException | None
    ) -> None:
        if not self.span.is_recording():
            return  # sampled out: nothing to record, nothing to end
        self.span.set_attributes(
            {"messaging.batch.message_count": records, "tidewater.batch.bytes": size}
        )
        if base_offset is not None:
            self.span.set_attribute("tidewater.base_offset", base_offset)
        if error is not None:
            self.span.record_exception(error)
            self.span.set_status(Status(StatusCode.ERROR, str(error)))
        self.span.end()
