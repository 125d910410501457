"""A broker raises its open-file limit as far as it may."""

from __future__ import annotations

import subprocess
import sys


def test_soft_open_file_limit_is_raised_to_the_hard_limit() -> None:
    # In a child process: the test runner's own limits stay as they are.
    script = (
        "import resource\n"
        "from tidewater.broker.limits import raise_open_file_limit\n"
        "_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))\n"
        "expected = 256 if hard == resource.RLIM_INFINITY else hard\n"
        "assert raise_open_file_limit() == expected\n"
        "assert resource.getrlimit(resource.RLIMIT_NOFILE) == (expected, hard)\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=30)
