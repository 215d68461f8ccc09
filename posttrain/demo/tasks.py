"""The demo's verifiable task, generated locally (no hub access): two-digit addition with a worked trace.

Every completion writes the column sums in a ``<think>`` block and then a ``\\boxed{}`` answer::

    What is 47 + 85?   →   <think>7+5=12 4+8+1=13</think> \\boxed{132}

The SFT traces come from a *sloppy teacher*: when the ones column carries, it forgets to add the carry to the tens
column ``forget_carry`` of the time (``7+5=12 4+8=12`` → ``\\boxed{122}``). Every SFT answer is boxed, so the answer
format is learned completely and is not what GRPO changes. What SFT cannot do is beat its teacher: a model that
imitates these traces forgets the carry as often as the teacher does, and its greedy answer follows the teacher's
majority habit — wrong on every problem that carries. Sampling still finds the right answer some of the time, a
verifier can tell which samples those are, and GRPO makes them the policy's choice: the model gets better at the
arithmetic itself. Evaluation uses operand pairs that never appear in training (in either order).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

PROMPT_TEMPLATES = [
    "What is {a} + {b}?",
    "Compute {a} + {b}.",
    "Add {a} and {b}.",
]
LOW, HIGH = 10, 100  # both operands are two-digit numbers
FORGET_CARRY = 0.7  # how often the sloppy teacher forgets the carry
RL_CARRY_FRACTION = 0.75  # share of GRPO's training prompts that need a carry (uniform two-digit pairs: 45%)


@dataclass(frozen=True)
class Problem:
    a: int
    b: int

    @property
    def answer(self) -> int:
        return self.a + self.b

    @property
    def carries(self) -> bool:
        return self.a % 10 + self.b % 10 >= 10

    def prompt_text(self, template: int = 0) -> str:
        return PROMPT_TEMPLATES[template % len(PROMPT_TEMPLATES)].format(a=self.a, b=self.b)

    def trace(self, forget_carry: bool = False) -> str:
        """The worked completion; ``forget_carry`` drops the carry into the tens column (a wrong answer)."""
        ones = self.a % 10 + self.b % 10
        carry = ones // 10
        tens_terms = f"{self.a // 10}+{self.b // 10}"
        if carry and not forget_carry:
            tens_terms += "+1"
            tens = self.a // 10 + self.b // 10 + 1
        else:
            tens = self.a // 10 + self.b // 10
        result = tens * 10 + ones % 10
        return f"<think>{self.a % 10}+{self.b % 10}={ones} {tens_terms}={tens}</think> \\boxed{{{result}}}"


def split_problems(eval_size: int, seed: int) -> tuple[list[Problem], list[Problem]]:
    """All two-digit pairs, split by *unordered* pair: neither ``a + b`` nor ``b + a`` of a held-out problem is
    in the training set. Returns ``(train, held_out)``; ``held_out`` has ``eval_size`` problems."""
    unordered = [(a, b) for a in range(LOW, HIGH) for b in range(a, HIGH)]
    rng = random.Random(seed)
    rng.shuffle(unordered)
    held, train = [], []
    for a, b in unordered:
        if len(held) < eval_size:
            held.append(Problem(a, b) if rng.random() < 0.5 else Problem(b, a))
        else:
            train.append(Problem(a, b))
            if a != b:
                train.append(Problem(b, a))
    rng.shuffle(train)
    return train, held


def make_datasets(
    *,
    n_sft: int = 8000,
    n_rl: int = 4000,
    eval_size: int = 400,
    forget_carry: float = FORGET_CARRY,
    rl_carry_fraction: float = RL_CARRY_FRACTION,
    seed: int = 0,
):
    """Build the three splits the demo uses.

    Returns:
        ``(sft, rl, eval)`` ``datasets.Dataset`` objects: conversational prompt-completion rows for SFT (sloppy
        teacher traces); conversational prompt-only rows with a ``solution`` column (``"$132$"``) for GRPO and for
        evaluation. Evaluation rows also carry ``carries`` (whether the problem needs a carry). The GRPO prompts are
        training problems, ``rl_carry_fraction`` of them ones that carry; evaluation problems are uniform.
    """
    from datasets import Dataset

    rng = random.Random(seed + 1)
    train, held_out = split_problems(eval_size, seed)
    sft_rows = []
    for i in range(n_sft):
        problem = train[i % len(train)]
        template = rng.randrange(len(PROMPT_TEMPLATES))
        sloppy = problem.carries and rng.random() < forget_carry
        sft_rows.append(
            {
                "prompt": [{"role": "user", "content": problem.prompt_text(template)}],
                "completion": [{"role": "assistant", "content": problem.trace(forget_carry=sloppy)}],
            }
        )

    def prompt_rows(problems: list[Problem], carries: bool) -> list[dict]:
        rows = []
        for i, p in enumerate(problems):
            row = {
                "prompt": [{"role": "user", "content": p.prompt_text(i % len(PROMPT_TEMPLATES))}],
                "solution": f"${p.answer}$",
            }
            if carries:
                row["carries"] = p.carries
            rows.append(row)
        return rows

    # GRPO's prompts: mostly problems that carry. A problem the SFT model always gets right gives GRPO nothing to
    # learn from (all of its samples score the same), so spending most of the rollouts on the others is the cheap
    # way to a clear result; the rest keep the no-carry problems in view.
    rl_rng = random.Random(seed + 2)
    carrying = [p for p in train if p.carries]
    plain = [p for p in train if not p.carries]
    rl_problems = [rl_rng.choice(carrying if rl_rng.random() < rl_carry_fraction else plain) for _ in range(n_rl)]
    return (
        Dataset.from_list(sft_rows),
        Dataset.from_list(prompt_rows(rl_problems, carries=False)),
        Dataset.from_list(prompt_rows(held_out, carries=True)),
    )
