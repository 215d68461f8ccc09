"""GRPO on a Harbor task suite in posttrain's bubblewrap sandbox: no Docker, no cloud sandbox, no credentials.

TRL's ``trl.experimental.harbor`` pattern: one ``HarborSpec`` gives ``train_dataset`` (one row per task directory),
``environment_factory`` (one sandboxed task per rollout; the harness's methods are the tools) and ``reward_funcs``
(each task's verifier, ``tests/test.sh``, run once after the rollout). ``environment_type="bubblewrap"`` runs the
tasks on this host's userland inside bubblewrap (``apt-get install bubblewrap libseccomp2`` and
``pip install "posttrain[sandbox]"``).

Without ``--model`` it trains posttrain's offline tiny model (random weights: the run shows the plumbing, not
learning); pass a tool-calling chat model (e.g. ``--model Qwen/Qwen3-0.6B``) for a real run. ``--agent`` picks the
harness: ``bash`` or e.g. ``examples/harbor_harnesses.py:TerminalNotesEnv``.

    python examples/harbor_grpo.py --max-steps 2
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from posttrain import GRPOConfig, GRPOTrainer

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model id or path (default: the offline tiny model)")
    parser.add_argument("--tasks", default=str(HERE / "harbor_tasks"), help="a directory of Harbor tasks")
    parser.add_argument("--agent", default="bash", help="harness: 'bash', 'module:Class' or 'file.py:Class'")
    parser.add_argument("--max-steps", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from posttrain.experimental.harbor import HarborSpec

    spec = HarborSpec(args.tasks, agent=args.agent, environment_type="bubblewrap")
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from posttrain.models.tiny import save_tiny_model

            model = save_tiny_model(Path(tmp) / "tiny", arch="qwen2")
        config = GRPOConfig(
            output_dir=str(Path(tmp) / "out"), per_device_train_batch_size=4, num_generations=2,
            max_completion_length=128, max_steps=args.max_steps, max_tool_calling_iterations=8, logging_steps=1,
            report_to="none", save_strategy="no", chat_template_kwargs={"enable_thinking": False},
        )  # fmt: skip
        trainer = GRPOTrainer(
            model, spec.reward_funcs, config, train_dataset=spec.train_dataset,
            environment_factory=spec.environment_factory,
        )  # fmt: skip
        trainer.train()
        for log in trainer.state.log_history:
            if "rewards/_outcome_reward_func/mean" in log:
                print(f"step {log['step']}: verifier reward {log['rewards/_outcome_reward_func/mean']:.2f}")


if __name__ == "__main__":
    main()
