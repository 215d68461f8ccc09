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
