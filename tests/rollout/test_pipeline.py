"""RolloutPipeline stages with a scripted backend: grouping, masks, decoding, reward contract, advantages, IS."""

from __future__ import annotations

import pytest
import torch

from posttrain.generation.base import Completions, SamplingConfig
from posttrain.generation.rollout_func import RolloutFuncBackend
from posttrain.rewards.scoring import RewardScorer
from posttrain.rollout.estimators import GroupRelativeEstimator
from posttrain.rollout.pipeline import ImportanceSamplingSettings, RolloutPipeline, RolloutSettings, pad_rows

EOS = 258


class ScriptedBackend:
    """Completion j of a prompt = bytes of "ab"[:j+1] (+ EOS on even j); log-probs −0.5 per token."""

    def __init__(self):
        self.calls = []

    def sync_weights(self, model):
        pass

    def generate(self, prompt_ids, sampling, num_generations=1):
        self.calls.append((len(prompt_ids), num_generations))
        ids, lps, fin, prompts = [], [], [], []
        for p in prompt_ids:
            for j in range(num_generations):
                c = list(b"ab"[: j + 1]) + ([EOS] if j % 2 == 0 else [])
                ids.append(c)
                lps.append([-0.5] * len(c))
                fin.append(j % 2 == 0)
                prompts.append(list(p))
        return Completions(ids, lps, fin, prompts)


def _pipeline(tokenizer, reward_funcs, backend=None, **settings):
    sampling = SamplingConfig(max_new_tokens=4, eos_token_ids=[EOS], pad_token_id=tokenizer.pad_token_id)
    return RolloutPipeline(
        tokenizer=tokenizer,
        backend=backend or ScriptedBackend(),
        scorer=RewardScorer(reward_funcs),
        sampling=sampling,
        settings=RolloutSettings(num_generations=2, num_generations_eval=2, **settings),
        estimator=GroupRelativeEstimator("none"),
        policy_logps=lambda batch: torch.full(batch["completion_ids"].shape, -0.25),
    )


def test_standard_prompts_grouped_masked_scored(tiny_tokenizer):
    seen = {}

    def length_reward(completions, completion_ids, solution, log_extra, log_metric, trainer_state, **kwargs):
        seen.update(completions=completions, solution=solution, prompts=kwargs["prompts"], state=trainer_state)
        log_extra("solution", list(solution))
        log_metric("custom", 1.5)
        return [float(len(ids)) for ids in completion_ids]

    backend = ScriptedBackend()
    pipe = _pipeline(tiny_tokenizer, [length_reward], backend, keep_completions=True, mask_truncated_completions=True)
    rows = [{"prompt": "hi", "solution": "x"}] * 2 + [{"prompt": "yo!", "solution": "y"}] * 2
    metrics = {}
    batch = pipe.run(rows, trainer_state="STATE", record_metric=metrics.__setitem__)

    assert backend.calls == [(2, 2)]  # each unique prompt handed over once with G = 2
    assert seen["completions"] == ["a", "ab", "a", "ab"] and seen["solution"] == ["x", "x", "y", "y"]
    assert seen["prompts"] == ["hi", "hi", "yo!", "yo!"] and seen["state"] == "STATE"
    assert batch["prompt_ids"].tolist() == [[259, *b"hi"]] * 2 + [list(b"yo!")] * 2  # left-padded with <|pad|>
    assert batch["completion_ids"].tolist() == [[97, EOS], [97, 98], [97, EOS], [97, 98]]
    # "ab" hit the length without EOS: masked out by mask_truncated_completions.
    assert batch["completion_mask"].tolist() == [[1, 1], [0, 0], [1, 1], [0, 0]]
    assert batch["completion_lengths"].tolist() == [2, 2, 2, 2]
    assert batch["advantages"].tolist() == [0.0, 0.0, 0.0, 0.0]  # both completions have 2 tokens
    assert int(batch["num_items_in_batch"]) == 4
    assert "old_per_token_logps" not in batch  # on-policy: not needed
    assert metrics["custom"] == 1.5 and metrics["completions/clipped_ratio"] == 0.5
    assert metrics["rewards/length_reward/mean"] == 2.0 and metrics["num_tokens"] == 2 * 2 + 3 * 2 + 8
    table = pipe.last_completions.columns
    assert table["completion"] == ["a", "ab", "a", "ab"] and table["solution"] == ["x", "x", "y", "y"]
    assert table["advantage"] == [0.0] * 4


