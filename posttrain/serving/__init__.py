"""Generation as a service: ``posttrain serve`` (and ``posttrain vllm-serve``).

- ``app``: the FastAPI server (``/v1/completions``, ``/health``, ``/v1/load_weights``, TRL's ``/generate/`` ...),
  ``create_app``, ``run_server``, ``serve_in_thread`` (a ``ServerInThread``: a URL for a ``with`` block, ``stop()``);
- ``chat``: ``POST /v1/chat/completions`` (OpenAI's chat API with token ids and log-probs for agents that run their
  own loop); ``capture``: its capture mode (calls recorded per rollout id, ``GET``/``DELETE /v1/rollouts/<id>``);
- ``engine``: ``PosttrainEngine`` (the group sampler) and the request/sequence types; ``vllm_engine``: vLLM's.

The server stands above the sampler it wraps. The wire's other end, shared with the trainer, lives one layer down in
``posttrain.generation``: ``generation.client`` (``GenerationClient``: httpx, sync and async methods, typed errors) and
``generation.weights`` (which tensors a push sends, PEFT merged; safetensors chunks; loading them). ``serving.client``
and ``serving.weights`` re-export them for the old import paths.

Needs the ``serve`` extra (``pip install posttrain[serve]``: fastapi, uvicorn, httpx). Nothing here is imported by
``import posttrain``.
"""
