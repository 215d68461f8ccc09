"""GRPO on a vision-language model from the command line: the seed's VLM quick start (TRL's
``examples/scripts/grpo_vlm.py`` arguments) with posttrain.

The data set is TRL's vision format, a conversational ``prompt`` with an ``{"type": "image"}`` block plus an
``image`` column; each row also carries the ``solution`` that ``accuracy_reward`` checks. With ``--dataset_name``
(e.g. ``lmms-lab/multimodal-open-r1-8k-verified``: ``problem``, ``image``, ``solution`` columns) the rows are built from
the named set; without it, an offline set is generated: small images of one colour, the task being to name it, so
the recipe runs on the tiny offline LLaVA (``examples/grpo_vlm.yaml``) in a minute on a CPU.

Rewards, as in TRL's script: ``think_format_reward`` (a ``<think>...</think>`` block first) and ``accuracy_reward``
(the answer matches ``solution``).

Run from the repository root:  python examples/grpo_vlm.py --config examples/grpo_vlm.yaml
"""

from __future__ import annotations

import random

from datasets import Dataset, load_dataset
from PIL import Image

from posttrain import GRPOConfig, GRPOTrainer, ModelConfig, ScriptArguments, TrlParser, get_peft_config
from posttrain.rewards import accuracy_reward, think_format_reward

SYSTEM_PROMPT = (
    "A conversation between user and assistant. The user asks a question about an image, and the assistant solves "
    "it. The assistant first thinks about the reasoning process in the mind and then provides the user with the "
    "answer. The reasoning process is enclosed within <think> </think> tags, i.e., <think>\nreasoning process "
    "here\n</think>\nanswer here."
)
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 60), "blue": (40, 60, 220), "yellow": (240, 220, 40)}


def make_conversation(problem: str, image: object, solution: str) -> dict:
    """One row in TRL's vision format: the image block goes in the user turn, the image in the ``image`` column."""
    prompt = [
        {"role": "system", "content": [{"type": "text", "text": SYSTEM_PROMPT}]},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": problem}]},
    ]
    return {"prompt": prompt, "image": image, "solution": solution}


def colour_dataset(num_rows: int = 64, seed: int = 0) -> Dataset:
    """An offline image task: one colour, two sizes; the solution is the colour's name."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_rows):
        name = rng.choice(sorted(COLOURS))
        size = rng.choice([(16, 16), (24, 20)])
        rows.append(make_conversation("Which colour is this image? Answer with one word.",
                                      Image.new("RGB", size, COLOURS[name]), name))  # fmt: skip
    return Dataset.from_list(rows)


def main(script_args: ScriptArguments, training_args: GRPOConfig, model_args: ModelConfig) -> GRPOTrainer:
    training_args.model_init_kwargs = {
        "revision": model_args.model_revision,
        "dtype": model_args.dtype,
        **(training_args.model_init_kwargs or {}),
    }
    if script_args.dataset_name:
        raw = load_dataset(script_args.dataset_name, name=script_args.dataset_config, split=script_args.dataset_train_split)
        train_dataset = raw.map(lambda row: make_conversation(row["problem"], row["image"], row["solution"]))
    else:
        train_dataset = colour_dataset(seed=training_args.seed)
    trainer = GRPOTrainer(
        model=model_args.model_name_or_path,
        args=training_args,
        reward_funcs=[think_format_reward, accuracy_reward],
        train_dataset=train_dataset,
        peft_config=get_peft_config(model_args),
    )
    trainer.train()
    trainer.save_model(training_args.output_dir)
    return trainer


if __name__ == "__main__":
    parser = TrlParser((ScriptArguments, GRPOConfig, ModelConfig))
    main(*parser.parse_args_and_config())
