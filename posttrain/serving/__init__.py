"""Generation as a service: ``posttrain serve`` (and ``posttrain vllm-serve``), its client, and weight transfer.

- ``app``: the FastAPI server (``/v1/completions``, ``/health``, ``/v1/load_weights``, TRL's ``/generate/`` ...),
  ``create_app``, ``run_server``, ``serve_in_thread``;
- ``engine``: ``PosttrainEngine`` (the group sampler) and the request/sequence types; ``vllm_engine``: vLLM's;
- ``client``: ``GenerationClient`` (httpx; sync and async methods; typed errors);
- ``weights``: which tensors a push sends (PEFT merged), safetensors chunks, loading them.

Needs the ``serve`` extra (``pip install posttrain[serve]``: fastapi, uvicorn, httpx). Nothing here is imported by
``import posttrain``.
"""
