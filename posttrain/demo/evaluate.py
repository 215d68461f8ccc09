"""Held-out evaluation for the demo: sample completions, score them with posttrain's rewards, summarise.

Completions come from posttrain's own group sampler (the same generation backend GRPO trains with). Greedy accuracy
and sampled accuracy (temperature 1, the distribution GRPO optimises) are both reported, so the table shows what
changed rather than one flattering number.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass
class EvalResult:
    accuracy_greedy: float
    accuracy_sampled: float
    boxed_rate: float  # fraction of sampled answers a verifier can read (\boxed{...})
    correct_anywhere: float  # sampled completions whose stated number is right, in any format
    mean_reward: float  # accuracy + format reward on samples
    mean_length: float  # completion tokens, sampled
    samples: list[dict]

    def row(self) -> dict[str, float]:
        return {
            "accuracy (greedy)": self.accuracy_greedy,
            "accuracy (sampled, T=1)": self.accuracy_sampled,
            "verifiable answer rate": self.boxed_rate,
            "right number, any format": self.correct_anywhere,
            "mean reward": self.mean_reward,
            "mean completion length": self.mean_length,
        }


_LAST_NUMBER = re.compile(r"(-?\d+)\D*$")


def _stated_number(text: str) -> int | None:
    tail = text.split("</think>")[-1]
    match = _LAST_NUMBER.search(tail)
    return int(match.group(1)) if match else None


def evaluate(
    model, tokenizer, dataset, *, num_samples: int = 4, max_new_tokens: int = 32, seed: int = 0
) -> EvalResult:
    """Score ``model`` on prompt-only rows with a ``solution`` column (greedy once, plus ``num_samples`` samples)."""
    import torch

    from posttrain.data_utils import maybe_apply_chat_template
    from posttrain.generation import GroupSampler, SamplingConfig
    from posttrain.rewards import accuracy_reward, think_format_reward

    prompts = list(dataset["prompt"])
    solutions = list(dataset["solution"])
    texts = [maybe_apply_chat_template({"prompt": p}, tokenizer)["prompt"] for p in prompts]
    prompt_ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    sampler = GroupSampler(model, tokenizer, return_logprobs=False)
    base = dict(
        max_new_tokens=max_new_tokens, eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id
    )
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        greedy = sampler.generate(prompt_ids, SamplingConfig(do_sample=False, **base), num_generations=1)
        sampled = sampler.generate(
            prompt_ids, SamplingConfig(do_sample=True, temperature=1.0, **base), num_generations=num_samples
        )
    finally:
        torch.random.set_rng_state(state)

    def decode(ids: list[list[int]]) -> list[str]:
        return tokenizer.batch_decode(ids, skip_special_tokens=True)

    greedy_text = decode(greedy.completion_ids)
    sampled_text = decode(sampled.completion_ids)
    rep_solutions = [s for s in solutions for _ in range(num_samples)]
    conv = [[{"role": "assistant", "content": t}] for t in sampled_text]
    acc_greedy = accuracy_reward(
        completions=[[{"role": "assistant", "content": t}] for t in greedy_text], solution=solutions
    )
    acc_sampled = accuracy_reward(completions=conv, solution=rep_solutions)
    fmt = think_format_reward(completions=conv)
    answers = [int(s.strip("$")) for s in rep_solutions]

    def mean(xs) -> float:
        xs = [x for x in xs if x is not None]
        return float(sum(xs) / len(xs)) if xs else 0.0

    samples = [
        {
            "prompt": prompts[i // num_samples][-1]["content"],
            "completion": sampled_text[i],
            "accuracy": acc_sampled[i],
            "format": fmt[i],
        }
        for i in range(0, len(sampled_text), num_samples)
    ]
    return EvalResult(
        accuracy_greedy=mean(acc_greedy),
        accuracy_sampled=mean(acc_sampled),
        boxed_rate=mean([1.0 if "\\boxed{" in t else 0.0 for t in sampled_text]),
        correct_anywhere=mean([1.0 if _stated_number(t) == a else 0.0 for t, a in zip(sampled_text, answers)]),
        mean_reward=mean([(a or 0.0) + f for a, f in zip(acc_sampled, fmt)]),
        mean_length=mean([len(ids) for ids in sampled.completion_ids]),
        samples=samples,
    )
