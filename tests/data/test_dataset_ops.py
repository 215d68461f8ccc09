"""data.dataset_ops.configure_streaming: the one streaming set-up every trainer uses."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from datasets import Dataset

from posttrain.data.dataset_ops import configure_streaming, is_iterable_dataset


def _args(**overrides):
    values = dict(max_steps=3, dataloader_num_workers=0, accelerator_config=SimpleNamespace(dispatch_batches=None))
    return SimpleNamespace(**{**values, **overrides})


def test_map_style_datasets_are_left_alone():
    args = _args(max_steps=-1, dataloader_num_workers=2)
    assert configure_streaming(args, Dataset.from_dict({"text": ["a"]})) is False
    assert configure_streaming(args, None) is False
    assert args.dataloader_num_workers == 2 and args.accelerator_config.dispatch_batches is None


def test_a_stream_needs_max_steps_and_reads_in_the_main_process_without_dispatch():
    stream = Dataset.from_dict({"text": ["a", "b"]}).to_iterable_dataset()
    assert is_iterable_dataset(stream)
    with pytest.raises(ValueError, match="set max_steps to a positive number"):
        configure_streaming(_args(max_steps=-1), stream)
    args = _args(dataloader_num_workers=2)
    with pytest.warns(UserWarning, match="dispatch_batches=False"), pytest.warns(UserWarning, match="num_workers=0"):
        assert configure_streaming(args, stream) is True
    assert args.dataloader_num_workers == 0 and args.accelerator_config.dispatch_batches is False
