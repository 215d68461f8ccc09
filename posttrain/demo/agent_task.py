"""The agent demo's task (``posttrain demo --task agent``): three-digit multiplication with a calculator tool.

The model is asked ``What is 347 * 826?``. It may call the calculator — the one tool of :class:`CalculatorEnv`, the
environment GRPO builds once per rollout through ``environment_factory`` — and then state the answer::

    <tool_call>{"name": "calculate", "arguments": {}}</tool_call>
    (tool) 286622
    \\boxed{286622}

or answer at once from "mental math" (``\\boxed{290500}``: both factors rounded to tens, then multiplied). The
calculator takes no arguments: the environment was reset with the rollout's problem, so it knows what to compute. The
call is therefore one constant string, and the only digits the model has to copy are the tool's answer into the box,
a few tokens after it, at a fixed distance (every product has six digits). A tiny byte-level model cannot multiply
three-digit numbers in its head, and it learns that copy within the demo's SFT budget; a calculator called as
``multiply(a, b)`` would also need the operands copied into the call, which the same model does not learn in that
budget (measured: README, "Run the agent demo").

The SFT traces come from a *lazy teacher* that calls the calculator only ``TOOL_RATE`` (30%) of the time and
otherwise boxes its estimate (almost always wrong). ``COPY_DRILL_RATE`` (80%) of the SFT rows are *copy drills*: the
prompt already holds the problem, the call and the tool's answer, and the completion is the boxed copy. The copy is
the one step GRPO cannot teach (a rollout that calls the tool but does not copy its answer is never rewarded), and
when it forms in a tiny model is a matter of the seed: with half the rows drills and a cosine schedule over 600 steps
it formed on one seed of three, with 80% drills and a constant learning rate on all three (README). Drills do not
touch the choice of route, which only the other rows (the teacher's whole traces) show, 30% of them with the tool.
Imitation learns the teacher's habit: the model answers from its head most of the time, and greedily always. GRPO
rewards verified answers (:func:`verified_answer_reward`, the product checked against the rollout's environment), so
the sampled rollouts that used the tool win, and tool use — with the held-out success it brings — rises.

Held-out problems use unordered operand pairs that never appear in training, in either order.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

TOOL_RATE = 0.3  # how often the lazy teacher calls the calculator
COPY_DRILL_RATE = 0.8  # share of SFT rows that start after the tool's answer (the copy into the box, nothing else)
LOW, HIGH = 100, 1000  # both factors are three-digit numbers
MIN_PRODUCT = 100_000  # only six-digit products: the copy from the tool's answer into the box has one fixed distance
PROMPT_TEMPLATES = ["What is {a} * {b}?"]
_BOXED = re.compile(r"\\boxed\{(-?\d+)\}")
_LAST_NUMBER = re.compile(r"(-?\d+)\D*$")


@dataclass(frozen=True)
class MulProblem:
    a: int
    b: int

    @property
    def answer(self) -> int:
        return self.a * self.b

    @property
    def estimate(self) -> int:
        """The lazy teacher's "mental math": both factors rounded to the nearest ten, then multiplied."""
        return _round_ten(self.a) * _round_ten(self.b)

    def prompt_text(self, template: int = 0) -> str:
        return PROMPT_TEMPLATES[template % len(PROMPT_TEMPLATES)].format(a=self.a, b=self.b)

    def tool_trace(self) -> list[dict[str, Any]]:
        """The completion messages of a calculator trace: the call (no arguments: the environment knows the
        problem), the tool's answer, the boxed result copied from it."""
        call = {"type": "function", "function": {"name": "calculate", "arguments": {}}}
        return [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "calculate", "content": str(self.answer)},
            {"role": "assistant", "content": f"\\boxed{{{self.answer}}}"},
        ]

    def mental_trace(self) -> list[dict[str, Any]]:
        """The completion messages of a mental-math trace: the estimate boxed at once (``\\boxed{290500}``). The
        choice between the two routes is the completion's first token (``<tool_call>`` or ``\\``)."""
        return [{"role": "assistant", "content": f"\\boxed{{{self.estimate}}}"}]


