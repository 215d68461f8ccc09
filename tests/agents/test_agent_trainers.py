"""Agent training end to end: GRPOTrainer / RLOOTrainer with tools and environment_factory on the tiny model.

Rollouts come from a scripted policy (the real tiny model and GroupSampler, logits forced to a script) swapped in as
the tool loop's inner backend; the loss, masks, rewards and metrics are the trainers' own.
"""

from __future__ import annotations

import re

import pytest
import torch
from agent_helpers import call, last_user, scripted_sampler, tool_responses
from datasets import Dataset

from posttrain import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


async def neg(x: int) -> int:
    """Negate an integer.

    Args:
        x: The integer.
    """
    return -x


def _config(tmp_path, cls=GRPOConfig, **overrides):
    values = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=128,
        max_steps=1,
        learning_rate=1e-2,
        report_to="none",
        gradient_checkpointing=False,
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        write_report=False,
    )
    values.update(overrides)
    return cls(**values)


def _use_script(trainer, script):
    """Swap the tool loop's inner backend for a scripted GroupSampler (same tokenizer)."""
    sampler, _, scripted = scripted_sampler(script, tokenizer=trainer.processing_class)
    trainer.backend.inner = sampler
    return scripted


def _arith_script(context):
    """'a+b' questions: call add (wrongly for odd a, so rewards vary), then answer; 'neg' ones call the async tool."""
    question, responses = last_user(context), tool_responses(context)
    if responses:
        return f"It is {responses[-1]}."
    if question.startswith("neg"):
        return call("neg", f'{{"x": {question[4:]}}}')
    a, b = (int(x) for x in question.split("+"))
    return call("add", f'{{"a": {a}, "b": {b if a % 2 == 0 else b + 1}}}')


def _arith_dataset():
    rows = [{"prompt": [{"role": "user", "content": f"{a}+3"}], "a": a, "b": 3} for a in (2, 3)]
    return Dataset.from_list(rows)


