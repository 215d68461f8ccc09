"""vLLM worker extension used by ``VLLMEngine`` (``worker_extension_cls``): weight loading inside each worker.

- ``posttrain_load_safetensors(data)``: the CPU-portable path of ``/v1/load_weights`` (safetensors bytes,
  deserialised in the worker and passed to the model's ``load_weights``, which shards them for tensor parallelism);
- ``init_communicator`` / ``update_named_param`` / ``close_communicator``: TRL's ``trl vllm-serve`` NCCL protocol
  (the trainer joins a ``StatelessProcessGroup`` as the last rank and broadcasts each tensor).

GPU only; **not verified on hardware in this release** (written against vLLM's documented worker API).
"""

from __future__ import annotations

from typing import Any

import torch


class WeightSyncWorkerExtension:
    """Mixed into vLLM's GPU worker; ``self.device`` and ``self.model_runner`` are the worker's."""

    communicator: Any = None
    client_rank: int | None = None

    def posttrain_load_safetensors(self, data: bytes) -> int:
        from safetensors.torch import load

        tensors = load(data)
        self.model_runner.model.load_weights(weights=[(n, t.to(self.device)) for n, t in tensors.items()])
        return len(tensors)

    def init_communicator(self, host: str, port: int, world_size: int, client_device_uuid: str | None = None) -> None:
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.parallel_state import get_world_group
        from vllm.distributed.utils import StatelessProcessGroup

        if self.communicator is not None:
            raise RuntimeError("The weight-update communicator is already initialised; close it first.")
        if client_device_uuid is not None and client_device_uuid == str(torch.cuda.get_device_properties(self.device).uuid):
            raise RuntimeError(
                "The trainer and the vLLM server use the same CUDA device; give them different GPUs "
                "(CUDA_VISIBLE_DEVICES)."
            )
        rank = get_world_group().rank
        group = StatelessProcessGroup.create(host=host, port=port, rank=rank, world_size=world_size)
        self.communicator = PyNcclCommunicator(group, device=self.device)
        self.client_rank = world_size - 1

    def update_named_param(self, name: str, dtype: str, shape: list[int]) -> None:
        if self.communicator is None:
            raise RuntimeError("Call /init_communicator/ before /update_named_param/.")
        weight = torch.empty(tuple(shape), dtype=getattr(torch, dtype.split(".")[-1]), device=self.device)
        self.communicator.broadcast(weight, src=self.client_rank)
        self.communicator.group.barrier()
        self.model_runner.model.load_weights(weights=[(name, weight)])

    def close_communicator(self) -> None:
        self.communicator = None
        self.client_rank = None
