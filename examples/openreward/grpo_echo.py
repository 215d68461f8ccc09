"""GRPO with an OpenReward (ORS) environment: tasks, tools and rewards all served by an ORS server.

TRL's ``trl.experimental.openreward`` pattern: one ``OpenRewardSpec`` gives ``train_dataset`` (the server's task
list), ``environment_factory`` (one ORS session per rollout; one tool method per server tool) and ``reward_funcs``
(the last non-``None`` reward the server sent with a tool output).

Needs ``pip install "posttrain[openreward]"``. Without ``--env-url`` the script starts the example echo server
(``examples/openreward/echo_env.py``, built with the openreward SDK's ``Server``) on a free 127.0.0.1 port and stops
it at the end. Without ``--model`` it trains posttrain's offline tiny model (random weights: the run shows the
plumbing, not learning); pass a tool-calling chat model (e.g. ``--model Qwen/Qwen3-0.6B``) for a real run.

    python examples/openreward/grpo_echo.py --max-steps 2
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from posttrain import GRPOConfig, GRPOTrainer

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model id or path (default: the offline tiny model)")
    parser.add_argument("--env-url", default=None, help="a running ORS server (default: start the echo example)")
    parser.add_argument("--max-steps", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from posttrain.experimental.openreward import OpenRewardSpec

    server = None
    url = args.env_url
    if url is None:
        env = {**os.environ, "OPENREWARD_DISABLE_UPDATE_CHECK": "1"}
        server = subprocess.Popen(
            [sys.executable, str(HERE / "echo_env.py")], stdout=subprocess.PIPE, text=True, env=env
        )
        url = f"http://127.0.0.1:{int(server.stdout.readline().split()[1])}"
        print(f"ORS echo server at {url}")
    try:
        spec = OpenRewardSpec(url, num_tasks=4)
        with tempfile.TemporaryDirectory() as tmp:
            model = args.model
            if model is None:
                from posttrain.models.tiny import save_tiny_model

                model = save_tiny_model(Path(tmp) / "tiny", arch="qwen2")
            config = GRPOConfig(
                output_dir=str(Path(tmp) / "out"), per_device_train_batch_size=4, num_generations=2,
                max_completion_length=128, max_steps=args.max_steps, max_tool_calling_iterations=4, logging_steps=1,
                report_to="none", save_strategy="no", chat_template_kwargs={"enable_thinking": False},
            )  # fmt: skip
            trainer = GRPOTrainer(
                model, spec.reward_funcs, config, train_dataset=spec.train_dataset,
                environment_factory=spec.environment_factory,
            )  # fmt: skip
            trainer.train()
            for log in trainer.state.log_history:
                if "rewards/_outcome_only_reward_func/mean" in log:
                    print(f"step {log['step']}: reward {log['rewards/_outcome_only_reward_func/mean']:.2f}")
    finally:
        if server is not None:
            server.kill()
            server.wait()


if __name__ == "__main__":
    main()
