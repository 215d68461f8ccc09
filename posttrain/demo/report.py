"""The single report page of ``posttrain demo``: both stages' curves side by side, the before/after table and the
same held-out prompts answered after SFT and after GRPO, in one self-contained HTML file (``output_dir/report.html``).
"""

from __future__ import annotations

import base64
import html
import io
import os
import tempfile

from posttrain.report.plots import series
from posttrain.report.writer import read_metrics

# (stage folder, column title, [(panel title, y label, [(metric key, legend label)])])
STAGE_PANELS = [
    (
        "sft",
        "Stage 1 · SFT on the sloppy teacher's traces",
        [
            ("Training loss", "cross-entropy (nats/token)", [("loss", "loss")]),
            ("Token accuracy", "fraction of completion tokens", [("mean_token_accuracy", "mean token accuracy")]),
        ],
    ),
    (
        "grpo",
        "Stage 2 · GRPO with a math verifier",
        [
            ("Reward on training prompts", "mean verifier reward", [("reward", "mean reward")]),
            (
                "Groups with no learning signal",
                "fraction of prompts",
                [("frac_reward_zero_std", "all 8 samples scored the same")],
            ),
        ],
    ),
]

CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;margin:0;color:#1f2328;background:#f6f8fa}
main{max-width:1180px;margin:0 auto;padding:28px 32px 48px;background:#fff;min-height:100vh}
h1{font-size:26px;margin:0 0 4px}h2{font-size:19px;margin:34px 0 10px;border-bottom:1px solid #e5e7eb;padding-bottom:6px}
.sub{color:#57606a;margin:0 0 18px;font-size:14px;line-height:1.5}
.verdict{border-radius:8px;padding:14px 18px;font-size:15px;line-height:1.55;margin:14px 0}
.good{background:#e8f6ec;border:1px solid #9bd3ac}.meh{background:#fff8e1;border:1px solid #f0d48a}
.bad{background:#fdecec;border:1px solid #f1a7a7}
.task{background:#f6f8fa;border:1px solid #e5e7eb;border-radius:8px;padding:12px 16px;font-size:14px;line-height:1.55}
code,.mono{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:13px}
table{border-collapse:collapse;font-size:14px;margin:8px 0;width:100%}
td,th{border-bottom:1px solid #e5e7eb;padding:6px 10px;text-align:left;vertical-align:top}
th{background:#f6f8fa;font-weight:600}td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
tr.key td{font-weight:600;background:#fbfdff}
.pos{color:#1a7f37}.neg{color:#cf222e}
.stages{display:grid;grid-template-columns:1fr 1fr;gap:18px}
.stage h3{font-size:15px;margin:6px 0 8px;color:#24292f}
.stage img{width:100%;border:1px solid #e5e7eb;border-radius:6px;margin-bottom:10px}
.ok{color:#1a7f37;font-weight:700}.no{color:#cf222e;font-weight:700}
td.comp{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12.5px;white-space:pre-wrap}
.note{color:#57606a;font-size:13px}
"""


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return base64.b64encode(buf.getvalue()).decode()


def _stage_plots(output_dir: str, stage_panels: list = STAGE_PANELS) -> list[tuple[str, list[tuple[str, str]]]]:
    """[(column title, [(panel title, base64 PNG)])] for the two stages, from their ``metrics.jsonl``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = []
    for folder, column_title, panels in stage_panels:
        records = read_metrics(os.path.join(output_dir, folder))
        images = []
        for title, ylabel, keys in panels:
            drawn = [(series(records, key), label) for key, label in keys if series(records, key)[0]]
            if not drawn:
                continue
            fig, ax = plt.subplots(figsize=(5.6, 3.0), dpi=110)
            for (xs, ys), label in drawn:
                ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, linewidth=1.6, label=label)
            ax.set_title(title, fontsize=11)
            ax.set_xlabel("training step")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8, loc="best")
            fig.tight_layout()
            images.append((title, _png(fig)))
            plt.close(fig)
        columns.append((column_title, images))
    return columns


def _fmt(mean: float, se: float, tokens: bool = False) -> str:
    return f"{mean:.1f}" if tokens else f"{mean:.3f} <span class='note'>± {se:.3f}</span>"


def _metrics_table(after_sft, after_grpo, summary: dict) -> str:
    m_sft, m_grpo = after_sft.metrics(), after_grpo.metrics()
    gains = summary.get("gains", {})
    rows = [
        "<table><tr><th>held-out metric</th><th>after SFT</th><th>after GRPO</th><th>change (paired ± s.e.)</th></tr>"
    ]
    for name in m_sft:
        tokens = "tokens" in name
        gain = gains.get(name)
        change = ""
        if gain:
            se = gain["standard_error"]
            cls = "pos" if gain["mean"] > 2 * se else "neg" if gain["mean"] < -2 * se else ""
            change = f"<span class='{cls}'>{gain['mean']:+.3f}</span> <span class='note'>± {gain['standard_error']:.3f}</span>"
        key = " class='key'" if name.startswith("greedy: right answer") else ""
        rows.append(
            f"<tr{key}><td>{html.escape(name)}</td><td class='num'>{_fmt(*m_sft[name], tokens)}</td>"
            f"<td class='num'>{_fmt(*m_grpo[name], tokens)}</td><td class='num'>{change}</td></tr>"
        )
    rows.append("</table>")
    return "".join(rows)


def _completions_table(after_sft, after_grpo, limit: int) -> str:
    from posttrain.demo.evaluate import stated_number

    rows = [
        "<table><tr><th>held-out prompt</th><th>answer</th><th>after SFT (greedy)</th><th>after GRPO (greedy)</th></tr>"
    ]
    for i in range(min(limit, len(after_sft.prompts))):
        cells = []
        for result in (after_sft, after_grpo):
            text = result.greedy_text[i]
            right = stated_number(text) == result.answers[i]
            mark = "<span class='ok'>✓</span>" if right else "<span class='no'>✗</span>"
            cells.append(f"<td class='comp'>{mark} {html.escape(text)}</td>")
        carry = " <span class='note'>(carry)</span>" if after_sft.carries[i] else ""
        rows.append(
            f"<tr><td>{html.escape(after_sft.prompts[i])}{carry}</td><td class='num'>{after_sft.answers[i]}</td>"
            + "".join(cells)
            + "</tr>"
        )
    rows.append("</table>")
    return "".join(rows)


def write_demo_report(output_dir: str, summary: dict, after_sft, after_grpo, *, num_completions: int = 14) -> str:
    """Write ``output_dir/report.html`` and return its path.

    Args:
        output_dir: The demo's output folder (holds ``sft/`` and ``grpo/`` with their ``metrics.jsonl``).
        summary: The demo summary (``posttrain.demo.run``): verdict, gains, timings, seed.
        after_sft / after_grpo: ``posttrain.demo.evaluate.EvalResult`` of the two stages on the same problems.
        num_completions: How many held-out prompts (the first ones, in order) to show answered by both models.
    """
    from posttrain.demo.tasks import FORGET_CARRY

    gain = summary.get("greedy_gain", 0.0)
    gain_se = summary.get("gains", {}).get("greedy: right answer, any format", {}).get("standard_error", 0.0)
    verdict_cls = "good" if gain > 2 * gain_se and gain > 0 else "meh" if gain > 0 else "bad"
    fixed = sum(1 for a, b in zip(after_sft.greedy_any_format, after_grpo.greedy_any_format) if b > a)
    broken = sum(1 for a, b in zip(after_sft.greedy_any_format, after_grpo.greedy_any_format) if b < a)
    timings = summary.get("timings", {})
    n = len(after_sft.prompts)
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><meta name='viewport' content='width=device-width'>",
        "<title>posttrain demo report</title>",
        f"<style>{CSS}</style></head><body><main>",
        "<h1>posttrain demo: SFT, then GRPO with a verifier</h1>",
        f"<p class='sub'>seed {summary.get('seed')} · {summary.get('mode')} run · {n} held-out problems × "
        f"{after_sft.num_samples} samples · {timings.get('total_wall_s', 0):.0f} s wall, "
        f"{timings.get('total_cpu_s', 0):.0f} s CPU ({summary.get('torch_threads', '?')} torch threads)</p>",
        "<div class='task'><b>The task.</b> Two-digit addition with a worked trace, e.g. <code>What is 47 + 85?</code>"
        " → <code>&lt;think&gt;7+5=12 4+8+1=13&lt;/think&gt; \\boxed{132}</code>. The SFT traces come from a "
        f"<i>sloppy teacher</i> that forgets the carry {FORGET_CARRY:.0%} of the time (<code>4+8=12</code> → "
        "<code>\\boxed{122}</code>); all of its answers are boxed, so the answer format is never the problem. "
        "Imitation learns the teacher's habit; GRPO samples 8 answers per training problem, a math verifier rewards "
        "the right ones, and the model learns to remember the carry. Held-out problems use operand pairs that never "
        "appear in training, in either order.</div>",
        f"<div class='verdict {verdict_cls}'>{html.escape(summary.get('verdict', '')).replace(chr(10), '<br>')}</div>",
        "<h2>Before and after, on held-out problems</h2>",
        _metrics_table(after_sft, after_grpo, summary),
        "<p class='note'>“verified” = <code>accuracy_reward</code>, the verifier GRPO trains on (reads "
        "<code>\\boxed{}</code>); “right answer, any format” = the last number stated after the reasoning, boxed or "
        "not. Standard errors are over problems; changes are paired (same problems, same sampling seed).</p>",
        *_curves_section(output_dir, STAGE_PANELS),
    ]
    parts.append(
        f"<h2>The same held-out prompts, after SFT and after GRPO</h2><p class='note'>The first {min(num_completions, n)}"
        f" held-out problems in order (not selected). Over all {n}: GRPO fixed {fixed} greedy answers and broke "
        f"{broken}.</p>"
    )
    parts.append(_completions_table(after_sft, after_grpo, num_completions))
    parts.append(
        f"<h2>Details</h2><p class='note'>{_stage_links(output_dir)}<br>Timings: {html.escape(_timing_text(timings))}.<br>"
        "Recipes: <code>examples/demo/sft.yaml</code>, <code>examples/demo/grpo.yaml</code>; data in "
        "<code>data/</code>; numbers in <code>summary.json</code>.</p>"
    )
    return _write_page(output_dir, parts)


def _stage_links(output_dir: str) -> str:
    return " · ".join(
        f"<a href='{stage}/report/index.html'>{stage.upper()} stage report</a>"
        for stage in ("sft", "grpo")
        if os.path.exists(os.path.join(output_dir, stage, "report", "index.html"))
    )


def _timing_text(timings: dict) -> str:
    return " · ".join(
        f"{label} {timings[f'{key}_wall_s']:.0f} s wall"
        + (f" / {timings[f'{key}_cpu_s']:.0f} s CPU" if f"{key}_cpu_s" in timings else "")
        for key, label in (
            ("sft", "SFT"),
            ("grpo", "GRPO"),
            ("eval_sft", "eval after SFT"),
            ("eval_grpo", "eval after GRPO"),
            ("total", "total"),
        )
        if f"{key}_wall_s" in timings
    )


def _curves_section(output_dir: str, stage_panels: list) -> list[str]:
    parts = ["<h2>Training curves</h2><div class='stages'>"]
    for column_title, images in _stage_plots(output_dir, stage_panels):
        parts.append(f"<div class='stage'><h3>{html.escape(column_title)}</h3>")
        parts += [f"<img alt='{html.escape(t)}' src='data:image/png;base64,{data}'>" for t, data in images]
        if not images:
            parts.append("<p class='note'>No metrics were logged.</p>")
        parts.append("</div>")
    parts.append("</div>")
    return parts


def _write_page(output_dir: str, parts: list[str]) -> str:
    """Write the page atomically to ``output_dir/report.html`` and return its path."""
    parts = [*parts, "</main></body></html>"]
    path = os.path.join(output_dir, "report.html")
    fd, tmp = tempfile.mkstemp(dir=output_dir, prefix=".report-", suffix=".html")
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(parts))
    os.replace(tmp, path)
    return path


# the agent demo's curves: (stage folder, column title, [(panel title, y label, [(metric key, legend label)])])
AGENT_STAGE_PANELS = [
    (
        "sft",
        "Stage 1 · SFT on the lazy teacher's traces",
        [
            ("Training loss", "cross-entropy (nats/token)", [("loss", "loss")]),
            ("Token accuracy", "fraction of assistant tokens", [("mean_token_accuracy", "mean token accuracy")]),
        ],
    ),
    (
        "grpo",
        "Stage 2 · GRPO with a calculator environment per rollout",
        [
            ("Reward on training prompts", "verified answers", [("reward", "mean reward")]),
            ("Tool use on training prompts", "calls per rollout", [("tools/call_frequency", "calculator calls")]),
        ],
    ),
]


def _agent_metrics_table(after_sft, after_grpo, summary: dict) -> str:
    m_sft, m_grpo = after_sft.metrics(), after_grpo.metrics()
    gains = summary.get("gains", {})
    rows = [
        "<table><tr><th>held-out metric</th><th>after SFT</th><th>after GRPO</th><th>change (paired ± s.e.)</th></tr>"
    ]
    for name in m_sft:
        plain = "tokens" in name or name.startswith("sampled:")  # ratios over samples: no per-problem s.e.
        gain = gains.get(name)
        change = ""
        if gain:
            se = gain["standard_error"]
            cls = "pos" if gain["mean"] > 2 * se else "neg" if gain["mean"] < -2 * se else ""
            change = f"<span class='{cls}'>{gain['mean']:+.3f}</span> <span class='note'>± {se:.3f}</span>"
        key = " class='key'" if name.startswith("greedy: success") or name == "greedy: tool-use rate" else ""
        cells = [
            (f"{m[name][0]:.1f}" if "tokens" in name else f"{m[name][0]:.3f}") if plain else _fmt(*m[name])
            for m in (m_sft, m_grpo)
        ]
        rows.append(
            f"<tr{key}><td>{html.escape(name)}</td><td class='num'>{cells[0]}</td><td class='num'>{cells[1]}</td>"
            f"<td class='num'>{change}</td></tr>"
        )
    rows.append("</table>")
    return "".join(rows)


def _transcripts_table(after_sft, after_grpo, limit: int) -> str:
    rows = [
        "<table><tr><th>held-out prompt</th><th>answer</th><th>after SFT (greedy)</th><th>after GRPO (greedy)</th>"
        "<th>after SFT (a sample)</th><th>after GRPO (a sample)</th></tr>"
    ]
    for i in range(min(limit, len(after_sft.prompts))):
        cells = []
        for texts, ok in (
            (after_sft.greedy_transcripts, after_sft.greedy_success),
            (after_grpo.greedy_transcripts, after_grpo.greedy_success),
            (after_sft.sampled_transcripts, after_sft.sampled_transcript_success),
            (after_grpo.sampled_transcripts, after_grpo.sampled_transcript_success),
        ):
            right = ok[i] > 0
            mark = "<span class='ok'>✓</span>" if right else "<span class='no'>✗</span>"
            cells.append(f"<td class='comp'>{mark} {html.escape(texts[i])}</td>")
        rows.append(
            f"<tr><td>{html.escape(after_sft.prompts[i])}</td><td class='num'>{after_sft.answers[i]}</td>"
            + "".join(cells)
            + "</tr>"
        )
    rows.append("</table>")
    return "".join(rows)


def write_agent_report(output_dir: str, summary: dict, after_sft, after_grpo, *, num_transcripts: int = 12) -> str:
    """Write the agent demo's ``output_dir/report.html`` and return its path.

    Args:
        output_dir: The demo's output folder (holds ``sft/`` and ``grpo/`` with their ``metrics.jsonl``).
        summary: The agent demo summary (``posttrain.demo.agent``): verdict, gains, timings, seed.
        after_sft / after_grpo: ``posttrain.demo.agent_evaluate.AgentEvalResult`` of the two stages.
        num_transcripts: How many held-out prompts (the first ones, in order) to show as transcripts.
    """
    from posttrain.demo.agent_task import TOOL_RATE

    gain = summary.get("success_gain", 0.0)
    gain_se = summary.get("gains", {}).get("greedy: success (verified answer)", {}).get("standard_error", 0.0)
    verdict_cls = "good" if gain > 2 * gain_se and gain > 0 else "meh" if gain > 0 else "bad"
    fixed = sum(1 for a, b in zip(after_sft.greedy_success, after_grpo.greedy_success) if b > a)
    broken = sum(1 for a, b in zip(after_sft.greedy_success, after_grpo.greedy_success) if b < a)
    timings = summary.get("timings", {})
    n = len(after_sft.prompts)
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><meta name='viewport' content='width=device-width'>",
        "<title>posttrain agent demo report</title>",
        f"<style>{CSS}</style></head><body><main>",
        "<h1>posttrain demo --task agent: an agent learns to use its calculator</h1>",
        f"<p class='sub'>seed {summary.get('seed')} · {summary.get('mode')} run · {n} held-out problems × "
        f"{after_sft.num_samples} samples · {timings.get('total_wall_s', 0):.0f} s wall, "
        f"{timings.get('total_cpu_s', 0):.0f} s CPU ({summary.get('torch_threads', '?')} torch threads)</p>",
        "<div class='task'><b>The task.</b> Three-digit multiplication, e.g. <code>What is 347 * 826?</code>, with a "
        "calculator tool: <code>calculate()</code>, a method of <code>CalculatorEnv</code>, the environment GRPO "
        "builds once per rollout (<code>environment_factory</code>) and resets with the rollout's problem, so the call "
        "takes no arguments. A tiny model cannot multiply in its head but can copy the tool's answer: "
        '<code>&lt;tool_call&gt;{"name": "calculate", "arguments": {}}&lt;/tool_call&gt;</code> → '
        "<code>286622</code> → <code>\\boxed{286622}</code>. The SFT traces come from a "
        f"<i>lazy teacher</i> that calls the calculator only {TOOL_RATE:.0%} of the time and otherwise boxes its "
        "estimate (both factors rounded to tens). GRPO samples 8 rollouts per training problem and rewards verified "
        "answers (the product checked against the rollout's environment); the rollouts that used the tool win. "
        "Held-out problems use factor pairs that never appear in training, in either order.</div>",
        f"<div class='verdict {verdict_cls}'>{html.escape(summary.get('verdict', '')).replace(chr(10), '<br>')}</div>",
        "<h2>Before and after, on held-out problems</h2>",
        _agent_metrics_table(after_sft, after_grpo, summary),
        "<p class='note'>“success” = the boxed final answer is the exact product; “tool-use rate” = the rollout "
        "called the calculator. Standard errors are over problems; changes are paired (same problems, same sampling "
        "seed). The two “sampled:” rows pool all samples.</p>",
        *_curves_section(output_dir, AGENT_STAGE_PANELS),
        f"<h2>Transcripts: the same held-out prompts, after SFT and after GRPO</h2><p class='note'>The first "
        f"{min(num_transcripts, n)} held-out problems in order (not selected); → a tool call, ← the tool's answer. "
        f"Over all {n}: GRPO fixed {fixed} greedy answers and broke {broken}.</p>",
        _transcripts_table(after_sft, after_grpo, num_transcripts),
        f"<h2>Details</h2><p class='note'>{_stage_links(output_dir)}<br>Timings: {html.escape(_timing_text(timings))}."
        "<br>Recipes: <code>posttrain/demo/recipes/agent_sft.yaml</code>, "
        "<code>posttrain/demo/recipes/agent_grpo.yaml</code>; data in <code>data/</code>; numbers in "
        "<code>summary.json</code>.</p>",
    ]
    return _write_page(output_dir, parts)
