"""GRPO with an OpenEnv environment: a number-guessing game served by openenv-core, one session per rollout.

The pattern of TRL's ``grpo_wordle`` / ``grpo_catch`` examples: an ``environment_factory`` class wraps an OpenEnv
client; ``reset`` starts a remote episode and returns its first observation (appended to the prompt), the tool
method ``guess`` is one ``step``, and ``get_reward`` reads the episode's reward from the observations.

Needs ``pip install "posttrain[openenv]"``. Without ``--env-url`` the script starts the game server
(``examples/openenv/envs.py guess``) on a free 127.0.0.1 port and stops it at the end. Without ``--model`` it
trains posttrain's offline tiny model (random weights: the run shows the plumbing, not learning); pass a
tool-calling chat model (e.g. ``--model Qwen/Qwen3-0.6B``) for a real run.

    python examples/openenv/grpo_guess.py --max-steps 2
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from datasets import Dataset

from posttrain import GRPOConfig, GRPOTrainer
from posttrain.agents.openenv import OpenEnvSession

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from envs import GuessAction, GuessClient  # noqa: E402

PROMPT = "Find my secret number. Call guess(number) and follow the feedback (higher / lower)."


def make_env_class(url: str) -> type:
    class GuessEnv:
        def __init__(self):
            self.session = OpenEnvSession(GuessClient(base_url=url), timeout_s=30)

        def reset(self, seed: int = 0, **row) -> str:
            return " " + self.session.reset(seed=seed).observation.feedback

        def guess(self, number: int) -> str:
            """Guess the secret number.

            Args:
                number: Your guess, an integer between 1 and 8.
            """
            return self.session.step(GuessAction(number=number)).observation.feedback

        def get_reward(self) -> float:
            return self.session.total_reward

    return GuessEnv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model id or path (default: the offline tiny model)")
    parser.add_argument("--env-url", default=None, help="a running guess server (default: start one)")
    parser.add_argument("--max-steps", type=int, default=2)
    args = parser.parse_args()

    server = None
    url = args.env_url
    if url is None:
        server = subprocess.Popen([sys.executable, str(HERE / "envs.py"), "guess"], stdout=subprocess.PIPE, text=True)
        url = f"http://127.0.0.1:{int(server.stdout.readline().split()[1])}"
        print(f"guess server at {url}")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model = args.model
            if model is None:
                from posttrain.models.tiny import save_tiny_model

                model = save_tiny_model(Path(tmp) / "tiny", arch="qwen2")
            dataset = Dataset.from_list(
                [{"prompt": [{"role": "user", "content": PROMPT}], "seed": s} for s in range(8)]
            )
            config = GRPOConfig(
                output_dir=str(Path(tmp) / "out"), per_device_train_batch_size=4, num_generations=4,
                max_completion_length=256, max_steps=args.max_steps, logging_steps=1, report_to="none",
                save_strategy="no", chat_template_kwargs={"enable_thinking": False},
            )  # fmt: skip
            trainer = GRPOTrainer(model, None, config, train_dataset=dataset, environment_factory=make_env_class(url))
            trainer.train()
            for log in trainer.state.log_history:
                if "rewards/GuessEnv/mean" in log:
                    print(f"step {log['step']}: reward {log['rewards/GuessEnv/mean']:.2f}")
    finally:
        if server is not None:
            server.kill()
            server.wait()


if __name__ == "__main__":
    main()
