"""A small ORS (Open Reward Standard) environment server, built with the ``openreward`` package's own server API.

``EchoEnvironment`` has one task per target word; the model wins by calling ``echo(text=...)`` with the task's target
(reward 1.0, episode finished) — a wrong echo gets reward 0.0 and may try again. ``peek()`` reveals the target's
length and carries no reward (``reward=None``), so a rollout's outcome is the last reward that is not ``None``.

Run it (prints ``PORT <n>`` once it listens)::

    pip install "posttrain[openreward]"
    python examples/openreward/echo_env.py --port 8000

and train against it with ``posttrain.experimental.openreward.OpenRewardSpec("http://127.0.0.1:8000")`` — see
the README section "OpenReward environments". posttrain's tests start this file as a subprocess on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import os
import socket

os.environ.setdefault("OPENREWARD_DISABLE_UPDATE_CHECK", "1")  # no PyPI version check from a local server

import uvicorn  # noqa: E402
from openreward.environments import Environment, JSONObject, Server, TextBlock, ToolOutput, tool  # noqa: E402
from pydantic import BaseModel  # noqa: E402

TARGETS = ["hello", "world", "reward", "standard"]


class EchoTask(BaseModel):
    target: str
    difficulty: str


class EchoParams(BaseModel):
    text: str


class EchoEnvironment(Environment):
    """Echo the task's target word to win."""

    def __init__(self, task_spec: JSONObject = {}, secrets: dict[str, str] = {}):  # noqa: B006 - the SDK's signature
        super().__init__(task_spec)
        self.task = EchoTask.model_validate(task_spec)

    @classmethod
    def list_splits(cls) -> list[str]:
        return ["train", "test"]

    @classmethod
    def list_tasks(cls, split: str) -> list[JSONObject]:
        words = TARGETS if split == "train" else ["held", "out"]
        return [{"target": w, "difficulty": "easy" if len(w) <= 5 else "hard"} for w in words]

    def get_prompt(self) -> list[TextBlock]:
        return [TextBlock(type="text", text=f"Echo '{self.task.target}' to win.")]

    @tool
    async def echo(self, params: EchoParams) -> ToolOutput:
        """Submit a string; it wins (reward 1.0) when it equals the target.

        Args:
            text: The string to echo back.
        """
        correct = params.text == self.task.target
        return ToolOutput(
            blocks=[TextBlock(type="text", text="match" if correct else "no match")],
            reward=1.0 if correct else 0.0,
            finished=correct,
            metadata={"submitted": params.text},
        )

    @tool
    async def peek(self) -> ToolOutput:
        """Reveal how many letters the target has (no reward)."""
        return ToolOutput(blocks=[TextBlock(type="text", text=str(len(self.task.target)))], reward=None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port (printed as 'PORT <n>')")
    args = parser.parse_args()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    app = Server([EchoEnvironment]).app
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_keep_alive=60))
    print(f"PORT {sock.getsockname()[1]}", flush=True)
    server.run(sockets=[sock])


if __name__ == "__main__":
    main()