def _trainable(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def test_grpo_with_tools_masks_tool_tokens_trains_and_logs(tiny_model_path, tmp_path):
    seen = {}

    def correct(completions, a, b, **kwargs):
        seen.update(completions=completions, kwargs=sorted(kwargs))
        return [
            float(any(m["role"] == "tool" and m["content"] == str(x + y) for m in c))
            for c, x, y in zip(completions, a, b)
        ]

    def alternate(completions, **kwargs):  # the scripted group members are identical: make their rewards differ
        return [float(i % 2) for i in range(len(completions))]

    trainer = GRPOTrainer(
        tiny_model_path, [correct, alternate], _config(tmp_path), train_dataset=_arith_dataset(), tools=[add, neg]
    )
    _use_script(trainer, _arith_script)
    rows = [dict(r) for r in _arith_dataset() for _ in range(2)]
    batch = trainer.pipeline.run(rows)
    tok = trainer.processing_class
    tool_mask, mask = batch["tool_mask"], batch["completion_mask"]
    lengths = batch["completion_lengths"]
    valid = torch.arange(mask.shape[1])[None] < lengths[:, None]
    assert torch.equal(mask.bool(), valid & tool_mask.bool())
    for i in range(4):
        ids = batch["completion_ids"][i, : lengths[i]].tolist()
        excluded = tok.decode([t for t, m in zip(ids, mask[i].tolist()) if not m], skip_special_tokens=False)
        assert excluded.startswith("\n<|im_start|>tool\n<tool_response>") and excluded.endswith(
            "<|im_start|>assistant\n"
        )
    assert int(batch["num_items_in_batch"]) == int(mask.sum())
    advantages = batch["advantages"].tolist()
    assert advantages[0] < 0 < advantages[1] and advantages[2] < 0 < advantages[3]
    assert seen["completions"][0][1] == {"role": "tool", "name": "add", "content": "5"}
    assert "tool_mask" not in seen["kwargs"] and "completion_messages" not in seen["kwargs"]
    assert "environments" not in seen["kwargs"]

    before = _trainable(trainer)
    trainer.train()
    logs = trainer.state.log_history[0]
    assert logs["tools/call_frequency"] == 1.0 and logs["tools/failure_frequency"] == 0.0
    assert logs["rewards/correct/mean"] == 0.5
    assert sum(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters() if n in before) > 0


def test_tool_failures_are_logged(tiny_model_path, tmp_path):
    def script(context):
        return "Gave up." if tool_responses(context) else call("nope", "{}")

    trainer = GRPOTrainer(
        tiny_model_path, lambda completions, **kw: [0.0] * len(completions), _config(tmp_path, max_completion_length=160),
        train_dataset=_arith_dataset(), tools=[add],
    )  # fmt: skip
    _use_script(trainer, script)
    trainer.train()
    logs = trainer.state.log_history[0]
    assert logs["tools/call_frequency"] == 1.0 and logs["tools/failure_frequency"] == 1.0


class CounterEnv:
    def reset(self, **row) -> str:
        self.counter = 0
        self.target = int(row.get("target", 3))
        return f"Set the counter to {self.target}."

    def increment(self, step: int) -> int:
        """Add to the counter.

        Args:
            step: Amount to add.
        """
        self.counter += step
        return self.counter

    def get_reward(self) -> float:
        return float(self.counter == self.target)


class EchoEnv:
    def reset(self, **row) -> None:
        self.words: list[str] = []

    def shout(self, text: str) -> str:
        """Shout text.

        Args:
            text: The words.
        """
        self.words.append(text)
        return text.upper()


def _counter_script(context):
    if tool_responses(context):
        return "Done."
    if "shout" in context.split("<tools>", 1)[-1].split("</tools>", 1)[0]:
        return call("shout", '{"text": "hi"}')
    target = int(re.search(r"counter to (\d+)", last_user(context)).group(1))
    return call("increment", f'{{"step": {target}}}')


def test_environment_factory_without_dataset_or_reward_funcs(tiny_model_path, tmp_path):
    trainer = GRPOTrainer(tiny_model_path, None, _config(tmp_path), environment_factory=CounterEnv)
    assert trainer.reward_func_names == ["CounterEnv"]
    assert len(trainer.train_dataset) == 2 and trainer.train_dataset[0]["prompt"] == [{"role": "user", "content": ""}]
    scripted = _use_script(trainer, _counter_script)
    trainer.train()
    logs = trainer.state.log_history[0]
    assert logs["rewards/CounterEnv/mean"] == 1.0 and logs["tools/call_frequency"] == 1.0
    # The environment's task reached the model through the (empty) user message.
    assert any(last_user(c) == "Set the counter to 3." for c in scripted.contexts)
    with pytest.raises(ValueError, match=r"^When training without a `train_dataset` .* `max_steps` must be set"):
        GRPOTrainer(tiny_model_path, None, _config(tmp_path, max_steps=-1), environment_factory=CounterEnv)


def test_dict_of_environments_rewards_and_tools_per_row(tiny_model_path, tmp_path):
    seen = {}

    def shouted(environments, **kwargs):
        seen["types"] = [type(e).__name__ for e in environments]
        return [float(len(e.words)) if isinstance(e, EchoEnv) else None for e in environments]

    data = Dataset.from_list([
        {"prompt": [{"role": "user", "content": "Go."}], "environment": "counter", "target": 4},
        {"prompt": [{"role": "user", "content": "Talk."}], "environment": "echo", "target": 0},
    ])  # fmt: skip
    trainer = GRPOTrainer(
        tiny_model_path, shouted, _config(tmp_path, shuffle_dataset=False, reward_weights=[2.0]), train_dataset=data,
        environment_factory={"counter": CounterEnv, "echo": EchoEnv},
    )  # fmt: skip
    assert trainer.reward_func_names == ["shouted", "CounterEnv"]
    assert trainer.scorer.weights.tolist() == [2.0, 1.0]  # the environment's column weighs 1
    scripted = _use_script(trainer, _counter_script)
    trainer.train()
    logs = trainer.state.log_history[0]
    assert sorted(seen["types"]) == ["CounterEnv", "CounterEnv", "EchoEnv", "EchoEnv"]
    assert logs["rewards/CounterEnv/mean"] == 1.0 and logs["rewards/shouted/mean"] == 1.0
    # Each prompt rendered only its own environment's tool.
    tool_blocks = {c.split("<tools>", 1)[1].split("</tools>", 1)[0] for c in scripted.contexts}
    assert {("increment" in b, "shout" in b) for b in tool_blocks} == {(True, False), (False, True)}
    with pytest.raises(ValueError, match=r"^A `dict` `environment_factory` \(multiple environments\) requires"):
        GRPOTrainer(tiny_model_path, None, _config(tmp_path), environment_factory={"echo": EchoEnv})


def test_rloo_with_tools(tiny_model_path, tmp_path):
    def parity(completions, **kwargs):
        return [float(i % 2) for i in range(len(completions))]

    trainer = RLOOTrainer(
        tiny_model_path, parity, _config(tmp_path, RLOOConfig, beta=0.0, max_tool_calling_iterations=1),
        train_dataset=_arith_dataset(), tools=[add, neg],
    )  # fmt: skip
    _use_script(trainer, _arith_script)
    before = _trainable(trainer)
    trainer.train()
    assert trainer.state.log_history[0]["tools/call_frequency"] == 1.0
    assert sum(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters() if n in before) > 0


def test_agent_options_that_cannot_be_combined(tiny_model_path, tmp_path):
    def rollout_func(prompts, trainer):
        return {}

    with pytest.raises(ValueError, match="rollout_func cannot be combined with tools"):
        GRPOTrainer(tiny_model_path, lambda **kw: [], _config(tmp_path), train_dataset=_arith_dataset(),
                    tools=[add], rollout_func=rollout_func)  # fmt: skip
    with pytest.raises(ValueError, match="Tool 'len' cannot be turned into a JSON schema"):
        GRPOTrainer(tiny_model_path, lambda **kw: [], _config(tmp_path), train_dataset=_arith_dataset(), tools=[len])
    standard = Dataset.from_list([{"prompt": "2+3"}] * 2)
    trainer = GRPOTrainer(tiny_model_path, lambda **kw: [], _config(tmp_path), train_dataset=standard, tools=[add])
    with pytest.raises(ValueError, match="tools need conversational prompts"):
        trainer.pipeline.run([{"prompt": "2+3"}] * 2)
