"""Print what TrlParser, the dataset mixtures and pack_dataset do on a table of calls, under TRL or posttrain, to diff.

Used to find and check item 5 of issue 35 (the expectations are written into tests/compat/test_trl_parser_compat.py,
tests/data/test_loading.py and tests/data/test_packing.py, which never import trl)::

    benchmarks/.venv-trl/bin/python tests/compat/trl_fixtures/compare_parser_and_data.py trl > /tmp/trl.txt
    PYTHONPATH=. .venv/bin/python tests/compat/trl_fixtures/compare_parser_and_data.py posttrain > /tmp/pt.txt
    diff <(sed 's#/tmp/[^ ]*yaml#CFG#g' /tmp/trl.txt) <(sed 's#/tmp/[^ ]*yaml#CFG#g' /tmp/pt.txt)

Deliberate differences left in the diff: posttrain accepts ``--config=PATH`` and an empty YAML file; its error
messages go on after TRL's phrase with the fix (``ConfigError`` is a ``ValueError``); ``DatasetConfig`` has
``shuffle``/``seed`` (fraction subsets are a seeded random draw unless ``shuffle: false``); streamed mixtures come
back as an ``IterableDatasetDict``; pack_dataset's strategy error names posttrain's extra spelling; TRL crashes
(pyarrow ``array_take``) on a map batch whose rows are all empty, posttrain returns no rows for it.
"""

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from dataclasses import dataclass

from datasets import Dataset

LIB = sys.argv[1]
if LIB == "trl":
    from trl import DatasetMixtureConfig, TrlParser, get_dataset, pack_dataset
    from trl.scripts.utils import DatasetConfig
else:
    from posttrain import DatasetMixtureConfig, TrlParser, get_dataset, pack_dataset
    from posttrain.data.loading import DatasetConfig


@dataclass
class A:
    arg1: int
    arg2: str = "default"
    flag: bool = False
    lst: list[str] | None = None


@dataclass
class B:
    other: float = 1.0


tmp = tempfile.mkdtemp()


def yml(text):
    p = os.path.join(tmp, f"c{abs(hash(text))}.yaml")
    open(p, "w").write(text)
    return p


def norm(x):
    if dataclasses.is_dataclass(x):
        return {"__class__": type(x).__name__, **{k: norm(v) for k, v in vars(x).items()}}
    if isinstance(x, argparse.Namespace):
        return {"__ns__": {k: norm(v) for k, v in sorted(vars(x).items())}}
    if isinstance(x, (list, tuple)):
        return [norm(v) for v in x]
    return x


def run(name, fn):
    try:
        out = norm(fn())
        print(name, "->", json.dumps(out, default=str))
    except SystemExit as e:
        print(name, "-> SystemExit", e.code)
    except BaseException as e:
        print(name, "-> RAISE", type(e).__name__, "|", [c.__name__ for c in type(e).__mro__][:4], "|", str(e)[:300])


def P(*dc, **kw):
    return TrlParser(list(dc), **kw)


