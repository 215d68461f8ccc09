"""OpenReward test helpers: the example ORS server as a subprocess on 127.0.0.1, and the scripted policy for it."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

from agent_helpers import call, last_user, tool_responses

SERVER = Path(__file__).resolve().parents[2] / "examples" / "openreward" / "echo_env.py"
STARTUP_S = 120.0  # importing the SDK + uvicorn on a loaded 2-core machine


class OrsServer:
    """The example ORS server as a subprocess on 127.0.0.1 (a free port, read from its ``PORT <n>`` line)."""

    def __init__(self) -> None:
        env = {**os.environ, "OPENREWARD_DISABLE_UPDATE_CHECK": "1"}
        self.process = subprocess.Popen(
            [sys.executable, str(SERVER), "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=env,
        )  # fmt: skip
        got: dict[str, str] = {}
        ready = threading.Event()

        def read() -> None:
            got["line"] = self.process.stdout.readline()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(STARTUP_S) or not got.get("line", "").startswith("PORT "):
            self.stop()
            raise RuntimeError(f"ORS server did not start: {got.get('line')!r}")
        self.port = int(got["line"].split()[1])
        self.url = f"http://127.0.0.1:{self.port}"

    def pause(self) -> None:
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.process.pid, signal.SIGCONT)

    def kill(self) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.resume()
            self.kill()
        for stream in (self.process.stdout, self.process.stderr):
            stream.close()


def peek_then_echo(context: str) -> str:
    """Peek (no reward), then echo: the target when it has at most 5 letters, a wrong word otherwise; then stop."""
    responses = tool_responses(context)
    target = re.search(r"Echo '(\w+)' to win\.", last_user(context)).group(1)
    if not responses:
        return call("peek", "{}")
    if len(responses) == 1:
        word = target if int(responses[0]) <= 5 else "nope"
        return call("echo", f'{{"text": "{word}"}}')
    return "Done."
