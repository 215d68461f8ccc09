"""`posttrain demo --task agent`: the calculator environment, the lazy teacher, the verifier, the compact tool
template, and the quick smoke run end to end."""

import json
import os
import re
import subprocess
import sys

import pytest

from posttrain.agents.environments import EnvironmentPool, environment_tool_names
from posttrain.agents.loop import prepare_tool_chat_template
from posttrain.agents.tool_calls import TOOL_CALL_PARSERS, detect_tool_call_parser
from posttrain.demo.agent_evaluate import AgentEvalResult, copy_accuracy, transcript
from posttrain.demo.agent_task import (
    CalculatorEnv,
    MulProblem,
    build_agent_tokenizer,
    calculator_tools,
    final_answer,
    make_agent_datasets,
    split_problems,
    verified_answer_reward,
)


def _factors(text):
    return tuple(map(int, re.findall(r"\d+", text)))


def test_calculator_env_is_one_tool_and_counts_calls():
    assert environment_tool_names(CalculatorEnv) == ["calculate"]
    env = CalculatorEnv()
    assert env.reset(a=347, b=826, prompt=[{"role": "user", "content": "x"}]) is None
    assert (env.a, env.b, env.calls) == (347, 826, 0)
    assert env.calculate() == 286622 and env.calculate() == 286622 and env.calls == 2
    env.reset(a=100, b=101)
    assert env.calls == 0 and env.calculate() == 10100  # a new rollout: its own problem, no calls yet
    # the pool builds one per rollout and GRPO renders its schema from the docstring and hints
    batch = EnvironmentPool(CalculatorEnv).prepare([{"a": 1, "b": 2, "prompt": []}, {"a": 3, "b": 4, "prompt": []}])
    assert [(e.a, e.b) for e in batch.environments] == [(1, 2), (3, 4)]
    assert batch.environments[0] is not batch.environments[1]
    (schema,) = calculator_tools()
    assert schema["function"]["name"] == "calculate"
    assert schema["function"]["parameters"]["properties"] == {}  # no arguments: the call is a constant string


def test_traces_and_estimates():
    p = MulProblem(347, 826)
    assert p.answer == 286622 and p.estimate == 350 * 830
    call, tool, answer = p.tool_trace()
    assert call["tool_calls"][0]["function"] == {"name": "calculate", "arguments": {}}
    assert call["content"] == ""  # the route is chosen by the first token: <tool_call> or \boxed
    assert tool == {"role": "tool", "name": "calculate", "content": "286622"}
    assert answer["content"] == "\\boxed{286622}"
    assert p.mental_trace() == [{"role": "assistant", "content": "\\boxed{290500}"}]
    assert MulProblem(125, 996).estimate == 130 * 1000  # rounds half up


def test_lazy_teacher_calls_the_tool_at_the_set_rate_and_held_out_pairs_are_unseen():
    sft, rl, ev = make_agent_datasets(n_sft=6000, n_rl=500, eval_size=100, tool_rate=0.3, copy_drill_rate=0.5, seed=0)
    assert len(sft) == 6000 and len(rl) == 500 and len(ev) == 100
    calls = right_mental = drills = 0
    for row in sft:
        if len(row["prompt"]) == 3:  # a copy drill: call and tool answer given, the completion is the boxed copy
            drills += 1
            (a, b), (_, call, tool), (answer,) = (
                _factors(row["prompt"][0]["content"]),
                row["prompt"],
                row["completion"],
            )
            assert call["tool_calls"][0]["function"] == {"name": "calculate", "arguments": {}}
            assert tool["content"] == str(a * b) and answer["content"] == f"\\boxed{{{a * b}}}"
            continue
        assert len(row["prompt"]) == 1
        a, b = _factors(row["prompt"][0]["content"])
        assert 100 <= a < 1000 and 100 <= b < 1000 and a * b >= 100_000  # six-digit products only
        completion = row["completion"]
        assert final_answer(completion) is not None  # every trace ends in a boxed answer
        if len(completion) == 3:
            calls += 1
            assert completion[0]["tool_calls"][0]["function"]["arguments"] == {}
            assert completion[1]["content"] == str(a * b) and final_answer(completion) == a * b
        else:
            assert final_answer(completion) == MulProblem(a, b).estimate
            right_mental += MulProblem(a, b).estimate == a * b
        assert row["tools"][0]["function"]["name"] == "calculate"
    whole = 6000 - drills
    assert 0.47 < drills / 6000 < 0.53 and 0.27 < calls / whole < 0.33  # the route is chosen in whole traces only
    assert right_mental < 0.02 * (whole - calls)  # mental math is (almost) never right
    held = {frozenset((r["a"], r["b"])) for r in ev}
    assert len(held) == 100
    assert not held & {frozenset(_factors(r["prompt"][0]["content"])) for r in sft}
    assert not held & {frozenset((r["a"], r["b"])) for r in rl}
    assert all(_factors(r["prompt"][0]["content"]) == (r["a"], r["b"]) for r in list(rl) + list(ev))
    # seeded: same seed, same split; another seed, another one
    assert split_problems(50, seed=3)[1] == split_problems(50, seed=3)[1] != split_problems(50, seed=4)[1]


