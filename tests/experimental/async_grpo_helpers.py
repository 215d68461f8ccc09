"""Picklable pieces for the AsyncGRPO tests (the rollout worker is a spawned process: it imports this module)."""

from __future__ import annotations


def failing_reward(completion_ids, **kwargs):
    raise ValueError("reward exploded on purpose")


# -- agent training (tests/experimental/test_async_grpo_agents.py): tools, environments and rewards the worker runs


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def tool_result_reward(completions, a, b, **kwargs):
    """1.0 when the conversation holds a tool message with the right sum (the tool's result entered the completion)."""
    return [
        float(any(m["role"] == "tool" and m["content"] == str(x + y) for m in c)) for c, x, y in zip(completions, a, b)
    ]


class CounterEnv:
    """One counter per rollout: ``reset`` starts it at the row's ``start``, the ``bump`` tool adds to it.

    ``get_reward`` is 1.0 only when this instance saw exactly one call since its reset and holds start + 4 (what the
    script bumps by): an instance shared between rollouts, or not reset, scores 0."""

    def reset(self, start: int = 0, **kwargs) -> str:
        self.start, self.value, self.calls = int(start), int(start), 0
        return f"The counter starts at {self.start}."

    def bump(self, by: int) -> int:
        """Add to the counter.

        Args:
            by: How much to add.
        """
        self.calls += 1
        self.value += by
        return self.value

    def get_reward(self) -> float:
        return float(self.calls == 1 and self.value == self.start + 4)


# -- images (tests/experimental/test_async_grpo_vlm.py)


def distinct_chars_reward(completions, images=None, **kwargs):
    """The number of distinct characters of each (conversational) completion; ``images`` must reach reward functions
    (one list per row, as TRL passes them)."""
    if images is None or len(images) != len(completions):
        raise ValueError("the reward function did not get the rows' images")
    return [float(len(set(c[0]["content"]))) for c in completions]


# -- captured agent rollouts (tests/experimental/test_async_grpo_capture.py): an agent program the worker runs

CALC_TOOL = {"type": "function", "function": {"name": "calculator", "description": "Evaluate a + b.",
             "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                            "required": ["expression"]}}}  # fmt: skip


def calculator_agent(prompt: str, base_url: str, rollout_id: str) -> float:
    """Ask, send the calculator's result back as a tool message, ask again (two chat calls under ``rollout_id``);
    reward = the share of digits in the final answer. The token ids the server returned for each call are appended
    to ``$POSTTRAIN_TEST_TOKEN_LOG`` (one JSON line per rollout), so the trainer's side can check its loss mask."""
    import json
    import os

    import httpx

    messages = [{"role": "system", "content": "Add the numbers."}, {"role": "user", "content": prompt}]
    body = {"model": "tiny", "tools": [CALC_TOOL], "max_tokens": 6, "temperature": 1.0}
    index = int(rollout_id.rsplit("-", 1)[1])  # the row's place in the batch: a distinct seed per rollout
    sampled: list[int] = []
    with httpx.Client(base_url=base_url, timeout=60) as http:
        answer = ""
        for turn in range(2):
            r = http.post("/chat/completions", json={**body, "messages": messages, "seed": 10 * index + turn})
            r.raise_for_status()
            choice = r.json()["choices"][0]
            sampled += choice["token_ids"]
            answer = choice["message"]["content"] or ""
            messages.append({"role": "assistant", "content": answer})
            if turn == 0:
                a, b = (int(x) for x in prompt.split("+"))
                messages.append({"role": "tool", "tool_call_id": "calc-0", "content": str(a + b)})
    with open(os.environ["POSTTRAIN_TEST_TOKEN_LOG"], "a") as log:
        log.write(json.dumps({"rollout_id": rollout_id, "sampled": sampled}) + "\n")
    return sum(ch.isdigit() for ch in answer) / max(len(answer), 1)
