"""The teacher of self-distillation (SDFT, SDPO): which weights score the completions, and how they follow the student.

TRL's ``teacher_model_kind`` (``SDFTConfig`` / ``SDPOConfig``) names three teachers, all the student's own network:

- ``"base"``: the initial student, frozen. A plain student gets a frozen copy (loaded again from its path when it was
  given as one, else a deep copy); a PEFT student needs no copy: its adapters are disabled for the teacher pass
  (the base weights; for a student that arrived already adapted, TRL's behaviour: the base, not the starting
  adapter).
- ``"live"``: the student itself, at its current weights (no copy, no sync; the teacher pass runs under
  ``no_grad``).
- ``"ema"``: an exponential moving average of the student. Every ``teacher_sync_steps`` optimizer steps,
  ``teacher ← (1 − teacher_update_rate)·teacher + teacher_update_rate·student`` (``update_rate = 1`` is a hard
  resync). A plain student gets a frozen copy updated in place (``models.reference.sync_target_model``). A pure-LoRA
  student (every trainable parameter a LoRA parameter) gets a second adapter named ``"teacher"`` instead, started at
  zero and averaged toward the student's adapter tensors (TRL's ``PEFTAdapterEMACallback``: A and B are averaged
  separately, so the teacher's delta is not the average of the student's deltas); any other PEFT student is refused.

A trainer asks :func:`create_teacher` for a :class:`SelfDistillationTeacher`, runs teacher passes inside
``with teacher.activate(student) as module:`` (under ``torch.no_grad()``, which this context does not add) and adds
:class:`SyncTeacherModelCallback` so the EMA teacher is updated after optimizer steps.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator
from typing import Any, Literal

import torch
from transformers import TrainerCallback

from posttrain.models.peft_utils import is_peft_model, use_adapter
from posttrain.models.reference import sync_target_model
from posttrain.models.unwrap import unwrap_parallel

__all__ = [
    "TEACHER_ADAPTER_NAME",
    "TEACHER_MODEL_KINDS",
    "SelfDistillationTeacher",
    "SyncTeacherModelCallback",
    "create_teacher",
    "ema_update",
    "is_pure_lora_training",
]

logger = logging.getLogger(__name__)

TEACHER_MODEL_KINDS = ("base", "live", "ema")
TEACHER_ADAPTER_NAME = "teacher"
TeacherKind = Literal["base", "live", "ema"]


def is_pure_lora_training(model: torch.nn.Module) -> bool:
    """True when ``model`` is a PEFT model whose active adapter is LoRA and every trainable parameter is a LoRA one."""
    model = unwrap_parallel(model)
    if not is_peft_model(model):
        return False
    config = model.peft_config.get(model.active_adapter or "default")
    peft_type = getattr(config, "peft_type", None)
    if peft_type is None or str(peft_type).split(".")[-1] != "LORA":
        return False
    return all("lora_" in name for name, p in model.named_parameters() if p.requires_grad)


@torch.no_grad()
def ema_update(teacher: torch.nn.Module, student: torch.nn.Module, update_rate: float) -> None:
    """In place, parameter by parameter: ``teacher ← (1 − update_rate)·teacher + update_rate·student``."""
    if not 0.0 <= update_rate <= 1.0:
        raise ValueError(f"teacher_update_rate must be in [0, 1], got {update_rate}.")
    sync_target_model(student, teacher, update_rate)


def _adapter_pairs(model: torch.nn.Module, student_adapter: str, teacher_adapter: str) -> list[tuple[Any, Any]]:
    """(student parameter, teacher parameter) for every parameter of the student's adapter."""
    params = dict(model.named_parameters())
    pairs = []
    for name, param in params.items():
        if f".{student_adapter}." in name:
            twin = params.get(name.replace(f".{student_adapter}.", f".{teacher_adapter}."))
            if twin is not None:
                pairs.append((param, twin))
    return pairs


