"""``posttrain rloo``: REINFORCE Leave-One-Out with ``RLOOTrainer`` (TRL's ``trl rloo`` script).

Rewards are given as for ``posttrain grpo``: ``--reward_funcs`` names / dotted paths and/or
``--reward_model_name_or_path``.

Examples:
    posttrain rloo --model_name_or_path Qwen/Qwen2.5-0.5B --dataset_name trl-lib/DeepMath-103K \\
        --reward_funcs accuracy_reward
    posttrain rloo --config examples/rloo.yaml --num_processes 4
    python -m posttrain.scripts.rloo --config examples/rloo.yaml      # the worker entry point, always one process
"""

from __future__ import annotations

import sys

from posttrain.cli.configs import RLOOScriptArguments
from posttrain.scripts.grpo import reward_script

make_parser, main, cli = reward_script("rloo", RLOOScriptArguments, "RLOO", __doc__)

if __name__ == "__main__":
    from posttrain.cli.run import run_script

    sys.exit(run_script("rloo"))
