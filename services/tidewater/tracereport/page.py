"""The report as a self-contained HTML page: plotly.js is inlined, so it opens offline."""

from __future__ import annotations

import html

from tidewater.tracereport import ReportError
from tidewater.tracereport.stages import STAGES, TITLES, TOTAL, LatencyReport
from tidewater.tracereport.text import plural

INSTALL_HINT = "pip install 'tidewater[report]'"


def render_html(report: LatencyReport, summary: str) -> str:
    """`summary` is the text report, shown above the charts."""
    try:
        import plotly.graph_objects as go
    except ImportError:
        raise ReportError(f"--html needs plotly, which is not installed: {INSTALL_HINT}") from None

    totals_ms = [t.stages_ns[TOTAL] / 1e6 for t in report.traces]
    histogram = go.Figure(go.Histogram(x=totals_ms, nbinsx=60, name="traces"))
    histogram.update_layout(
        title="Produce-to-ack latency (send to ack)",
        xaxis_title="ms",
        yaxis_title="produce traces",
    )
    labels = [f"{band.label}<br>({plural(band.count, 'trace')})" for band in report.bands]
    breakdown = go.Figure(
        [
            go.Bar(
                x=labels, y=[band.mean_ns[stage] / 1e6 for band in report.bands], name=TITLES[stage]
            )
            for stage in STAGES
        ]
    )
    breakdown.update_layout(
        barmode="stack",
        title="Where the time goes: mean of each stage, traces banded by total latency",
        yaxis_title="ms",
    )
    charts = histogram.to_html(full_html=False, include_plotlyjs=True) + breakdown.to_html(
        full_html=False, include_plotlyjs=False
    )
    return (
        "<!DOCTYPE html>\n<html><head><meta charset='utf-8'>"
        "<title>Tidewater produce latency</title></head>\n<body>"
        "<h1>Tidewater produce-to-ack latency</h1>\n"
        f"<pre>{html.escape(summary)}</pre>\n{charts}\n</body></html>\n"
    )