def test_verifier_checks_the_final_boxed_answer_against_the_environment():
    envs = [CalculatorEnv() for _ in range(5)]
    for env in envs:
        env.reset(a=347, b=826)
    tool_route = MulProblem(347, 826).tool_trace()
    completions = [
        tool_route,
        [{"role": "assistant", "content": "\\boxed{290500}"}],  # mental math: wrong
        [{"role": "assistant", "content": "286622"}],  # right number, no box: not verified
        [{"role": "assistant", "content": "\\boxed{1} then \\boxed{286622}"}],  # the last box counts
        "\\boxed{286622}",  # plain text completions work too
    ]
    assert verified_answer_reward(completions, envs) == [1.0, 0.0, 0.0, 1.0, 1.0]
    envs[0].reset(a=100, b=100)  # the truth is the environment's problem, not the completion's claim
    assert verified_answer_reward([tool_route], envs[:1]) == [0.0]
    assert final_answer([{"role": "assistant", "content": ""}]) is None
    with pytest.raises(ValueError, match="needs the rollouts' environments"):
        verified_answer_reward(completions, None)


def test_compact_template_keeps_the_tool_format_and_the_tool_loop_checks():
    tok = build_agent_tokenizer()
    assert prepare_tool_chat_template(tok) is None  # prefix-preserving: kept as it is
    assert detect_tool_call_parser(tok) == "hermes"
    p = MulProblem(347, 826)
    prompt = [{"role": "user", "content": p.prompt_text()}]
    text = tok.apply_chat_template(prompt + p.tool_trace(), tools=calculator_tools(), tokenize=False)
    assert text.startswith("<|im_start|>system\n# Tools: calculate()<|im_end|>\n")
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    _, (call,) = TOOL_CALL_PARSERS.get("hermes")(turn)
    assert (call.name, call.arguments) == ("calculate", {})
    # the only copy: the tool's answer into the box, a fixed number of tokens later
    assert "<tool_response>286622</tool_response><|im_end|>\n<|im_start|>assistant\n\\boxed{286622}" in text
    assert len(tok(text, add_special_tokens=False)["input_ids"]) < 160  # the full schema header is ~470 more


def test_transcript_and_pooled_rates():
    assert transcript(MulProblem(347, 826).tool_trace()) == "→ calculate()\n← 286622\n\\boxed{286622}"
    result = AgentEvalResult(
        num_samples=2,
        greedy_success=[1.0, 0.0],
        greedy_tool_use=[1.0, 0.0],
        sampled_success=[1.0, 0.5],
        sampled_tool_use=[1.0, 0.5],
        sampled_success_with_tool=[2.0, 0.0],  # problem 2: its tool sample failed, its mental one was right
        pass_at_k=[1.0, 1.0],
        lengths=[80.0, 40.0],
        prompts=["a", "b"],
        answers=[1, 2],
        greedy_transcripts=["", ""],
        sampled_transcripts=["", ""],
        sampled_transcript_success=[1.0, 0.0],
    )
    m = result.metrics()
    assert m["sampled: success when the tool was used"][0] == pytest.approx(2 / 3)
    assert m["sampled: success without the tool"][0] == pytest.approx(1.0)
    assert m["greedy: success (verified answer)"][0] == 0.5 and m["sampled (T=1): tool-use rate"][0] == 0.75