def test_conversational_prompts_and_completions(tiny_tokenizer):
    got = {}

    def reward(prompts, completions, **kwargs):
        got.update(prompts=prompts, completions=completions)
        return [1.0 if c[0]["content"].endswith("b") else 0.0 for c in completions]

    pipe = _pipeline(tiny_tokenizer, [reward])
    messages = [{"role": "user", "content": "hi"}]
    prefilled = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure: "}]
    batch = pipe.run([{"prompt": messages}] * 2 + [{"prompt": prefilled}] * 2)
    assert got["completions"][0] == [{"role": "assistant", "content": "a"}]
    assert got["completions"][3] == [{"role": "assistant", "content": "Sure: ab"}]  # prefilled content prepended
    assert got["prompts"][0] == messages
    rendered = tiny_tokenizer.decode(batch["prompt_ids"][0][batch["prompt_mask"][0].bool()])
    assert rendered.endswith("<|im_start|>assistant\n")
    assert batch["advantages"].tolist() == [-0.5, 0.5, -0.5, 0.5]


def test_none_rewards_are_ignored_and_unscorable_rows_get_zero_advantage(tiny_tokenizer):
    def maybe(completions, **kwargs):
        return [None, 1.0, 2.0, 4.0]

    pipe = _pipeline(tiny_tokenizer, [maybe])
    metrics = {}
    batch = pipe.run([{"prompt": "p"}] * 2 + [{"prompt": "q"}] * 2, record_metric=metrics.__setitem__)
    assert batch["advantages"].tolist() == [0.0, 0.0, -1.0, 1.0]
    assert metrics["rewards/maybe/mean"] == pytest.approx(7 / 3)


def test_run_keeps_its_gathered_result_for_the_stages_after_it(tiny_tokenizer):
    """``last_result``: the (N, K) per-function rewards and the estimator's result of the last batch, per mode."""

    def first(completions, **kwargs):
        return [1.0, 3.0, None, 2.0][: len(completions)]

    def second(completions, **kwargs):
        return [0.0, 1.0, 2.0, 2.0][: len(completions)]

    pipe = _pipeline(tiny_tokenizer, [first, second])
    assert pipe.last_result is None
    batch = pipe.run([{"prompt": "p"}] * 2 + [{"prompt": "q"}] * 2)
    result = pipe.last_result
    assert (result.mode, result.num_generations) == ("train", 2)
    assert result.rewards_per_func[:, 1].tolist() == [0.0, 1.0, 2.0, 2.0]
    assert result.rewards_per_func[2, 0].isnan() and result.rewards_per_func[3, 0] == 2.0
    assert result.rewards.tolist() == [1.0, 4.0, 2.0, 4.0]  # weighted sum (NaN counts as 0 when another scored)
    assert result.advantages.tolist() == batch["advantages"].tolist() == [-1.5, 1.5, -1.0, 1.0]
    assert result.estimate.std is not None
    pipe.run([{"prompt": "p"}] * 2, mode="eval")
    assert pipe.last_result.mode == "eval" and pipe.last_result.rewards_per_func.shape == (2, 2)


def test_pad_rows_pads_ragged_rows_on_either_side():
    assert pad_rows([[1, 2], [3]], 0, torch.long, "left").tolist() == [[1, 2], [0, 3]]
    assert pad_rows([[1, 2], [3]], 9, torch.long, "right", 4).tolist() == [[1, 2, 9, 9], [3, 9, 9, 9]]
    assert pad_rows([[], []], 0.5, torch.float32, "right").tolist() == [[0.5], [0.5]]  # at least one column


def test_importance_sampling_ratio_from_sampling_logprobs(tiny_tokenizer):
    pipe = _pipeline(
        tiny_tokenizer,
        [lambda completions, **kw: [0.0] * len(completions)],
        importance_sampling=ImportanceSamplingSettings(mode="token_truncate", clip_max=2.0),
    )
    metrics = {}
    batch = pipe.run([{"prompt": "p"}] * 2, record_metric=metrics.__setitem__)
    # old = −0.25, sampling = −0.5 → ratio exp(0.25) = 1.284 on valid tokens (padding gets 1).
    assert batch["old_per_token_logps"].shape == batch["sampling_per_token_logps"].shape == (2, 2)
    assert batch["importance_sampling_ratio"][0].tolist() == pytest.approx([1.2840254] * 2)
    assert metrics["sampling/sampling_logp_difference/mean"] == pytest.approx(0.25)


def test_rollout_func_gets_raw_prompts_and_its_extras_reach_rewards(tiny_tokenizer):
    received = {}

    def rollout_func(prompts, trainer):
        received["prompts"] = prompts
        n = len(prompts)
        return {
            "prompt_ids": [[1, 2]] * n,
            "completion_ids": [[97, 98, EOS]] * n,
            "logprobs": [[-1.0, -1.0, -1.0]] * n,
            "env_mask": [[1, 0, 1]] * n,
            "judge": [f"j{i}" for i in range(n)],
        }

    def reward(completions, judge, **kwargs):
        received["judge"] = judge
        return [float(i) for i in range(len(completions))]

    pipe = _pipeline(tiny_tokenizer, [reward], backend=RolloutFuncBackend(rollout_func, trainer=None))
    prompts = [[{"role": "user", "content": "hi"}]] * 2
    batch = pipe.run([{"prompt": p} for p in prompts])
    assert received["prompts"] == prompts  # raw (not templated), one per completion
    assert received["judge"] == ["j0", "j1"]
    assert batch["completion_mask"].tolist() == [[1, 0, 1]] * 2  # tool-result token excluded from the loss
    assert batch["prompt_ids"].tolist() == [[1, 2]] * 2