run("plain", lambda: P(A).parse_args_and_config(["--arg1", "2"]))
run("config", lambda: P(A).parse_args_and_config(["--config", yml("arg1: 5\narg2: x\n")]))
run("config_override", lambda: P(A).parse_args_and_config(["--arg1", "3", "--config", yml("arg1: 5\narg2: x\n")]))
run("config_eq", lambda: P(A).parse_args_and_config(["--config=" + yml("arg1: 5\n")]))
run(
    "env",
    lambda: (
        P(A).parse_args_and_config(["--config", yml("env:\n  H8_V1: value1\n  H8_V2: 3\narg1: 1\n")]),
        os.environ.get("H8_V1"),
        os.environ.get("H8_V2"),
    ),
)
run("env_bad", lambda: P(A).parse_args_and_config(["--config", yml("env: not_a_dict\narg1: 1\n")]))
run("yaml_list", lambda: P(A).parse_args_and_config(["--config", yml("- 1\n- 2\n")]))
run("yaml_empty", lambda: P(A).parse_args_and_config(["--arg1", "1", "--config", yml("")]))
run(
    "remaining_cli",
    lambda: P(A).parse_args_and_config(["--arg1", "2", "rest", "--zzz", "3"], return_remaining_strings=True),
)
run(
    "remaining_both",
    lambda: P(A).parse_args_and_config(
        ["--arg1", "2", "--in_args", "def", "--config", yml("in_config: abc\nflagy: true\nlisty: [1, 2]\nnum: 3\n")],
        return_remaining_strings=True,
    ),
)
run(
    "remaining_separate",
    lambda: P(A).parse_args_and_config(
        ["--arg1", "2", "--in_args", "def", "--config", yml("in_config: abc\n")],
        return_remaining_strings=True,
        separate_remaining_strings=True,
    ),
)
run(
    "remaining_separate_noconfig",
    lambda: P(A).parse_args_and_config(
        ["--arg1", "2", "--in_args", "def"], return_remaining_strings=True, separate_remaining_strings=True
    ),
)
run("unknown_config_fail", lambda: P(A).parse_args_and_config(["--config", yml("arg1: 1\nnope: 2\n")]))
run(
    "unknown_config_nofail",
    lambda: P(A).parse_args_and_config(["--config", yml("arg1: 1\nnope: 2\n")], fail_with_unknown_args=False),
)
run("unknown_cli_fail", lambda: P(A).parse_args_and_config(["--arg1", "1", "--nope", "2"]))
run(
    "unknown_cli_nofail",
    lambda: P(A).parse_args_and_config(["--arg1", "1", "--nope", "2"], fail_with_unknown_args=False),
)
run("config_field", lambda: P(dataclasses.make_dataclass("Bad", [("config", str)])))
run(
    "two_dc",
    lambda: P(A, B).parse_args_and_config(["--config", yml("arg1: 1\nother: 2.5\nflag: true\nlst: [a, b]\n")]),
)
run(
    "set_defaults",
    lambda: (lambda p: (p.set_defaults_with_config(arg1=42, unknown=1, flag=True), p.parse_args_and_config([])))(P(A)),
)


def sub(cmds=("sub",), parent_dc=()):
    p = TrlParser(list(parent_dc))
    sp = p.add_subparsers(dest="command", parser_class=TrlParser)
    for c in cmds:
        sp.add_parser(c, dataclass_types=[A])
    return p


run("sub_config", lambda: sub().parse_args_and_config(["sub", "--config", yml("arg1: 2\narg2: cv\n")]))
run(
    "sub_override", lambda: sub().parse_args_and_config(["sub", "--arg1", "3", "--config", yml("arg1: 2\narg2: cv\n")])
)
run(
    "sub_wrong_fail",
    lambda: sub().parse_args_and_config(["sub", "--arg1", "3", "--config", yml("arg1: 2\nnot_there: cv\n")]),
)
run(
    "sub_wrong_nofail",
    lambda: sub().parse_args_and_config(
        ["sub", "--arg1", "3", "--config", yml("arg1: 2\nnot_there: cv\n")], fail_with_unknown_args=False
    ),
)
run("sub_multi0", lambda: sub(("s0", "s1")).parse_args_and_config(["s0", "--config", yml("arg1: 2\narg2: cv\n")]))
run("sub_multi1", lambda: sub(("s0", "s1")).parse_args_and_config(["s1", "--config", yml("arg1: 2\narg2: cv\n")]))
run(
    "sub_parent_dc",
    lambda: sub(parent_dc=(B,)).parse_args_and_config(["--other", "3", "sub", "--config", yml("arg1: 2\nother: 4\n")]),
)
run(
    "sub_remaining",
    lambda: sub().parse_args_and_config(["sub", "--arg1", "1", "--zz", "q"], return_remaining_strings=True),
)
run(
    "mixture_yaml",
    lambda: P(DatasetMixtureConfig).parse_args_and_config(
        [
            "--config",
            yml(
                "datasets:\n- path: a/b\n  name: x\n- path: c\n  columns:\n  - prompt\n  fraction: 0.5\nstreaming: true\n"
            ),
        ]
    ),
)

