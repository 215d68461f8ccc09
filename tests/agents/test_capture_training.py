"""GRPO trains an agent that runs its own loop: the agent (plain httpx) calls ``/v1/chat/completions`` under a rollout
id, uses a calculator tool, and returns a reward; ``agent_rollout_func`` turns the captured calls into training rows.
The rows' masks cover exactly the model's sampled tokens, and their sampling log-probs equal the trainer's own
per-token log-probs (importance-sampling ratio 1 on-policy)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from datasets import Dataset  # noqa: E402

from posttrain.agents.capture import agent_reward_func, agent_rollout_func  # noqa: E402
from posttrain.serving.app import serve_in_thread  # noqa: E402
from posttrain.serving.engine import PosttrainEngine  # noqa: E402

ALLOWED = {10, *range(32, 127), 258}  # newline, printable ASCII, <|im_end|>: text that re-tokenises to itself
CALC_TOOL = {"type": "function", "function": {"name": "calculator", "description": "Evaluate a + b.",
             "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                            "required": ["expression"]}}}  # fmt: skip


@pytest.fixture(scope="module")
def ascii_model_path(tmp_path_factory):
    """The tiny Qwen2 (untied head) edited so it samples only ``ALLOWED`` tokens: residual coordinate 0 is a constant
    (its embedding column is 4, nothing writes to it) and the head gives every other token −1000 times it. A random
    model's bytes would not survive the agent's decode → chat template → encode round trip, so the history would
    not be a prefix extension; this keeps one row per rollout without scripting the sampler."""
    from transformers import AutoModelForCausalLM

    from posttrain.models.tiny import save_tiny_model

    path = save_tiny_model(tmp_path_factory.mktemp("ascii-qwen2"), arch="qwen2", tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 4.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0] = 0.0
            layer.mlp.down_proj.weight[0] = 0.0
        banned = torch.tensor([t for t in range(model.lm_head.weight.shape[0]) if t not in ALLOWED])
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[banned, 0] = -1000.0
    model.save_pretrained(path)
    return path


def calculator(expression: str) -> str:
    a, b = (int(x) for x in expression.split("+"))
    return str(a + b)


def agent(prompt: str, base_url: str, rollout_id: str) -> float:
    """Ask, run the calculator on the question (the model's own tool call when it made one), send the result back
    as a tool message, ask again; reward = the share of digits in the final answer."""
    messages = [{"role": "system", "content": "Add the numbers."}, {"role": "user", "content": prompt}]
    body = {"model": "tiny", "tools": [CALC_TOOL], "max_tokens": 6, "temperature": 1.0}
    index = int(rollout_id.rsplit("-", 1)[1])  # the row's place in the batch: a distinct seed per rollout
    with httpx.Client(base_url=base_url, timeout=60) as http:
        answer = None
        for turn in range(2):
            r = http.post("/chat/completions", json={**body, "messages": messages, "seed": 10 * index + turn})
            r.raise_for_status()
            message = r.json()["choices"][0]["message"]
            messages.append({"role": "assistant", "content": message["content"] or ""})
            answer = message["content"] or ""
            if turn == 0:
                messages.append({"role": "tool", "tool_call_id": "calc-0", "content": calculator(prompt)})
    return sum(ch.isdigit() for ch in answer) / max(len(answer), 1)


def test_grpo_trains_on_captured_agent_rollouts(ascii_model_path, tmp_path):
    from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

    engine = PosttrainEngine.from_pretrained(ascii_model_path, device="cpu", served_model_name="tiny")
    checks: list[dict] = []
    with serve_in_thread(engine) as url:
        capture = agent_rollout_func(agent, url, timeout=120, max_workers=4)

        def rollout(prompts, trainer):
            out = capture(prompts, trainer)
            calls = capture.last_calls
            # the trainer's own forward on the rows, with the weights the server sampled with (just pushed)
            for i, (p, c, lp, m) in enumerate(zip(out["prompt_ids"], out["completion_ids"], out["logprobs"],
                                                  out["env_mask"])):  # fmt: skip
                ids = torch.tensor([p + c])
                with torch.no_grad():
                    logits = trainer.model(input_ids=ids).logits[0, len(p) - 1 : -1].float()
                own = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, len(p) :, None])[:, 0]
                mask = torch.tensor(m, dtype=torch.bool)
                sampled = [t for call in calls[i] for t in call["completions"][0]["token_ids"]]
                checks.append({"diff": float((own - torch.tensor(lp))[mask].abs().max()),
                               "model_tokens": [t for t, k in zip(c, m) if k] == sampled,
                               "context_zero_logprob": all(x == 0.0 for x, k in zip(lp, m) if not k),
                               "context": [t for t, k in zip(c, m) if not k], "calls": len(calls[i])})  # fmt: skip
            return out

        args = GRPOConfig(output_dir=str(tmp_path), report_to="none", max_steps=2, per_device_train_batch_size=4,
                          num_generations=2, max_completion_length=256, learning_rate=5e-2, temperature=1.0,
                          logging_steps=1, save_strategy="no", seed=0, disable_tqdm=True, write_report=False,
                          gradient_checkpointing=False, use_vllm=True, vllm_mode="server",
                          vllm_server_base_url=url)  # fmt: skip
        data = Dataset.from_list([{"prompt": f"{a}+{b}"} for a, b in [(12, 30), (7, 5), (40, 2), (9, 9)]])
        trainer = GRPOTrainer(ascii_model_path, agent_reward_func, args, train_dataset=data, rollout_func=rollout)
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.train()
        served_version = httpx.get(f"{url}/health", timeout=30).json()["version"]

    assert len(checks) == 8  # 2 steps × 4 rollouts
    for check in checks:
        assert check["calls"] == 2 and check["model_tokens"] and check["context_zero_logprob"], check
        assert check["diff"] < 1e-4, check  # IS ratio 1 on-policy, to float tolerance
        assert "<tool_response>" in engine.tokenizer.decode(check["context"])  # the tool output is context
    assert all(n == 1 for rows in capture.last_rows for n in [len(rows)])
    assert served_version == 1  # the policy was pushed before each generation batch (versions 0 and 1)
    logs = {k: v for entry in trainer.state.log_history for k, v in entry.items()}
    assert logs["sampling/importance_sampling_ratio/max"] == pytest.approx(1.0, abs=1e-3)
    assert logs["sampling/importance_sampling_ratio/min"] == pytest.approx(1.0, abs=1e-3)
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    assert 0.0 <= logs["reward"] <= 1.0 and logs["reward_std"] > 0  # the rewards differ: advantages are not 0


AGENT_SCRIPT = """
import json, os, httpx
prompt = json.loads(os.environ["POSTTRAIN_PROMPT"])
base = os.environ["OPENAI_BASE_URL"]
messages = [{"role": "user", "content": prompt}]
for turn in range(2):
    r = httpx.post(base + "/chat/completions", json={"messages": messages, "max_tokens": 4, "seed": turn}, timeout=60)
    r.raise_for_status()
    messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"] or ""})
    messages.append({"role": "user", "content": "again"})
print("working...")
print(len(messages))
"""


@pytest.fixture(scope="module")
def ascii_url(ascii_model_path):
    with serve_in_thread(PosttrainEngine.from_pretrained(ascii_model_path, device="cpu")) as url:
        yield url


def test_a_subprocess_agent_is_captured_and_its_last_stdout_line_is_the_reward(ascii_url, tmp_path):
    import sys

    script = tmp_path / "agent.py"
    script.write_text(AGENT_SCRIPT)
    func = agent_rollout_func([sys.executable, str(script)], ascii_url, timeout=60)
    out = func(["1+1", "2+2"], None)
    assert out["agent_reward"] == [5.0, 5.0] and out["capture_num_rows"] == [1, 1]
    for c, m, calls in zip(out["completion_ids"], out["env_mask"], func.last_calls):
        assert len(calls) == 2
        assert [t for t, k in zip(c, m) if k] == [t for call in calls for t in call["completions"][0]["token_ids"]]
    with httpx.Client(timeout=30) as http:  # collected: the server forgot them
        assert all(http.get(f"{ascii_url}/v1/rollouts/{r}").status_code == 404 for r in func.last_ids)


def test_agent_failures_are_clear_errors(ascii_url, tmp_path):
    import sys

    with pytest.raises(ValueError, match="made no chat calls under rollout"):
        agent_rollout_func(lambda prompt, base_url, rollout_id: 1.0, ascii_url)(["1+1"], None)
    slow = agent_rollout_func([sys.executable, "-c", "import time; time.sleep(120)"], ascii_url, timeout=1)
    with pytest.raises(TimeoutError, match="ran over timeout=1.0s and was killed"):
        slow(["1+1"], None)
    silent = agent_rollout_func([sys.executable, "-c", "print('no reward here')"], ascii_url, timeout=60)
    with pytest.raises(RuntimeError, match="must print its reward"):
        silent(["1+1"], None)
    with pytest.raises(ValueError, match="needs the server's URL"):
        agent_rollout_func(lambda *a: 0.0)(["1+1"], None)


def test_a_function_agent_over_its_timeout_is_a_timeout_error(ascii_url):
    import threading

    release = threading.Event()

    def stuck(prompt, base_url, rollout_id):
        release.wait(30)
        return 0.0

    try:
        with pytest.raises(TimeoutError, match="ran over timeout=0.5s"):
            agent_rollout_func(stuck, ascii_url, timeout=0.5)(["1+1"], None)
    finally:
        release.set()


def test_an_agent_that_rewrites_its_history_gives_several_rows(ascii_url):
    """The second call drops the first answer (a summarised history): two rows; 'last' trains on the second,
    'error' refuses the rollout."""

    def rewriter(prompt, base_url, rollout_id):
        with httpx.Client(base_url=base_url, timeout=60) as http:
            first = http.post("/chat/completions", json={"messages": [{"role": "user", "content": prompt}],
                                                         "max_tokens": 3, "seed": 1}).json()  # fmt: skip
            summary = f"{prompt} (tried: {len(first['choices'][0]['token_ids'])} tokens)"
            http.post("/chat/completions", json={"messages": [{"role": "user", "content": summary}],
                                                 "max_tokens": 3, "seed": 2}).raise_for_status()  # fmt: skip
        return 1.0

    func = agent_rollout_func(rewriter, ascii_url)
    out = func(["3+4"], None)
    (rows,), (calls,) = func.last_rows, func.last_calls
    assert out["capture_num_rows"] == [2] and [r.calls for r in rows] == [[0], [1]]
    assert out["prompt_ids"] == [calls[1]["prompt_token_ids"]]
    assert out["completion_ids"] == [calls[1]["completions"][0]["token_ids"]] and out["env_mask"] == [[1] * 3]
    with pytest.raises(ValueError, match="gave 2 training rows"):
        agent_rollout_func(rewriter, ascii_url, multi_row="error")(["3+4"], None)