def test_missing_prompt_column_is_a_clear_error(tiny_tokenizer):
    pipe = _pipeline(tiny_tokenizer, [lambda completions, **kw: [0.0] * len(completions)])
    with pytest.raises(ValueError, match="needs a 'prompt' column; got columns \\['question'\\]"):
        pipe.run([{"question": "hi"}] * 2)


def test_completions_are_parsed_with_the_response_template(tiny_tokenizer):
    """With add_response_schema, reward functions get tool_calls parsed from the generated ids (TRL)."""
    import copy
    import json

    from posttrain.chat_template_utils import add_response_schema

    tokenizer = copy.deepcopy(tiny_tokenizer)
    add_response_schema(tokenizer)
    call = "<tool_call>\n" + json.dumps({"name": "add", "arguments": {"a": 1}}) + "\n</tool_call>"

    class ToolCallBackend(ScriptedBackend):
        def generate(self, prompt_ids, sampling, num_generations=1):
            ids = tokenizer.encode("Let me add." + call, add_special_tokens=False) + [EOS]
            n = len(prompt_ids) * num_generations
            return Completions([ids] * n, [[-0.5] * len(ids)] * n, [True] * n, [list(prompt_ids[0])] * n)

    got = {}

    def reward(completions, **kwargs):
        got["completions"] = completions
        return [1.0] * len(completions)

    pipe = _pipeline(tokenizer, [reward], backend=ToolCallBackend())
    pipe.run([{"prompt": [{"role": "user", "content": "hi"}]}] * 2)
    message = got["completions"][0][0]
    assert message["content"] == "Let me add."
    assert message["tool_calls"] == [{"type": "function", "function": {"name": "add", "arguments": {"a": 1}}}]


def test_each_stage_is_timed(tiny_tokenizer):
    """run() is a sequence of named stages, each recorded as timing/<stage> (seconds), the whole as timing/rollout;
    stages that do not run (ref log-probs without a reference, the table without log_completions) record nothing."""
    from posttrain.rollout.pipeline import STAGES

    pipe = _pipeline(
        tiny_tokenizer,
        [lambda completion_ids, **kwargs: [float(len(ids)) for ids in completion_ids]],
        compute_old_logps=True,
        importance_sampling=ImportanceSamplingSettings(mode="token_truncate", clip_max=2.0),
    )
    metrics = {}
    pipe.run([{"prompt": "hi"}] * 2, record_metric=metrics.__setitem__)
    timed = {name.removeprefix("timing/") for name in metrics if name.startswith("timing/")}
    assert timed == {*STAGES, "rollout"} - {"ref_logps", "completions_table"}
    assert all(metrics[f"timing/{name}"] >= 0.0 for name in timed)
    assert metrics["timing/rollout"] >= sum(metrics[f"timing/{name}"] for name in STAGES if name in timed)


def test_render_prompts_renders_each_run_of_equal_prompts_once(tiny_tokenizer, monkeypatch):
    import posttrain.rollout.pipeline as pipeline_module
    from posttrain.data.tokenization import tokenize_prompt

    calls = []

    def counting(row, *args, **kwargs):
        calls.append(kwargs["row_index"])
        return tokenize_prompt(row, *args, **kwargs)

    a = [{"role": "user", "content": "2+2?"}]
    b = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    rows = [{"prompt": list(a)} for _ in range(3)] + [{"prompt": list(b)} for _ in range(3)] + [{"prompt": list(a)}]
    rows[2]["chat_template_kwargs"] = {"enable_thinking": False}  # other rendering inputs break the run
    expected = [tokenize_prompt(r, tiny_tokenizer, row_index=i) for i, r in enumerate(rows)]
    monkeypatch.setattr(pipeline_module, "tokenize_prompt", counting)
    texts, ids = pipeline_module.render_prompts(rows, tiny_tokenizer)
    assert calls == [0, 2, 3, 6]  # a, a+kwargs, b, a again: once per run, not per row
    assert texts == [e["prompt_text"] for e in expected]
    assert ids == [e["prompt_ids"] for e in expected]
    assert ids[0] is not ids[1]  # each row owns its list (later stages may truncate in place)
