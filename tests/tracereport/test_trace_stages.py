"""The stage arithmetic of the latency report, on hand-built spans."""

from __future__ import annotations

import itertools
from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from tidewater.stats import percentile
from tidewater.tracereport.otlp_json import Span
from tidewater.tracereport.stages import (
    STAGES,
    TOTAL,
    ProduceTrace,
    Skip,
    latency_report,
    produce_trace,
)

MS = 1_000_000
_ids = itertools.count(1)


def _span(
    trace: str,
    name: str,
    kind: int,
    start: float,
    end: float,
    parent: Span | None,
    status: int = 0,
    **attrs: object,
) -> Span:
    return Span(
        trace_id=trace,
        span_id=f"{next(_ids):016x}",
        parent_span_id=parent.span_id if parent else "",
        name=name,
        kind=kind,
        start_ns=round(start * MS),
        end_ns=round(end * MS),
        attributes=attrs,  # type: ignore[arg-type]
        status_code=status,
    )


def produce(
    trace: str,
    send: tuple[float, float] = (0, 10),
    wait: tuple[float, float] = (0, 2),
    attempts: tuple[tuple[float, float], ...] = ((3, 9),),
    append: tuple[float, float] = (3.5, 4),
    replication: tuple[float, float] | None = (4, 8.5),
    last_follower: int = 2,
    acks: int = -1,
    send_status: int = 0,
) -> list[Span]:
    """The spans of one produce trace (times in ms): the client's, then the leader's."""
    root = _span(trace, "send orders", 4, *send, None, send_status, **{"tidewater.acks": acks})
    spans = [root, _span(trace, "batch.wait", 1, *wait, root)]
    for attempt in attempts:
        spans.append(_span(trace, "Produce", 2, *attempt, root))
    leader = spans[-1]
    spans.append(_span(trace, "log.append", 1, *append, leader))
    if replication is not None:
        spans.append(
            _span(
                trace,
                "replication.wait",
                1,
                *replication,
                leader,
                **{"tidewater.last_follower_id": last_follower},
            )
        )
    return spans


def complete(spans: list[Span]) -> ProduceTrace:
    trace = produce_trace(spans)
    assert isinstance(trace, ProduceTrace), trace
    return trace


def without(spans: list[Span], name: str) -> list[Span]:
    return [s for s in spans if s.name != name]


def ms(report_value: int) -> float:
    return report_value / MS


def test_stages_of_one_trace() -> None:
    stages = {stage: ms(v) for stage, v in complete(produce("a")).stages_ns.items()}
    assert stages == {
        "queueing": 2.0,  # batch.wait
        "network": 2.0,  # 10 - 2 - 6
        "append": 0.5,
        "replication": 4.5,
        "response": 1.0,  # 6 - 0.5 - 4.5
        TOTAL: 10.0,
    }


@given(
    durations=st.lists(st.integers(min_value=0, max_value=10**9), min_size=6, max_size=6),
    acks=st.sampled_from([-1, 0, 1]),
)
def test_stages_add_up_to_the_send_span(durations: list[int], acks: int) -> None:
    wait, gap, append, replication, leader_rest, return_trip = (d / MS for d in durations)
    produce_start = wait + gap
    append_end = produce_start + append
    wait_end = append_end + (replication if acks == -1 else 0)
    produce_end = wait_end + leader_rest
    spans = produce(
        "b",
        send=(0, produce_end + return_trip),
        wait=(0, wait),
        attempts=((produce_start, produce_end),),
        append=(produce_start, append_end),
        replication=(append_end, wait_end) if acks == -1 else None,
        acks=acks,
    )
    stages = complete(spans).stages_ns
    send = spans[0]
    assert sum(stages[s] for s in STAGES) == stages[TOTAL] == send.duration_ns
    by_name = {s.name: s.duration_ns for s in spans}
    assert stages["queueing"] == by_name["batch.wait"]
    assert stages["append"] == by_name["log.append"]
    assert stages["replication"] == by_name.get("replication.wait", 0)


def test_a_retried_batch_is_measured_on_its_last_attempt() -> None:
    spans = produce(
        "c",
        send=(0, 30),
        wait=(0, 2),
        attempts=((3, 5), (20, 28)),
        append=(20, 21),
        replication=(21, 27),
    )
    trace = complete(spans)
    assert trace.attempts == 2
    stages = trace.stages_ns
    assert ms(stages["network"]) == 30 - 2 - 8  # the first attempt and the backoff count here
    assert ms(stages["response"]) == 8 - 1 - 6


