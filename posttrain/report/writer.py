"""Assemble the HTML report from ``metrics.jsonl``, ``run_config.json``, the environment and completions."""

from __future__ import annotations

import base64
import glob
import html
import json
import os
import tempfile

from posttrain.report.plots import guess_trainer, plot_panels

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "run_config.json"


def read_metrics(output_dir: str) -> list[dict]:
    """Metric records logged during training (one dict per log call); [] when there are none."""
    path = os.path.join(output_dir, METRICS_FILE)
    if not os.path.exists(path):
        return []
    records = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a line cut by a crash; the rest is still useful
    return records


def _completion_sample(output_dir: str, limit: int = 12) -> list[dict]:
    files = sorted(glob.glob(os.path.join(output_dir, "completions", "*.parquet")))
    if not files:
        return []
    try:
        import pandas as pd

        frame = pd.read_parquet(files[-1])
    except Exception:  # pragma: no cover - pandas/pyarrow missing or unreadable file
        return []
    return frame.head(limit).to_dict("records")


def _table(rows: list[dict]) -> str:
    if not rows:
        return "<p>No completions were logged (set <code>log_completions=True</code>).</p>"
    cols = list(rows[0])
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(r.get(c)))}</td>" for c in cols) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _summary(records: list[dict]) -> list[tuple[str, str, str]]:
    """(metric, first, last) for the headline scalars."""
    keys = [
        "loss",
        "reward",
        "mean_token_accuracy",
        "rewards/accuracies",
        "accuracy",
        "kl",
        "entropy",
        "completions/mean_length",
        "eval_loss",
        "eval_reward",
    ]
    out = []
    for key in keys:
        values = [r[key] for r in records if isinstance(r.get(key), (int, float))]
        if values:
            out.append((key, _fmt(values[0]), _fmt(values[-1])))
    return out


def write_report(output_dir: str, *, title: str | None = None, trainer: str | None = None) -> str:
    """Write ``output_dir/report/index.html`` (+ PNGs) and return its path."""
    records = read_metrics(output_dir)
    trainer = trainer or guess_trainer(k for r in records for k in r)
    report_dir = os.path.join(output_dir, "report")
    plots = plot_panels(records, trainer, report_dir)
    config = {}
    cfg_path = os.path.join(output_dir, CONFIG_FILE)
    if os.path.exists(cfg_path):
        with open(cfg_path) as f:
            config = json.load(f)
    try:
        from posttrain.env_info import collect_env

        env = collect_env()
    except Exception:  # pragma: no cover - never fail a report on environment probing
        env = {}
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>{html.escape(title or 'posttrain report')}</title>",
        "<style>body{font-family:system-ui,sans-serif;margin:2em;max-width:1300px;color:#222}"
        "h1{margin-bottom:0}.sub{color:#666;margin-top:.3em}"
        ".grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(560px,1fr));gap:1em}"
        "img{width:100%;border:1px solid #ddd;border-radius:4px}"
        "table{border-collapse:collapse;font-size:13px;margin:.5em 0}"
        "td,th{border:1px solid #ddd;padding:4px 8px;text-align:left;vertical-align:top;max-width:420px;"
        "white-space:pre-wrap;word-break:break-word}th{background:#f4f4f4}"
        "details{margin:1em 0}</style></head><body>",
        f"<h1>{html.escape(title or 'posttrain training report')}</h1>",
        f"<p class='sub'>trainer: <b>{html.escape(trainer)}</b> · output: <code>{html.escape(output_dir)}</code>"
        f" · {len(records)} log records</p>",
    ]
    summary = _summary(records)
    if summary:
        parts.append("<h2>Summary</h2><table><tr><th>metric</th><th>first</th><th>last</th></tr>")
        parts += [f"<tr><td>{html.escape(k)}</td><td>{a}</td><td>{b}</td></tr>" for k, a, b in summary]
        parts.append("</table>")
    parts.append("<h2>Curves</h2>")
    if plots:
        parts.append("<div class='grid'>")
        for plot_title, path in plots:
            with open(path, "rb") as f:
                data = base64.b64encode(f.read()).decode()
            parts.append(f"<figure><img alt='{html.escape(plot_title)}' src='data:image/png;base64,{data}'></figure>")
        parts.append("</div>")
    else:
        parts.append("<p>No metrics were logged yet.</p>")
    parts.append("<h2>Sample completions</h2>" + _table(_completion_sample(output_dir)))
    parts.append(
        "<details><summary>Configuration</summary><pre>"
        + html.escape(json.dumps(config, indent=2, default=str))
        + "</pre></details>"
    )
    parts.append(
        "<details><summary>Environment</summary><pre>"
        + html.escape("\n".join(f"{k}: {v}" for k, v in env.items()))
        + "</pre></details>"
    )
    parts.append("</body></html>")
    os.makedirs(report_dir, exist_ok=True)
    index = os.path.join(report_dir, "index.html")
    fd, tmp = tempfile.mkstemp(dir=report_dir, prefix=".index-", suffix=".html")
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(parts))
    os.replace(tmp, index)
    return index
