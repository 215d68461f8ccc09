"""environment_factory: per-rollout instances, reset observations, methods as tools, get_reward, dict form."""

from __future__ import annotations

import re

import pytest
from agent_helpers import EOS, PAD, call, last_user, tool_responses

from posttrain.agents.environments import (
    EnvironmentPool,
    append_to_last_user_message,
    environment_tool_names,
    placeholder_dataset,
)
from posttrain.agents.loop import AgentRollout
from posttrain.data.chat_templates import render_chat
from posttrain.generation.base import SamplingConfig
from posttrain.rewards.scoring import RewardScorer


class IncrementEnv:
    """TRL's documented example environment."""

    def __init__(self):
        self.counter = 0
        self.resets: list[dict] = []

    def reset(self, **kwargs) -> str | None:
        self.resets.append(kwargs)
        self.counter = 0
        return "Counter reset to 0.\n"

    def increment(self, step: int) -> int:
        """Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter

    def get_reward(self) -> float:
        return float(self.counter)

    def _helper(self) -> None:
        """Private: not a tool."""


class EchoEnv:
    def reset(self, **kwargs) -> None:
        self.kwargs = kwargs
        self.said: list[str] = []

    def say(self, text: str) -> str:
        """Say something.

        Args:
            text: The words.
        """
        self.said.append(text)
        return text.upper()

    async def get_reward(self) -> float:
        return float(len(self.said))


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_tool_names_are_public_methods_without_reset_and_get_reward():
    assert environment_tool_names(IncrementEnv) == ["increment"]
    assert environment_tool_names(EchoEnv) == ["say"]


def test_append_to_last_user_message():
    prompt = [{"role": "system", "content": "s"}, *user("a"), {"role": "assistant", "content": "b"}, *user("c")]
    out = append_to_last_user_message(prompt, "!")
    assert out[-1]["content"] == "c!" and prompt[-1]["content"] == "c"  # the original is not mutated
    blocks = [{"role": "user", "content": [{"type": "text", "text": "c"}]}]
    assert append_to_last_user_message(blocks, "!")[0]["content"][-1] == {"type": "text", "text": "!"}
    assert append_to_last_user_message("plain", "!") == "plain!"
    assert append_to_last_user_message([{"role": "system", "content": "s"}], "task")[-1] == user("task")[0]


def test_one_instance_per_rollout_reused_across_batches_and_grown_on_demand():
    pool = EnvironmentPool(IncrementEnv)
    rows = [{"prompt": user("Increment by 1."), "target": 1}] * 2
    first = pool.prepare(rows)
    assert len({id(e) for e in first.environments}) == 2
    assert first.rows[0]["prompt"] == user("Increment by 1.Counter reset to 0.\n")
    assert first.environments[0].resets[-1] == {"prompt": user("Increment by 1."), "target": 1}
    # Each rollout's tools are bound to its own instance.
    first.tools[1]["increment"].function(5)
    assert [e.counter for e in first.environments] == [0, 5]
    second = pool.prepare(rows * 2)
    assert second.environments[:2] == first.environments and len({id(e) for e in second.environments}) == 4
    assert [e.counter for e in second.environments] == [0, 0, 0, 0]  # reset again
    assert second.tool_schemas[0][0]["function"]["name"] == "increment"


def test_prompt_may_be_omitted():
    batch = EnvironmentPool(IncrementEnv).prepare([{"task": "x"}])
    assert batch.rows[0]["prompt"] == user("Counter reset to 0.\n")
    assert batch.environments[0].resets == [{"task": "x"}]
    batch = EnvironmentPool(EchoEnv).prepare([{"task": "x"}])
    assert batch.rows[0]["prompt"] == user("")
    data = placeholder_dataset(3)
    assert len(data) == 3 and data[0]["prompt"] == user("")


def test_dict_of_factories_selected_by_environment_column():
    pool = EnvironmentPool({"counter": IncrementEnv, "echo": EchoEnv})
    rows = [
        {"prompt": user("count"), "environment": "counter"},
        {"prompt": user("talk"), "environment": "echo", "extra": 1},
    ]
    batch = pool.prepare(rows)
    assert [type(e) for e in batch.environments] == [IncrementEnv, EchoEnv]
    assert batch.environments[1].kwargs == {"prompt": user("talk"), "extra": 1}  # no 'environment' key
    assert [list(t) for t in batch.tools] == [["increment"], ["say"]]
    assert [[s["function"]["name"] for s in schemas] for schemas in batch.tool_schemas] == [["increment"], ["say"]]
    with pytest.raises(ValueError, match="Row 0 has no 'environment' column.*\\['counter', 'echo'\\]"):
        pool.prepare([{"prompt": user("x")}])
    with pytest.raises(ValueError, match="Row 0 has environment='chess'.*valid values: \\['counter', 'echo'\\]"):
        pool.prepare([{"prompt": user("x"), "environment": "chess"}])


def test_get_reward_columns_sync_async_and_none_for_other_classes():
    pool = EnvironmentPool({"counter": IncrementEnv, "echo": EchoEnv})
    funcs = pool.reward_functions()
    assert [f.__name__ for f in funcs] == ["IncrementEnv", "EchoEnv"]
    batch = pool.prepare([{"environment": "counter"}, {"environment": "echo"}])
    batch.environments[0].increment(4)
    batch.environments[1].say("a")
    scorer = RewardScorer(funcs)
    rewards = scorer.score(
        prompts=[r["prompt"] for r in batch.rows],
        completions=[[{"role": "assistant", "content": ""}]] * 2,
        completion_ids=[[1], [1]],
        environments=batch.environments,
    )
    assert scorer.names == ["IncrementEnv", "EchoEnv"]
    assert rewards[0, 0] == 4.0 and rewards[1, 1] == 1.0
    assert rewards[0, 1].isnan() and rewards[1, 0].isnan()
    assert EnvironmentPool(lambda: EchoEnv()).reward_functions()[0].__name__ == "EchoEnv"


def test_contract_errors():
    class NoReset:
        pass

    class BadReset:
        def reset(self, **kwargs):
            return 3

    with pytest.raises(TypeError, match="without a reset method"):
        EnvironmentPool(NoReset)
    with pytest.raises(TypeError, match="must return a string"):
        EnvironmentPool(BadReset).prepare([{}])
    with pytest.raises(TypeError, match="environment_factory must be callable"):
        EnvironmentPool(3)
    with pytest.raises(ValueError, match="empty dict"):
        EnvironmentPool({})

    class Undocumented:
        def reset(self, **kwargs):
            return None

        def act(self, x):
            return x

    with pytest.raises(ValueError, match="Tool 'act' cannot be turned into a JSON schema"):
        EnvironmentPool(Undocumented)


def test_agent_rollout_errors(tiny_tokenizer):
    with pytest.raises(ValueError, match="needs tools=\\[...\\] or an environment_factory"):
        AgentRollout(tiny_tokenizer)

    def increment(step: int) -> int:
        """Clash.

        Args:
            step: Step.
        """
        return step

    with pytest.raises(ValueError, match="both in tools=\\[...\\] and methods of IncrementEnv"):
        AgentRollout(tiny_tokenizer, tools=[increment], environment_factory=IncrementEnv)
    agent = AgentRollout(tiny_tokenizer, environment_factory=IncrementEnv)
    with pytest.raises(ValueError, match="Row 0 has a standard \\(string\\) prompt"):
        agent.prepare([{"prompt": "Increment."}])


def test_environment_rollouts_through_the_loop(scripted):
    def script(context):
        if not tool_responses(context):
            step = re.search(r"by (\d+)", last_user(context)).group(1)
            return call("increment", f'{{"step": {step}}}')
        return "Done."

    sampler, tok, _ = scripted(script)
    agent = AgentRollout(tok, environment_factory=IncrementEnv, max_completion_length=300)
    backend = agent.wrap(sampler)
    rows = [{"prompt": user("Increment the counter by 3.")}] * 2 + [
        {"prompt": user("Increment the counter by 5.")}
    ] * 2
    batch = agent.prepare(rows)
    ids = [
        render_chat(tok, r["prompt"], tools=s, tokenize=True, add_generation_prompt=True)["input_ids"]
        for r, s in zip(batch.rows, batch.tool_schemas)
    ]
    out = backend.generate(ids[::2], SamplingConfig(300, eos_token_ids=[EOS], pad_token_id=PAD), 2, tools=batch.tools)
    assert [e.counter for e in batch.environments] == [3, 3, 5, 5]
    assert [m[1]["content"] for m in out.extra["completion_messages"]] == ["3", "3", "5", "5"]
    rewards = RewardScorer(agent.reward_funcs).score(
        prompts=[r["prompt"] for r in batch.rows],
        completions=out.extra["completion_messages"],
        completion_ids=out.completion_ids,
        environments=batch.environments,
    )
    assert rewards[:, 0].tolist() == [3.0, 3.0, 5.0, 5.0]
