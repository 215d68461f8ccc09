"""Agent training on CPU in a few minutes: a tiny model learns to use a counter environment's tool with GRPO.

The environment owns the task: ``reset`` tells the model "Set the counter to 5. The counter is at 0." and the model
may call the environment's ``increment(step)`` tool. The reward is the environment's ``get_reward()``: 1 when the
counter ends on 5, a quarter less per unit off, 0 without a successful call.

1. Build posttrain's offline tiny model (random weights, byte-level tokenizer, ChatML template with tools).
2. Warm start with a few SFT steps on tool-using conversations (TRL's ``messages`` + ``tools`` format) so that the
   model speaks the tool-call format. Targets and steps in those conversations are random and unrelated, so the
   warm-started model calls the tool with a random step: it has learnt the format, not the task.
3. GRPO with ``environment_factory=CounterEnv``, no dataset (the environment provides the task, so an empty prompt
   stands in) and no reward function (``get_reward`` is the reward column): one environment per rollout, its
   ``increment`` method a tool. The reward curve printed at the end rises as the policy learns to pick the step.

Run from the repository root:  python examples/agent_counter.py  (about 2-3 minutes on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile

import torch
from datasets import Dataset

from posttrain import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer
from posttrain.agents import build_tools
from posttrain.models.tiny import save_tiny_model

STEPS = range(1, 10)


class CounterEnv:
    """One counter per rollout. Tool arguments come from the model being trained, so ``increment`` validates them."""

    target = 5

    def reset(self, **row) -> str:
        self.counter, self.calls = 0, 0
        return task(self.target)

    def increment(self, step: int) -> int:
        """Add to the counter.

        Args:
            step: Amount to add.
        """
        if not isinstance(step, int) or not -100 <= step <= 100:
            raise ValueError("step must be an integer between -100 and 100")
        self.counter += step
        self.calls += 1
        return self.counter

    def get_reward(self) -> float:
        """0 without a successful call; else 1 on target, 1/4 less per unit off (0 from 4 off)."""
        if self.calls == 0:
            return 0.0
        return 1.0 - min(abs(self.counter - self.target), 4) / 4


def task(target: int) -> str:
    return f"Set the counter to {target}. The counter is at 0."


def warm_start_dataset(n: int, rng: random.Random) -> Dataset:
    """SFT conversations in TRL's format: user → assistant tool call → tool result → short answer.

    Target and step are drawn independently: the model learns how to call the tool, not which step is right.
    """
    schemas = json.dumps([tool.schema for tool in build_tools([CounterEnv().increment]).values()])
    rows = []
    for _ in range(n):
        step = rng.choice(STEPS)
        call = {"type": "function", "function": {"name": "increment", "arguments": {"step": step}}}
        messages = [
            {"role": "user", "content": task(rng.choice(STEPS))},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "increment", "content": str(step)},
            {"role": "assistant", "content": "Done."},
        ]
        rows.append({"messages": messages, "tools": schemas})
    return Dataset.from_list(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sft_steps", type=int, default=150)
    parser.add_argument("--grpo_steps", type=int, default=60)
    parser.add_argument("--output_dir", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)  # tiny matrices: one thread is fastest, and leaves the other core free
    rng = random.Random(0)
    out = args.output_dir or tempfile.mkdtemp(prefix="agent-counter-")
    model_path = save_tiny_model(f"{out}/tiny-model")
    common = dict(report_to="none", save_strategy="no", gradient_checkpointing=False, disable_tqdm=True, seed=0)

    sft = SFTTrainer(
        model_path,
        args=SFTConfig(
            output_dir=f"{out}/sft",
            max_steps=args.sft_steps,
            per_device_train_batch_size=8,
            learning_rate=3e-3,
            assistant_only_loss=True,
            logging_steps=20,
            write_report=False,
            **common,
        ),
        train_dataset=warm_start_dataset(args.sft_steps * 8, rng),
    )
    sft.train()
    sft.save_model(f"{out}/warm")

    grpo = GRPOTrainer(
        f"{out}/warm",
        reward_funcs=None,  # the environment's get_reward is the reward
        args=GRPOConfig(
            output_dir=f"{out}/grpo",
            max_steps=args.grpo_steps,
            per_device_train_batch_size=16,
            num_generations=8,
            max_completion_length=96,
            max_tool_calling_iterations=1,
            temperature=0.7,  # the tiny model's tool-call format is fragile at 1.0; 0.7 keeps most calls well-formed
            learning_rate=5e-4,
            lr_scheduler_type="constant",
            beta=0.0,
            logging_steps=5,
            write_report=False,
            **common,
        ),
        environment_factory=CounterEnv,
    )
    grpo.train()

    print("\nGRPO reward curve (mean environment reward per logging window; 1.0 = always on target):")
    curve = [
        (h["step"], h["reward"], h.get("tools/call_frequency", 0.0)) for h in grpo.state.log_history if "reward" in h
    ]
    for step, reward, calls in curve:
        print(
            f"  step {step:4d}  reward {reward:.3f}  {'#' * round(40 * reward):<40}  tool calls/completion {calls:.2f}"
        )
    first, last = curve[0][1], curve[-1][1]
    print(f"reward {first:.3f} -> {last:.3f} ({'rising' if last > first else 'not rising'})")


if __name__ == "__main__":
    main()
