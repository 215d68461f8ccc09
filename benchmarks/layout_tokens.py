"""Tokens posttrain's shared-prompt layout pushes through the model in a GRPO benchmark run, against the plain rows.

Wraps ``plan_shared_prompt_layout`` (every plan ``choose_shared_prompt_layout`` considers: one pack per micro-batch
and one pack per group) around an ordinary ``python -m benchmarks run`` and prints, per plan, the micro-batch's rows,
distinct prompts and their tokens, completion tokens, the packs' lengths and the plan's cost ratio (the lowest is
used). It is how ``sweep.py``'s GRPO FLOP count (the prompts' common prefix once, each group's rest) was checked::

    python benchmarks/layout_tokens.py run --config grpo_long --model tiny --steps 1 --warmup 0 --threads 1
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str]) -> list[dict[str, Any]]:
    import posttrain.models.completion_scoring as scoring
    from benchmarks.__main__ import main as bench_main

    plans: list[dict[str, Any]] = []
    plan_layout = scoring.plan_shared_prompt_layout

    def recording(rows, **kwargs):
        plan = plan_layout(rows, **kwargs)
        if plan is not None:
            distinct = set(rows.prompts)
            plans.append(
                {
                    "rows": len(rows.prompts),
                    "distinct_prompts": len(distinct),
                    "distinct_prompt_tokens": sum(len(p) for p in distinct),
                    "completion_tokens": sum(len(c) for c in rows.completions),
                    "max_pack_tokens": kwargs.get("max_pack_tokens"),
                    "pack_lengths": plan.pack_lengths,
                }
            )
        return plan

    scoring.plan_shared_prompt_layout = recording
    try:
        bench_main(argv)
    finally:
        scoring.plan_shared_prompt_layout = plan_layout
    for plan in plans:
        print("LAYOUT", plan)
    return plans


if __name__ == "__main__":
    main(sys.argv[1:])
