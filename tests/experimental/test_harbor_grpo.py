"""GRPO over the example Harbor suite (``examples/harbor_tasks``) in the bubblewrap sandbox: through the built-in
``bash`` harness and through a custom ``HarborEnv`` subclass.

The policy is the scripted tiny model of the agent tests (``tests/agents/agent_helpers.py``): the real tiny model
runs, each assistant turn is forced to a script that reads the task's instruction from the prompt. The tool calls
run in the real sandbox and the rewards are the tasks' verifiers'.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest
from harbor_helpers import EXAMPLE_TASKS, needs_bwrap, solution

from posttrain import GRPOConfig, GRPOTrainer
from posttrain.experimental.harbor import HarborEnv, HarborSpec

_AGENTS = str(Path(__file__).resolve().parents[1] / "agents")
if _AGENTS not in sys.path:
    sys.path.insert(0, _AGENTS)

from agent_helpers import call, last_user, scripted_sampler, tool_responses  # noqa: E402

pytestmark = [needs_bwrap, pytest.mark.usefixtures("sandbox_lock")]

_TASK_BY_OPENING = {
    "Count the lines": "count-errors",
    "The function `mean`": "fix-mean",
    "Create the file": "hello-file",
    "In `/workdir/photos`": "rename-photos",
    "Write `/workdir/config.json`": "write-config",
}


def _task_of(context: str) -> str:
    prompt = last_user(context)
    return next(name for opening, name in _TASK_BY_OPENING.items() if prompt.startswith(opening))


def _config(tmp_path, **overrides):
    values = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2, max_completion_length=192,
        max_steps=2, learning_rate=1e-2, report_to="none", gradient_checkpointing=False, save_strategy="no",
        logging_steps=1, disable_tqdm=True, write_report=False, shuffle_dataset=False,
    )  # fmt: skip
    values.update(overrides)
    return GRPOConfig(**values)


def _use_script(trainer, script):
    sampler, _, scripted = scripted_sampler(script, tokenizer=trainer.processing_class)
    trainer.backend.inner = sampler
    return scripted


def test_grpo_trains_through_the_bash_harness(tiny_model_path, tmp_path):
    spec = HarborSpec(EXAMPLE_TASKS, agent="bash", environment_type="bubblewrap", num_tasks=4)
    solved = {"count-errors", "hello-file"}  # the others get a command that looks around and changes nothing

    def script(context: str) -> str:
        if tool_responses(context):
            return "Done."
        task = _task_of(context)
        command = solution(task) if task in solved else "ls"
        return call("bash", json.dumps({"command": command}))

    trainer = GRPOTrainer(
        tiny_model_path, spec.reward_funcs, _config(tmp_path), train_dataset=spec.train_dataset,
        environment_factory=spec.environment_factory,
    )  # fmt: skip
    assert trainer.reward_func_names == ["_outcome_reward_func"]
    scripted = _use_script(trainer, script)
    trainer.train()
    assert trainer.state.global_step == 2
    first, second = trainer.state.log_history[0], trainer.state.log_history[1]
    # step 1: count-errors (solved) and fix-mean (not); step 2: hello-file (solved) and rename-photos (not)
    assert first["rewards/_outcome_reward_func/mean"] == 0.5 and second["rewards/_outcome_reward_func/mean"] == 0.5
    assert first["tools/call_frequency"] == 1.0 and first["tools/failure_frequency"] == 0.0
    responses = {_task_of(c): tool_responses(c) for c in scripted.contexts if tool_responses(c)}
    assert responses == {
        "count-errors": ["(empty output, rc=0)"],
        "fix-mean": ["stats.py\n"],
        "hello-file": ["(empty output, rc=0)"],
        "rename-photos": ["photos\n"],
    }
    # The prompt is the task's instruction and the harness's guidance (appended by reset).
    prompts = {_task_of(c): last_user(c) for c in scripted.contexts}
    assert prompts["fix-mean"].startswith((EXAMPLE_TASKS / "fix-mean" / "instruction.md").read_text())
    assert "You have one tool, `bash`" in prompts["fix-mean"]


class FilesEnv(HarborEnv):
    """A custom harness: read and write files, nothing else."""

    PROMPT_SUFFIX = "\n\nTools: `read_file` and `write_file` (paths under /workdir)."

    def read_file(self, path: str) -> str:
        """Read a text file.

        Args:
            path: The file's path.
        """
        return self._exec(f"cat {shlex.quote(path)}")

    def write_file(self, path: str, content: str) -> str:
        """Write a text file, replacing its content.

        Args:
            path: The file's path.
            content: The text to write.
        """
        return self._exec(f"printf %s {shlex.quote(content)} > {shlex.quote(path)} && echo ok")


def test_grpo_trains_through_a_custom_harborenv_subclass(tiny_model_path, tmp_path):
    spec = HarborSpec(EXAMPLE_TASKS, agent=FilesEnv, environment_type="bubblewrap", indices=[2, 4])
    answers = {
        "hello-file": ("/workdir/hello.txt", "Hello, Harbor!\n"),
        "write-config": ("/workdir/config.json", '{"port": 8080, "debug": false, "name": "harbor"}'),
    }

    def script(context: str) -> str:
        if tool_responses(context):
            return "Done."
        path, content = answers[_task_of(context)]
        return call("write_file", json.dumps({"path": path, "content": content}))

    trainer = GRPOTrainer(
        tiny_model_path, spec.reward_funcs, _config(tmp_path, max_steps=1), train_dataset=spec.train_dataset,
        environment_factory=spec.environment_factory,
    )  # fmt: skip
    scripted = _use_script(trainer, script)
    trainer.train()
    assert trainer.state.global_step == 1
    assert trainer.state.log_history[0]["rewards/_outcome_reward_func/mean"] == 1.0
    assert {_task_of(c): tool_responses(c) for c in scripted.contexts if tool_responses(c)} == {
        "hello-file": ["ok\n"],
        "write-config": ["ok\n"],
    }
    assert all(last_user(c).endswith(FilesEnv.PROMPT_SUFFIX) for c in scripted.contexts)
