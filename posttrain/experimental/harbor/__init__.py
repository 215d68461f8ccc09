"""Harbor task suites for ``GRPOTrainer``: TRL's ``trl.experimental.harbor`` API, plus a sandbox that needs no Docker.

A Harbor task is a directory (``instruction.md``, ``task.toml``, ``environment/``, ``tests/test.sh``); a suite is a
directory of them. :class:`HarborSpec` turns a suite into the three trainer arguments::

    spec = HarborSpec("examples/harbor_tasks", agent="bash", environment_type="bubblewrap")
    trainer = GRPOTrainer(model, reward_funcs=spec.reward_funcs, args=GRPOConfig(...),
                          train_dataset=spec.train_dataset, environment_factory=spec.environment_factory)

``environment_type="bubblewrap"`` (beyond TRL) runs each task in posttrain's bubblewrap sandbox on the host's
userland (see :mod:`posttrain.experimental.harbor._local` for what is contained and how); other values go to the
``harbor`` package (``pip install harbor``, Python >= 3.12), imported only when used.
"""

from posttrain.experimental.harbor._env import AGENTS, HarborBashEnv, HarborEnv
from posttrain.experimental.harbor._local import BUBBLEWRAP, HarborVerifierError, SandboxLimits
from posttrain.experimental.harbor._spec import HarborSpec
from posttrain.experimental.harbor._task import HarborTask, HarborTaskError, load_task

__all__ = [
    "AGENTS",
    "BUBBLEWRAP",
    "HarborBashEnv",
    "HarborEnv",
    "HarborSpec",
    "HarborTask",
    "HarborTaskError",
    "HarborVerifierError",
    "SandboxLimits",
    "load_task",
]
