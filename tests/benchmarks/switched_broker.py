"""`tidewater broker` whose tracing a signal switches off and on, for bench_tracing.py's
--toggle: one cluster measured traced and untraced in turns, without two clusters' bias.

SIGUSR1 switches it off, SIGUSR2 on again: `tracing.ENABLED`, the one test every traced path
of the broker makes first. What tracing set up when the broker started stays: its provider
and trace file, the gRPC instrumentation's interceptors (on calls outside the data plane),
the FetchStreams' declared sampled-out parent. So start it with tracing set up
(`--trace-file`), and switch it only once its fetchers' streams are open (a stream opened
switched off declares nothing: bench_tracing.open_fetch_streams). Each switch is
acknowledged by writing "on" or "off" to `<ready file>.tracing`, which the benchmark waits
for.

Run by ManagedProcess in place of `-m tidewater`: python switched_broker.py broker ARGS...
(ManagedProcess adds --ready-file)."""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from types import FrameType

from tidewater import cli
from tidewater.telemetry import tracing

SWITCH_OFF, SWITCH_ON = signal.SIGUSR1, signal.SIGUSR2


def state_file(ready_file: Path) -> Path:
    """Where a switched broker acknowledges its tracing's state."""
    return ready_file.with_name(ready_file.name + ".tracing")


def main() -> int:
    args = sys.argv[1:]
    acknowledged = state_file(Path(args[args.index("--ready-file") + 1]))

    def switch(signum: int, frame: FrameType | None) -> None:
        # Python runs this on the event loop's thread, between two of its callbacks.
        tracing.ENABLED = signum == SWITCH_ON
        acknowledged.write_text("on" if tracing.ENABLED else "off")

    signal.signal(SWITCH_OFF, switch)
    signal.signal(SWITCH_ON, switch)
    return cli.main(args)


if __name__ == "__main__":
    raise SystemExit(main())
