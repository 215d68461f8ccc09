"""Fixtures for the generation-server tests: a tiny model served over loopback in a background thread.

Every server here binds 127.0.0.1 on a free port and is stopped when its fixture or ``with`` block ends (threads are
joined; subprocesses are killed and waited for)."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    from posttrain.serving.engine import PosttrainEngine

    return PosttrainEngine.from_pretrained(tiny_model_path, device="cpu", served_model_name="tiny")


@pytest.fixture(scope="module")
def server_url(engine):
    from posttrain.serving.app import serve_in_thread

    with serve_in_thread(engine) as url:
        yield url


@pytest.fixture()
def client(server_url):
    from posttrain.generation.client import GenerationClient

    with GenerationClient(server_url, request_timeout=60) as c:
        yield c
