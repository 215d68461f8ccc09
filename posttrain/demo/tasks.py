"""A verifiable arithmetic task generated locally (no hub access): "What is a + b?" with a boxed answer.

The SFT split teaches the task and the reasoning format, but only ``boxed_fraction`` of its answers are written as
``\\boxed{n}`` (the rest say "The answer is n."). A math verifier only accepts boxed answers, so after SFT the model
is right in substance more often than it is *verifiably* right; GRPO with ``accuracy_reward`` then has a clear,
honest signal to learn from, alongside sharpening the arithmetic itself. Evaluation uses operand pairs that never
appear in training.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

PROMPT_TEMPLATES = [
    "What is {a} + {b}?",
    "Compute {a} + {b}.",
    "Add {a} and {b}.",
]


@dataclass(frozen=True)
class Problem:
    a: int
    b: int

    @property
    def answer(self) -> int:
        return self.a + self.b

    def prompt_text(self, template: int = 0) -> str:
        return PROMPT_TEMPLATES[template % len(PROMPT_TEMPLATES)].format(a=self.a, b=self.b)

    def reasoning(self) -> str:
        return f"<think>{self.a}+{self.b}={self.answer}</think>"


def split_problems(max_operand: int, eval_fraction: float, seed: int) -> tuple[list[Problem], list[Problem]]:
    """All pairs with operands in [0, max_operand), split into disjoint train / held-out evaluation sets."""
    pairs = [Problem(a, b) for a in range(max_operand) for b in range(max_operand)]
    rng = random.Random(seed)
    rng.shuffle(pairs)
    n_eval = max(1, int(len(pairs) * eval_fraction))
    return pairs[n_eval:], pairs[:n_eval]


def completion_text(problem: Problem, boxed: bool) -> str:
    answer = f"\\boxed{{{problem.answer}}}" if boxed else f"The answer is {problem.answer}."
    return f"{problem.reasoning()} {answer}"


def make_datasets(
    *,
    max_operand: int = 10,
    eval_fraction: float = 0.2,
    n_sft: int = 600,
    boxed_fraction: float = 0.5,
    seed: int = 0,
):
    """Build the three splits the demo uses.

    Returns:
        ``(sft, rl, eval)`` ``datasets.Dataset`` objects: conversational prompt-completion rows for SFT;
        conversational prompt-only rows with a ``solution`` column for GRPO and for evaluation.
    """
    from datasets import Dataset

    rng = random.Random(seed + 1)
    train, held_out = split_problems(max_operand, eval_fraction, seed)
    sft_rows = []
    for i in range(n_sft):
        problem = train[i % len(train)]
        template = rng.randrange(len(PROMPT_TEMPLATES))
        sft_rows.append(
            {
                "prompt": [{"role": "user", "content": problem.prompt_text(template)}],
                "completion": [
                    {"role": "assistant", "content": completion_text(problem, rng.random() < boxed_fraction)}
                ],
            }
        )

    def prompt_rows(problems: list[Problem], templates: bool) -> list[dict]:
        rows = []
        for i, p in enumerate(problems):
            t = i % len(PROMPT_TEMPLATES) if templates else 0
            rows.append({"prompt": [{"role": "user", "content": p.prompt_text(t)}], "solution": f"${p.answer}$"})
        return rows

    return (
        Dataset.from_list(sft_rows),
        Dataset.from_list(prompt_rows(train, templates=True)),
        Dataset.from_list(prompt_rows(held_out, templates=True)),
    )
