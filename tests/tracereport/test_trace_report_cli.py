"""`tidewater trace report` on checked-in trace files, as a user runs it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tidewater.cli import main

DATA = Path(__file__).parent / "data"


def test_report_on_recorded_files(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", "report", str(DATA)]) == 0
    out = capsys.readouterr().out
    assert "read 3 trace files: 38 spans (1 damaged line left out)" in out
    assert "4 complete (acks=all: 4), 1 failed, 1 skipped as partial" in out
    assert "1  no leader Produce span (the leader's trace file missing?)" in out
    assert "retried: 1" in out
    rows = {line[:28].strip(): line[28:].split() for line in out.splitlines()}
    # p50 / p90 / p99 / max over the four traces of data/README.md (nearest rank)
    assert rows["client queueing"] == ["1.000", "2.000", "2.000", "2.000"]
    assert rows["network"] == ["2.000", "20.000", "20.000", "20.000"]
    assert rows["leader append"] == ["0.400", "0.600", "0.600", "0.600"]
    assert rows["replication wait"] == ["4.500", "14.100", "14.100", "14.100"]
    assert rows["leader response"] == ["1.000", "1.500", "1.500", "1.500"]
    assert rows["total (send to ack)"] == ["10.000", "30.000", "30.000", "30.000"]
    last_to_ack = out.split("last follower to ack (acks=all, 4 traces):\n")[1].split("\n")
    assert [line.split() for line in last_to_ack if line] == [
        ["broker", "2", "3", "75.0%"],
        ["broker", "3", "1", "25.0%"],
    ]


def test_html_page_needs_no_network(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "latency.html"
    assert (
        main(
            [
                "trace",
                "report",
                str(DATA / "client.jsonl"),
                str(DATA / "broker-1.jsonl"),
                "--html",
                str(out),
            ]
        )
        == 0
    )
    assert f"wrote {out}" in capsys.readouterr().out
    page = out.read_text()
    assert "<script src=" not in page and "<link " not in page  # plotly.js is inline
    assert "Plotly.newPlot" in page
    assert "produce traces: 4 complete" in page
    for stage in (
        "client queueing",
        "network",
        "leader append",
        "replication wait",
        "leader response",
    ):
        assert f'"name":"{stage}"' in page


def test_html_without_plotly_says_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "plotly", None)  # import plotly now raises ImportError
    monkeypatch.setitem(sys.modules, "plotly.graph_objects", None)
    assert main(["trace", "report", str(DATA), "--html", str(tmp_path / "x.html")]) == 1
    assert "pip install 'tidewater[report]'" in capsys.readouterr().err
    assert not (tmp_path / "x.html").exists()


def test_files_without_produce_traces(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", "report", str(DATA / "broker-3.jsonl")]) == 1
    captured = capsys.readouterr()
    assert "produce traces: 0 complete, 0 failed, 0 skipped" in captured.out
    assert "no complete produce trace" in captured.err


def test_a_bad_file_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text("[]\n{}\n")
    assert main(["trace", "report", str(bad)]) == 1
    assert f"tidewater: {bad}:1: not an OTLP/JSON trace line" in capsys.readouterr().err