class SelfDistillationTeacher:
    """Where the teacher's weights are, and a context manager that makes them callable.

    Args:
        kind: One of :data:`TEACHER_MODEL_KINDS`.
        model: The separate frozen module (``"base"`` or ``"ema"`` with a plain student), else None.
        adapter_name: With a PEFT student: None for ``"base"`` (adapters disabled), ``"teacher"`` for a LoRA EMA
            teacher.
        update_rate / sync_steps: TRL's ``teacher_update_rate`` / ``teacher_sync_steps`` (``"ema"`` only).
    """

    def __init__(
        self,
        kind: TeacherKind,
        model: torch.nn.Module | None = None,
        *,
        adapter_name: str | None = None,
        uses_adapters: bool = False,
        update_rate: float = 0.05,
        sync_steps: int = 1,
        student_adapter: str | None = None,
    ):
        self.kind = kind
        self.model = model
        self.adapter_name = adapter_name
        self.uses_adapters = uses_adapters
        self.update_rate = float(update_rate)
        self.sync_steps = int(sync_steps)
        self.student_adapter = student_adapter

    def __repr__(self) -> str:
        where = "copy" if self.model is not None else "adapter" if self.uses_adapters else "student"
        return f"SelfDistillationTeacher(kind={self.kind!r}, weights={where!r})"

    @property
    def holds_copy(self) -> bool:
        """Whether a second set of full model weights is kept."""
        return self.model is not None

    @contextlib.contextmanager
    def activate(self, student: torch.nn.Module) -> Iterator[torch.nn.Module]:
        """Yield the module to run for teacher passes (the copy, or ``student`` with the teacher's adapters).

        Run the forward under ``torch.no_grad()``. The student's train/eval mode is left alone (disable dropout
        for a deterministic live or adapter teacher, as TRL's ``disable_dropout=True`` default does).
        """
        if self.model is not None:
            yield self.model
            return
        if self.uses_adapters:
            with use_adapter(unwrap_parallel(student), self.adapter_name):
                yield student
            return
        yield student  # live

    def prepare(self, accelerator: Any) -> None:
        """Place a separate teacher copy for inference with ``accelerator`` (device, DeepSpeed/FSDP engine)."""
        if self.model is None or accelerator is None:
            return
        if getattr(accelerator, "is_deepspeed_enabled", False) or getattr(accelerator, "is_fsdp2", False):
            self.model = accelerator.prepare_model(self.model, evaluation_mode=True)
        else:
            self.model = self.model.to(accelerator.device)

    def should_update(self, global_step: int) -> bool:
        return self.kind == "ema" and global_step > 0 and global_step % self.sync_steps == 0

    @torch.no_grad()
    def update(self, student: torch.nn.Module) -> None:
        """One EMA step toward ``student`` (no-op for ``"base"`` / ``"live"``)."""
        if self.kind != "ema":
            return
        if self.model is not None:
            ema_update(self.model, student, self.update_rate)
            return
        inner = unwrap_parallel(student)
        rate = self.update_rate
        for source, target in _adapter_pairs(inner, self.student_adapter, self.adapter_name):
            target.data.mul_(1.0 - rate).add_(source.data.to(target.dtype), alpha=rate)

    def state_dict(self, student: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The weights an EMA teacher has accumulated (CPU tensors; empty for ``"base"`` / ``"live"``, which a
        resumed run rebuilds exactly), for checkpoints: a resumed run then continues the same average."""
        if self.kind != "ema":
            return {}
        if self.model is not None:
            return {k: v.detach().cpu().clone() for k, v in unwrap_parallel(self.model).state_dict().items()}
        tag = f".{self.adapter_name}."
        return {n: p.detach().cpu().clone() for n, p in unwrap_parallel(student).named_parameters() if tag in n}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor], student: torch.nn.Module) -> None:
        """Restore what :meth:`state_dict` returned."""
        if self.kind != "ema" or not state:
            return
        if self.model is not None:
            unwrap_parallel(self.model).load_state_dict(state)
            return
        params = dict(unwrap_parallel(student).named_parameters())
        missing = sorted(set(state) - set(params))
        if missing:
            raise ValueError(f"The checkpoint's EMA teacher adapter has parameters the student lacks: {missing[:3]}.")
        for name, value in state.items():
            params[name].data.copy_(value.to(params[name].device, params[name].dtype))


def _add_zero_teacher_adapter(model: torch.nn.Module, name: str) -> str:
    """Add a frozen LoRA adapter ``name`` with the active adapter's config and all-zero weights; returns the active
    adapter's name."""
    active = model.active_adapter or "default"
    if name not in model.peft_config:
        model.add_adapter(name, copy.deepcopy(model.peft_config[active]))
    model.set_adapter(active)  # add_adapter / set_adapter switch which adapter is trainable: the student's again
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if f".{name}." in pname:
                param.zero_()
                param.requires_grad_(False)
    if not _adapter_pairs(model, active, name):
        raise ValueError(f"Could not pair the parameters of the '{name}' adapter with the '{active}' adapter.")
    return active


def create_teacher(
    student: torch.nn.Module,
    teacher_model_kind: str = "base",
    *,
    teacher_update_rate: float = 0.05,
    teacher_sync_steps: int = 1,
    reload_from: str | None = None,
    model_init_kwargs: dict[str, Any] | None = None,
) -> SelfDistillationTeacher:
    """Build the self-distillation teacher of ``student`` (see the module docstring for each kind).

    Args:
        student: The (unwrapped) student, possibly a ``PeftModel``.
        teacher_model_kind: ``"base"``, ``"live"`` or ``"ema"``.
        teacher_update_rate: EMA rate (``"ema"``), in [0, 1].
        teacher_sync_steps: Optimizer steps between EMA updates, >= 1.
        reload_from: Hub id / path the student was loaded from; a frozen copy is then loaded again from it (TRL
            builds its copies from the path) instead of deep-copying the student.
        model_init_kwargs: ``from_pretrained`` kwargs for ``reload_from``.

    Raises:
        ValueError: an unknown kind, a rate outside [0, 1], ``teacher_sync_steps < 1``, or ``"ema"`` with a PEFT
            student that is not pure LoRA.
    """
    if teacher_model_kind not in TEACHER_MODEL_KINDS:
        raise ValueError(
            f"teacher_model_kind must be one of {', '.join(repr(k) for k in TEACHER_MODEL_KINDS)}, "
            f"got {teacher_model_kind!r}."
        )
    if not 0.0 <= teacher_update_rate <= 1.0:
        raise ValueError(f"teacher_update_rate must be in [0, 1], got {teacher_update_rate}.")
    if teacher_sync_steps < 1:
        raise ValueError(f"teacher_sync_steps must be >= 1, got {teacher_sync_steps}.")
    kwargs = dict(update_rate=teacher_update_rate, sync_steps=teacher_sync_steps)
    if teacher_model_kind == "live":
        return SelfDistillationTeacher("live", **kwargs)
    if is_peft_model(student):
        if teacher_model_kind == "base":
            return SelfDistillationTeacher("base", adapter_name=None, uses_adapters=True, **kwargs)
        if not is_pure_lora_training(student):
            raise ValueError(
                "`teacher_model_kind='ema'` with a non-pure-LoRA PEFT model is not supported: the separate EMA "
                "teacher cannot be parameter-matched to the PEFT student. Use pure-LoRA training, a non-PEFT model, "
                "or `teacher_model_kind` in {'live', 'base'}."
            )
        active = _add_zero_teacher_adapter(student, TEACHER_ADAPTER_NAME)
        return SelfDistillationTeacher(
            "ema", adapter_name=TEACHER_ADAPTER_NAME, uses_adapters=True, student_adapter=active, **kwargs
        )
    frozen = None
    if reload_from is not None:
        from posttrain.models.loading import create_model_from_path

        frozen = create_model_from_path(reload_from, **(model_init_kwargs or {}))
        if type(frozen) is not type(student):
            frozen = None
        else:
            frozen = frozen.to(dtype=next(student.parameters()).dtype)
    if frozen is None:
        frozen = copy.deepcopy(student)
    for param in frozen.parameters():
        param.requires_grad_(False)
    frozen.eval()
    return SelfDistillationTeacher(teacher_model_kind, model=frozen, **kwargs)  # type: ignore[arg-type]


class SyncTeacherModelCallback(TrainerCallback):
    """Update an EMA teacher every ``teacher_sync_steps`` optimizer steps (TRL's ``SyncTeacherModelCallback`` and
    ``PEFTAdapterEMACallback`` in one: the teacher knows whether it is a copy or an adapter).

    Args:
        teacher: The :class:`SelfDistillationTeacher` (anything but ``"ema"`` makes this a no-op).
        accelerator: Unused on a single process; kept for TRL's signature.
    """

    def __init__(self, teacher: SelfDistillationTeacher, accelerator: Any = None):
        self.teacher = teacher
        self.accelerator = accelerator

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if model is not None and self.teacher.should_update(state.global_step):
            self.teacher.update(model)
        return control