def _round_ten(x: int) -> int:
    return (x + 5) // 10 * 10


class CalculatorEnv:
    """One rollout's environment: a calculator for the problem it was reset with (also the verifier's truth).

    GRPO builds one per rollout (``environment_factory=CalculatorEnv``); its public method :meth:`calculate` is the
    tool the chat template shows the model. ``calls`` counts the tool calls of the current rollout.
    """

    def __init__(self) -> None:
        self.a = 0
        self.b = 0
        self.calls = 0

    def reset(self, a: int = 0, b: int = 0, **row: Any) -> None:
        """Start a rollout on the row's problem (its ``a`` and ``b`` columns). The prompt already states it."""
        self.a, self.b, self.calls = int(a), int(b), 0
        return None

    def calculate(self) -> int:
        """Exact answer to the problem of this conversation."""
        self.calls += 1
        return self.a * self.b


def final_answer(completion: Any) -> int | None:
    """The number in the last ``\\boxed{}`` of the completion's final assistant text (``None`` if there is none).

    ``completion`` is the parsed conversation GRPO's reward functions receive (a list of messages) or plain text.
    """
    if isinstance(completion, list):
        texts = [m.get("content") for m in completion if m.get("role") == "assistant"]
        text = next((t for t in reversed(texts) if isinstance(t, str) and t.strip()), "")
    else:
        text = str(completion)
    found = _BOXED.findall(text)
    return int(found[-1]) if found else None


def verified_answer_reward(completions: list[Any], environments: list[CalculatorEnv], **kwargs: Any) -> list[float]:
    """1.0 when the boxed final answer is the exact product of the rollout's problem, else 0.0.

    The truth comes from each rollout's :class:`CalculatorEnv` (what it was reset with), not from the completion.
    """
    if environments is None:
        raise ValueError(
            "verified_answer_reward needs the rollouts' environments (environment_factory=CalculatorEnv)."
        )
    return [float(final_answer(c) == env.a * env.b) for c, env in zip(completions, environments)]


def split_problems(eval_size: int, seed: int, pool: int = 9000) -> tuple[list[MulProblem], list[MulProblem]]:
    """``pool`` random unordered factor pairs with six-digit products, split: ``eval_size`` held out, the rest (both orders) for training."""
    rng = random.Random(seed)
    pairs: set[tuple[int, int]] = set()
    while len(pairs) < pool:
        a, b = rng.randrange(LOW, HIGH), rng.randrange(LOW, HIGH)
        if a * b >= MIN_PRODUCT:
            pairs.add((min(a, b), max(a, b)))
    ordered = sorted(pairs)
    rng.shuffle(ordered)
    held = [MulProblem(a, b) if rng.random() < 0.5 else MulProblem(b, a) for a, b in ordered[:eval_size]]
    train = []
    for a, b in ordered[eval_size:]:
        train.append(MulProblem(a, b))
        if a != b:
            train.append(MulProblem(b, a))
    rng.shuffle(train)
    return train, held


_TOOLS_HEADER = (
    "{{- '# Tools\\n\\nYou may call one or more functions. Function signatures:\\n<tools>\\n' }}\n"
    "{%- for tool in tools %}\n"
    "{{- (tool | tojson) + '\\n' }}\n"
    "{%- endfor %}\n"
    '{{- \'</tools>\\nTo call a function, reply with <tool_call>{"name": <function-name>, "arguments": '
    "<args-json-object>}</tool_call>.<|im_end|>\\n' }}\n"
)
_COMPACT_TOOLS_HEADER = (
    "{{- '# Tools:' }}\n"
    "{%- for tool in tools %}\n"
    "{%- set fn = tool.function if tool.function is defined else tool %}\n"
    "{{- ' ' + fn.name + '(' + (fn.parameters.properties | list | join(', ')) + ')' }}\n"
    "{%- endfor %}\n"
    "{{- '<|im_end|>\\n' }}\n"
)


