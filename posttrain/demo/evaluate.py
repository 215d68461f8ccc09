"""Held-out evaluation for the demo: sample completions, score them, and keep skill apart from format.

Completions come from posttrain's own group sampler (the same generation backend GRPO trains with). For every
held-out problem the model answers once greedily and ``num_samples`` times at temperature 1 (the distribution GRPO
optimises). Each answer is scored two ways:

* **verified** — ``accuracy_reward``, the math verifier GRPO is trained on (it reads ``\\boxed{}`` answers);
* **right answer, any format** — the last number the completion states after its ``<think>`` block, boxed or not.

If the two move together the model got better at the task; if only the first moves it learned to format its answers.
Per-problem scores are kept so that differences between two models can be given paired standard errors.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

_LAST_NUMBER = re.compile(r"(-?\d+)\D*$")


def stated_number(text: str) -> int | None:
    """The last number a completion states after its reasoning, in any format (``\\boxed{132}``, ``132.``)."""
    tail = text.split("</think>")[-1]
    match = _LAST_NUMBER.search(tail)
    return int(match.group(1)) if match else None


def mean_and_stderr(values: list[float]) -> tuple[float, float]:
    """Mean and standard error of the mean (sample standard deviation / √n)."""
    n = len(values)
    if n == 0:
        return 0.0, 0.0
    mean = sum(values) / n
    if n < 2:
        return mean, 0.0
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


@dataclass
class EvalResult:
    """Per-problem scores on the held-out set (each list has one entry per problem, in dataset order)."""

    num_samples: int
    greedy_verified: list[float]
    greedy_any_format: list[float]
    sampled_verified: list[float]  # fraction of the problem's samples the verifier accepts
    sampled_any_format: list[float]
    pass_at_k: list[float]  # 1 if any of the problem's samples is verified correct
    boxed: list[float]  # fraction of the problem's samples with a \boxed{} answer
    lengths: list[float]  # mean completion tokens of the problem's samples
    carries: list[bool]
    greedy_text: list[str]
    prompts: list[str]
    answers: list[int]
    extra: dict = field(default_factory=dict)

    def metrics(self) -> dict[str, tuple[float, float]]:
        """``{metric: (mean, standard error)}`` over held-out problems."""
        k = self.num_samples
        carry = [v for v, c in zip(self.greedy_any_format, self.carries) if c]
        plain = [v for v, c in zip(self.greedy_any_format, self.carries) if not c]
        return {
            "greedy: verified correct": mean_and_stderr(self.greedy_verified),
            "greedy: right answer, any format": mean_and_stderr(self.greedy_any_format),
            "greedy, problems with a carry": mean_and_stderr(carry),
            "greedy, problems without a carry": mean_and_stderr(plain),
            "sampled (T=1): verified correct": mean_and_stderr(self.sampled_verified),
            "sampled (T=1): right answer, any format": mean_and_stderr(self.sampled_any_format),
            f"pass@{k} (verified)": mean_and_stderr(self.pass_at_k),
            "answers in \\boxed{} (sampled)": mean_and_stderr(self.boxed),
            "mean completion tokens (sampled)": mean_and_stderr(self.lengths),
        }

    def row(self) -> dict[str, float]:
        """``{metric: mean}`` (what ``summary.json`` stores per stage)."""
        return {name: mean for name, (mean, _) in self.metrics().items()}


def paired_gain(after: list[float], before: list[float]) -> tuple[float, float]:
    """Mean difference ``after − before`` on the same problems and its (paired) standard error."""
    return mean_and_stderr([a - b for a, b in zip(after, before)])


def evaluate(
    model, tokenizer, dataset, *, num_samples: int = 8, max_new_tokens: int = 40, seed: int = 0
) -> EvalResult:
    """Score ``model`` on prompt-only rows with ``solution`` (``"$132$"``) and ``carries`` columns."""
    import torch

    from posttrain.data_utils import maybe_apply_chat_template
    from posttrain.generation import GroupSampler, SamplingConfig
    from posttrain.rewards import accuracy_reward

    prompts = list(dataset["prompt"])
    solutions = list(dataset["solution"])
    answers = [int(s.strip("$")) for s in solutions]
    carries = list(dataset["carries"]) if "carries" in dataset.column_names else [False] * len(prompts)
    texts = [maybe_apply_chat_template({"prompt": p}, tokenizer)["prompt"] for p in prompts]
    prompt_ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    sampler = GroupSampler(model, tokenizer, return_logprobs=False)
    base = dict(
        max_new_tokens=max_new_tokens, eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id
    )
    was_training = model.training
    model.eval()
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        with torch.no_grad():
            greedy = sampler.generate(prompt_ids, SamplingConfig(do_sample=False, **base), num_generations=1)
            sampled = sampler.generate(
                prompt_ids, SamplingConfig(do_sample=True, temperature=1.0, **base), num_generations=num_samples
            )
    finally:
        torch.random.set_rng_state(state)
        model.train(was_training)

    def decode(ids: list[list[int]]) -> list[str]:
        return tokenizer.batch_decode(ids, skip_special_tokens=True)

    def verified(texts: list[str], sols: list[str]) -> list[float]:
        scores = accuracy_reward(completions=[[{"role": "assistant", "content": t}] for t in texts], solution=sols)
        return [float(s or 0.0) for s in scores]

    greedy_text = decode(greedy.completion_ids)
    sampled_text = decode(sampled.completion_ids)
    k = num_samples
    s_verified = verified(sampled_text, [s for s in solutions for _ in range(k)])
    s_any = [float(stated_number(t) == answers[i // k]) for i, t in enumerate(sampled_text)]
    s_boxed = [float("\\boxed{" in t) for t in sampled_text]
    s_len = [float(len(ids)) for ids in sampled.completion_ids]

    def per_problem(values: list[float], reduce=lambda xs: sum(xs) / len(xs)) -> list[float]:
        return [reduce(values[i * k : (i + 1) * k]) for i in range(len(prompts))]

    return EvalResult(
        num_samples=k,
        greedy_verified=verified(greedy_text, solutions),
        greedy_any_format=[float(stated_number(t) == a) for t, a in zip(greedy_text, answers)],
        sampled_verified=per_problem(s_verified),
        sampled_any_format=per_problem(s_any),
        pass_at_k=per_problem(s_verified, max),
        boxed=per_problem(s_boxed),
        lengths=per_problem(s_len),
        carries=[bool(c) for c in carries],
        greedy_text=greedy_text,
        prompts=[p[-1]["content"] for p in prompts],
        answers=answers,
    )
