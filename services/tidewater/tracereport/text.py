"""The report as the terminal shows it."""

from __future__ import annotations

from collections import Counter

from tidewater.tracereport.otlp_json import TraceFiles
from tidewater.tracereport.stages import QUANTILES, STAGES, TITLES, TOTAL, LatencyReport

ACKS_NAMES = {-1: "all", 0: "0", 1: "1"}


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'s' * (count != 1)}"


def render_text(report: LatencyReport, source: TraceFiles) -> str:
    read = f"read {plural(len(source.files), 'trace file')}: {plural(len(source.spans), 'span')}"
    if source.damaged_lines:
        read += f" ({plural(source.damaged_lines, 'damaged line')} left out)"
    lines = [read]
    acks = Counter(ACKS_NAMES.get(t.acks, str(t.acks)) for t in report.traces)
    lines.append(
        f"produce traces: {len(report.traces)} complete"
        + (f" ({', '.join(f'acks={a}: {n}' for a, n in sorted(acks.items()))})" * bool(acks))
        + f", {report.failed} failed, {report.skipped_total} skipped as partial"
    )
    for reason, count in sorted(report.skipped.items(), key=lambda item: -item[1]):
        lines.append(f"  {count:>8}  {reason}")
    retried = sum(1 for t in report.traces if t.attempts > 1)
    if retried:
        lines.append(f"  retried: {retried} (their earlier attempts count as network)")
    if not report.traces:
        return "\n".join(lines)

    lines += ["", f"{'produce-to-ack latency, ms':<28}" + "".join(f"{q:>10}" for q, _ in QUANTILES)]
    for stage in (*STAGES, TOTAL):
        row = report.percentiles[stage]
        lines.append(
            f"  {TITLES[stage]:<26}" + "".join(f"{row[q] / 1e6:>10.3f}" for q, _ in QUANTILES)
        )
    lines.append("(each row is that stage's own distribution: the stages' p99s do not add up to")
    lines.append(" the total's p99, but each trace's stages add up to its total)")

    if report.last_to_ack:
        waited = sum(count for _, count in report.last_to_ack)
        lines += ["", f"last follower to ack (acks=all, {waited} traces):"]
        for follower, count in report.last_to_ack:
            lines.append(f"  broker {follower:<6}{count:>8}  {100 * count / waited:5.1f}%")
    return "\n".join(lines)