def test_agent_demo_quick_end_to_end(tmp_path):
    out = tmp_path / "agent"
    proc = subprocess.run(
        [sys.executable, "-m", "posttrain.cli.main", "demo", "--task", "agent", "--quick", "--output_dir", str(out)],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["task"] == "agent" and summary["mode"] == "quick" and summary["eval_problems"] == 12
    headline = {"greedy: success (verified answer)", "greedy: tool-use rate", "sampled (T=1): tool-use rate"}
    for stage in ("after_sft", "after_grpo"):
        row = summary[stage]
        assert headline <= set(row)
        assert all(0.0 <= v <= 1.0 for k, v in row.items() if "tokens" not in k)
        assert 0 < row["mean completion tokens (sampled)"] <= 128
    assert set(summary["gains"]) == {
        "greedy: success (verified answer)",
        "greedy: tool-use rate",
        "sampled (T=1): success",
        "sampled (T=1): tool-use rate",
    }
    assert {"sft_cpu_s", "grpo_cpu_s", "total_wall_s", "total_cpu_s"} <= set(summary["timings"])
    grpo = [json.loads(line) for line in (out / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert any("tools/call_frequency" in r and "reward" in r for r in grpo)
    assert (out / "sft" / "metrics.jsonl").exists() and (out / "grpo" / "model.safetensors").exists()
    page = (out / "report.html").read_text()
    assert "held-out metric" in page and "tool-use rate" in page and "after GRPO (greedy)" in page
    assert page.count("<td class='comp'>") == 4 * 12  # greedy and sampled transcripts of both models
    assert page.count("data:image/png;base64,") == 4
    assert "after SFT" in proc.stdout and "after GRPO" in proc.stdout


def test_sft_on_copy_drills_teaches_the_copy_of_the_tools_answer(tmp_path):
    """The step the demo's GRPO cannot teach: copying the calculator's answer into the box. A small model, SFT'd
    through the demo's recipe on 9600 copy drills (300 steps; 240 steps over 1920 rows reached only 0.58), copies it
    on held-out problems; the untrained model does not. If the drills stop teaching the copy (format, loss mask,
    schedule), this fails in about a minute of CPU, where the full demo would only show GRPO learning nothing."""
    from posttrain.demo.common import RECIPES, _stage, _write_jsonl
    from posttrain.models.loading import create_model_from_path
    from posttrain.models.tiny import build_tiny_model

    tok = build_agent_tokenizer()
    build_tiny_model("qwen2", tokenizer=tok, seed=0, hidden_size=64, num_layers=2).save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    drills, _, _ = make_agent_datasets(n_sft=9600, n_rl=1, eval_size=200, copy_drill_rate=1.0, seed=0)
    held = split_problems(200, seed=0)[1][:50]
    assert copy_accuracy(create_model_from_path(str(tmp_path / "base")), tok, held)[0] == 0.0
    data = _write_jsonl(tmp_path / "drills.jsonl", drills)
    overrides = {"max_steps": 300, "lr_scheduler_type": "constant_with_warmup", "write_report": "false"}
    argv = ["--config", str(RECIPES / "agent_sft.yaml"), "--model_name_or_path", str(tmp_path / "base")]
    argv += ["--dataset_name", data, "--output_dir", str(tmp_path / "sft"), "--seed", "0"]
    _stage("sft", argv + [x for k, v in overrides.items() for x in (f"--{k}", str(v))])
    rate, texts = copy_accuracy(create_model_from_path(str(tmp_path / "sft")), tok, held)
    assert rate >= 0.9, texts[:5]


@pytest.mark.slow
@pytest.mark.run_first  # ~9 minutes of CPU: started first so that -n 2 overlaps it with the rest
def test_full_agent_demo_learns_to_use_the_tool(tmp_path):
    """The full default schedule on the default seed (0), exactly as README's command runs it: SFT must teach the copy
    of the tool's answer into the box (without it no rollout is ever verified and GRPO has nothing to learn from),
    and GRPO must then turn the tool into the habit, raising held-out success."""
    out = tmp_path / "agent"
    proc = subprocess.run(
        [sys.executable, "-m", "posttrain.cli.main", "demo", "--task", "agent", "--output_dir", str(out)],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["seed"] == 0 and summary["mode"] == "full"
    sft, grpo = summary["after_sft"], summary["after_grpo"]
    assert summary["sft_copy_accuracy"] >= 0.8, summary["verdict"]  # the copy formed in SFT (greedy, given the call)
    assert sft["sampled: success when the tool was used"] > 0.8, summary["verdict"]  # ... and in the sampled rollouts
    assert sft["sampled (T=1): tool-use rate"] < 0.5  # ... while the route choice still follows the lazy teacher
    gain = summary["gains"]["greedy: success (verified answer)"]
    assert gain["mean"] >= 0.5 and gain["mean"] > 3 * gain["standard_error"], summary["verdict"]
    assert grpo["greedy: success (verified answer)"] >= 0.8 and grpo["greedy: tool-use rate"] >= 0.8