def agent_chat_template() -> str:
    """posttrain's tiny ChatML training template with a one-line tool header (``# Tools: calculate()``).

    The full header spells out every tool's JSON schema (~470 byte tokens before each prompt), which would make the
    demo's CPU budget mostly prefix. The compact one names each tool and its parameters; tool calls and tool
    responses render exactly as in the full template (hermes ``<tool_call>{...}</tool_call>``), so the tool-call
    parser and the prefix-preserving check of the tool loop are the same. The SFT traces teach the call format.
    """
    from posttrain.models.tiny import chatml_template

    full = chatml_template()
    if _TOOLS_HEADER not in full:
        raise RuntimeError("posttrain's tiny ChatML template changed: update posttrain.demo.agent_task._TOOLS_HEADER.")
    return full.replace(_TOOLS_HEADER, _COMPACT_TOOLS_HEADER)


def build_agent_tokenizer():
    """The tiny byte-level tokenizer with :func:`agent_chat_template` (saved with the demo's models)."""
    from posttrain.models.tiny import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = agent_chat_template()
    return tokenizer


def calculator_tools() -> list[dict[str, Any]]:
    """The tool schemas GRPO renders for :class:`CalculatorEnv` (the SFT traces show the model the same ones)."""
    from posttrain.agents.environments import EnvironmentPool

    return EnvironmentPool(CalculatorEnv).prepare([{"a": 1, "b": 1}]).tool_schemas[0]


def make_agent_datasets(*, n_sft: int = 4000, n_rl: int = 2000, eval_size: int = 200, tool_rate: float = TOOL_RATE,
                        copy_drill_rate: float = COPY_DRILL_RATE, seed: int = 0):  # fmt: skip
    """Build the three splits of the agent demo.

    Returns:
        ``(sft, rl, eval)`` ``datasets.Dataset`` objects. SFT rows are conversational prompt-completion rows with a
        ``tools`` column (the calculator's schema, rendered as GRPO renders it): ``copy_drill_rate`` of them copy
        drills (prompt: the problem, the call and the tool's answer; completion: the boxed answer), the others whole
        traces from the problem on, a calculator trace ``tool_rate`` of the time and a mental-math trace otherwise. RL and evaluation rows are prompt-only with
        ``a`` and ``b`` columns (what :meth:`CalculatorEnv.reset` reads).
    """
    from datasets import Dataset

    train, held_out = split_problems(eval_size, seed)
    tools = calculator_tools()
    rng = random.Random(seed + 1)
    sft_rows = []
    for i in range(n_sft):
        p = train[i % len(train)]
        user = [{"role": "user", "content": p.prompt_text(rng.randrange(len(PROMPT_TEMPLATES)))}]
        if rng.random() < copy_drill_rate:
            trace = p.tool_trace()
            prompt, completion = user + trace[:2], trace[2:]
        else:
            prompt, completion = user, p.tool_trace() if rng.random() < tool_rate else p.mental_trace()
        sft_rows.append({"prompt": prompt, "completion": completion, "tools": tools})
    rl_rng = random.Random(seed + 2)

    def prompt_rows(problems: list[MulProblem], rng: random.Random | None) -> list[dict[str, Any]]:
        return [
            {
                "prompt": [
                    {"role": "user", "content": p.prompt_text(rng.randrange(len(PROMPT_TEMPLATES)) if rng else i)}
                ],
                "a": p.a,
                "b": p.b,
            }
            for i, p in enumerate(problems)
        ]

    rl_problems = [train[rl_rng.randrange(len(train))] for _ in range(n_rl)]
    return (
        Dataset.from_list(sft_rows),
        Dataset.from_list(prompt_rows(rl_problems, rl_rng)),
        Dataset.from_list(prompt_rows(held_out, None)),
    )
