"""A test server as a subprocess on 127.0.0.1: started with ``--port 0``, its port read from the ``PORT <n>`` line it
prints once listening; paused (SIGSTOP), resumed, killed and stopped by the tests of the environment integrations."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
from collections.abc import Mapping, Sequence

STARTUP_S = 120.0  # importing an environment SDK + uvicorn on a loaded 2-core machine


class ServerProcess:
    """``cmd`` as a subprocess that prints ``PORT <n>`` once it listens; ``url`` is then ``http://127.0.0.1:<n>``.

    Start-up is bounded by ``startup_s`` (the first line is read on a thread, so a silent server cannot hang the
    test); a server that does not start is stopped and named in the ``RuntimeError``.
    """

    def __init__(self, cmd: Sequence[str], name: str, env: Mapping[str, str] | None = None, startup_s: float = STARTUP_S):
        self.process = subprocess.Popen(
            list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=None if env is None else dict(env),
        )  # fmt: skip
        got: dict[str, str] = {}
        ready = threading.Event()

        def read() -> None:
            got["line"] = self.process.stdout.readline()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(startup_s) or not got.get("line", "").startswith("PORT "):
            self.stop()
            raise RuntimeError(f"{name} server did not start: {got.get('line')!r}")
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
                self.resume()  # in case a test paused it
            self.kill()
        for stream in (self.process.stdout, self.process.stderr):
            stream.close()