# datasets
d = os.path.join(tmp, "d")
os.makedirs(d, exist_ok=True)
Dataset.from_dict({"text": [f"t{i}" for i in range(6)]}).to_json(os.path.join(d, "a.jsonl"))
Dataset.from_dict({"text": [f"u{i}" for i in range(3)]}).to_json(os.path.join(d, "b.jsonl"))
A_ = dict(path="json", data_files=os.path.join(d, "a.jsonl"))
B_ = dict(path="json", data_files=os.path.join(d, "b.jsonl"))


def mix(*entries, **kw):
    out = get_dataset(DatasetMixtureConfig(datasets=[DatasetConfig(**e) for e in entries], **kw))
    return {k: (type(out).__name__, type(v).__name__, list(v)) for k, v in out.items()}


run("mix_empty", lambda: mix())
run("mix_partial", lambda: mix(dict(A_, fraction=0.5), B_))
run("mix_stream_fraction", lambda: mix(dict(A_, fraction=0.5), dict(B_, fraction=0.5), streaming=True))
run("mix_partial_stream", lambda: mix(dict(A_, fraction=0.5), B_, streaming=True))
run("mix_fraction_zero", lambda: mix(dict(A_, fraction=1.0), dict(B_, fraction=0.0)))
run("mix_fraction_first_rows", lambda: mix(dict(A_, fraction=0.5), dict(B_, fraction=0.5)))
run("mix_stream", lambda: mix(A_, B_, streaming=True))
run("mix_plain", lambda: mix(A_, B_))

# pack_dataset

rows = {
    "input_ids": [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10], [11], [12, 13, 14, 15, 16, 17, 18]],
    "labels": [[-100, 2, 3, 4, 5], [-100, 7], [8, 9, 10], [11], [12, 13, 14, 15, 16, 17, 18]],
    "attention_mask": [[1, 1, 1, 1, 1], [1, 1], [1, 1, 1], [1], [1] * 7],
}


def show(name, ds):
    try:
        out = ds()
        kind = type(out).__name__
        items = list(out)
        feats = None
        try:
            feats = {k: str(v) for k, v in out.features.items()} if out.features else None
        except Exception as e:
            feats = repr(e)
        fmt = getattr(out, "format", None) if kind == "Dataset" else getattr(out, "_formatting", None)
        fmt = (
            str(fmt.format_type)
            if (kind != "Dataset" and fmt is not None)
            else (fmt if fmt is None else {k: v for k, v in fmt.items() if k != "format_kwargs"})
        )
        cols = out.column_names
        print(name, kind, "cols", cols, "fmt", fmt)
        print("   feats", feats)
        print(
            "   rows",
            json.dumps([{k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in r.items()} for r in items]),
        )
    except Exception as e:
        print(name, "RAISE", type(e).__name__, str(e)[:200])


def it(d=rows, **kw):
    ds = Dataset.from_dict(d)
    return ds.to_iterable_dataset(**kw)


for strat in ("bfd", "bfd_split", "wrapped"):
    show(f"map_{strat}", lambda strat=strat: pack_dataset(Dataset.from_dict(rows), 4, strat))
    show(f"iter_{strat}", lambda strat=strat: pack_dataset(it(), 4, strat))
    show(f"iter_shards_{strat}", lambda strat=strat: pack_dataset(it(num_shards=2), 4, strat))
    show(f"iter_torch_{strat}", lambda strat=strat: pack_dataset(it().with_format("torch"), 4, strat))
    show(
        f"map_torch_{strat}", lambda strat=strat: pack_dataset(Dataset.from_dict(rows).with_format("torch"), 4, strat)
    )
    show(
        f"map_cols_{strat}",
        lambda strat=strat: pack_dataset(Dataset.from_dict(rows).with_format(columns=["input_ids"]), 4, strat),
    )
show("iter_bs2", lambda: pack_dataset(it(), 4, "bfd", map_kwargs={"batch_size": 2}))
show("map_bs2", lambda: pack_dataset(Dataset.from_dict(rows), 4, "bfd", map_kwargs={"batch_size": 2}))
show("bad", lambda: pack_dataset(Dataset.from_dict(rows), 4, "nope"))
show("iter_only_ids", lambda: pack_dataset(it({"input_ids": rows["input_ids"]}), 4, "bfd"))