def test_the_acked_attempt_is_found_by_its_offset_whatever_the_leaders_clocks_say() -> None:
    """Review 25 M4: the failed first attempt's leader ran 60 ms ahead of the new leader,
    which acked the retry: taken by start time, the failed attempt was "the last", and the
    trace was skipped as NO_ACKED_PRODUCE."""
    spans = produce("skew", send=(0, 30), attempts=((63, 65), (20, 28)), append=(20, 21))
    first = next(s for s in spans if s.name == "Produce")
    spans[spans.index(first)] = replace(first, status_code=2)
    spans[0] = replace(spans[0], attributes={**spans[0].attributes, "tidewater.base_offset": 7})
    acked = next(s for s in spans if s.name == "Produce" and s.status_code == 0)
    spans[spans.index(acked)] = replace(
        acked, attributes={**acked.attributes, "tidewater.base_offset": 7}
    )
    trace = complete(spans)
    assert (trace.attempts, ms(trace.stages_ns["network"])) == (2, 30 - 2 - 8)


def test_every_send_in_one_trace_is_measured() -> None:
    """Review 25 M3: an application sending several batches inside one span of its own gets
    one trace holding several sends; only the first was measured, the rest dropped."""
    first = produce("app", send=(0, 10))
    second = produce("app", send=(0, 20))
    report = latency_report(first + second)
    assert sorted(ms(t.stages_ns[TOTAL]) for t in report.traces) == [10.0, 20.0]


def test_acks_1_has_no_replication_wait() -> None:
    trace = complete(produce("d", replication=None, acks=1))
    assert trace.stages_ns["replication"] == 0
    assert ms(trace.stages_ns["response"]) == 6 - 0.5
    assert trace.last_follower_id is None


def test_percentiles_are_nearest_rank_over_the_traces() -> None:
    spans = [s for i in range(1, 101) for s in produce(f"t{i}", send=(0, 10 + i))]
    report = latency_report(spans)
    assert len(report.traces) == 100
    total = {q: ms(v) for q, v in report.percentiles[TOTAL].items()}
    assert total == {"p50": 60.0, "p90": 100.0, "p99": 109.0, "max": 110.0}
    # Only the network stage varied; the others are one value at every percentile.
    assert {ms(v) for v in report.percentiles["append"].values()} == {0.5}
    assert percentile([7], 0.99) == 7
    assert percentile([1, 2, 3, 4], 0.5) == 2


def test_last_follower_to_ack_is_counted_most_often_first() -> None:
    followers = [3, 2, 3, 4, 3, 2]
    spans = [s for i, f in enumerate(followers) for s in produce(f"f{i}", last_follower=f)]
    assert latency_report(spans).last_to_ack == [(3, 3), (2, 2), (4, 1)]


def moved_leader(trace: str) -> list[Span]:
    """A retried batch whose first leader failed it and whose second leader's file is absent."""
    spans = without(produce(trace, attempts=((3, 5),), replication=None), "log.append")
    failed = next(s for s in spans if s.name == "Produce")
    return [s for s in spans if s is not failed] + [replace(failed, status_code=2)]


def test_partial_traces_are_skipped_and_counted_by_reason() -> None:
    spans = [
        *moved_leader("moved-leader"),
        *produce("whole"),
        *[
            s
            for s in produce("no-client")
            if s.name in ("Produce", "log.append", "replication.wait")
        ],
        *without(produce("no-wait"), "batch.wait"),
        *without(without(produce("no-leader"), "Produce"), "log.append"),
        *without(produce("no-append"), "log.append"),
        *without(produce("no-replication"), "replication.wait"),
        *without(produce("also-no-leader"), "Produce"),
    ]
    report = latency_report(spans)
    assert [t.trace_id for t in report.traces] == ["whole"]
    assert report.skipped == {
        Skip.NO_SEND: 1,
        Skip.NO_BATCH_WAIT: 1,
        Skip.NO_PRODUCE: 2,
        Skip.NO_ACKED_PRODUCE: 1,
        Skip.NO_APPEND: 1,
        Skip.NO_REPLICATION_WAIT: 1,
    }
    assert report.skipped_total == 7


def test_failed_sends_and_other_traces_are_not_latencies() -> None:
    fetch = _span("fetch", "replica.fetch", 3, 0, 5, None)
    spans = [
        *produce("ok"),
        *produce("failed", send_status=2),
        fetch,
        _span("fetch", "Fetch", 2, 1, 4, fetch),
    ]
    report = latency_report(spans)
    assert [t.trace_id for t in report.traces] == ["ok"]
    assert report.failed == 1
    assert report.skipped == {}


def test_bands_show_the_mean_stages_of_the_slow_traces() -> None:
    spans = [s for i in range(1, 101) for s in produce(f"t{i}", send=(0, 10 + i))]
    bands = latency_report(spans).bands
    assert [(b.label, b.count) for b in bands] == [
        ("fastest 50%", 50),
        ("p50-p90", 40),
        ("p90-p99", 9),
        ("slowest 1%", 1),
    ]
    slowest = bands[-1].mean_ns
    assert ms(slowest[TOTAL]) == 110
    assert sum(slowest[s] for s in STAGES) == slowest[TOTAL]


def test_no_traces_no_percentiles() -> None:
    report = latency_report([])
    assert report.traces == () and report.percentiles == {} and report.bands == ()
