"""Training reports: metrics JSON lines → PNG plots and a self-contained HTML page.

Every posttrain trainer appends its logged metrics to ``output_dir/metrics.jsonl``; at the end of training (or on
demand with ``posttrain report OUTPUT_DIR``) :func:`write_report` draws the key curves for the trainer that produced
them and writes ``output_dir/report/index.html`` with the plots, the config, the environment and a sample of
completions.
"""

from posttrain.report.writer import read_metrics, write_report

__all__ = ["read_metrics", "write_report"]
