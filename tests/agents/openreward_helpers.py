"""OpenReward test helpers: the example ORS server as a subprocess on 127.0.0.1, and the scripted policy for it."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from agent_helpers import call, last_user, tool_responses
from server_process import ServerProcess

SERVER = Path(__file__).resolve().parents[2] / "examples" / "openreward" / "echo_env.py"


class OrsServer(ServerProcess):
    """The example ORS server (``examples/openreward/echo_env.py``) as a subprocess on 127.0.0.1, on a free port."""

    def __init__(self) -> None:
        env = {**os.environ, "OPENREWARD_DISABLE_UPDATE_CHECK": "1"}
        super().__init__([sys.executable, str(SERVER), "--port", "0"], "ORS", env=env)


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
