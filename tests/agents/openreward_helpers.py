"""OpenReward test helpers: the example ORS server as a subprocess on 127.0.0.1, and the scripted policy for it."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from agent_helpers import call, last_user, tool_responses
from server_process import ServerProcess

SERVER = Path(__file__).resolve().parents[2] / "examples" / "openreward" / "echo_env.py"

# Why the OpenReward tests skip. openreward is not in the dev extra (its sse-starlette==2.3.6 pin clashes with mcp's
# sse-starlette>=3); .ci/run installs it into .venv before README's test command (see README, "OpenReward environments").
OPENREWARD_MISSING = (
    'the openreward package is not installed: `pip install "posttrain[openreward]"` in an environment without '
    "openenv-core, or next to the dev extra as .ci/run does: `pip install --no-deps openreward==0.1.167` plus its "
    "other requirements (README, OpenReward environments)"
)


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
