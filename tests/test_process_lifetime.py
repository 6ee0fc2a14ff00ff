"""A killed flow takes the processes it started along, whatever they are (SGLang's launcher does not
watch its parent the way the transformers engine does)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests.test_flow import gone

STARTER = """
import sys, time
from pathlib import Path
from infra.hosts import LocalHost, free_port
child = LocalHost().start(["sleep", "300"], Path(sys.argv[1]), free_port())
print(child.popen.pid, flush=True)
time.sleep(300)
"""


def test_a_child_started_on_localhost_dies_with_a_sigkilled_parent(tmp_path):
    parent = subprocess.Popen([sys.executable, "-c", STARTER, str(tmp_path / "child.log")], stdout=subprocess.PIPE,
                              cwd=os.getcwd())
    child = int(parent.stdout.readline())
    assert not gone(child)
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 5
    while not gone(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(child), "the child outlived its SIGKILLed parent"

