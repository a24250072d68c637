"""Recovery checkpoints: everything a killed run needs to go on as if it had not stopped, written atomically.

``last.pt`` holds the model's weights and buffers, the optimizer's and the schedule's state, the step, the best
evaluation so far, every evaluation, the random number generators' states and the run's identity (a fingerprint of
the plan, the recipe and the data), so a checkpoint of another run is never continued. ``best.pt`` holds the weights
of the best evaluation. Both are read with ``torch.load(weights_only=True)``: a checkpoint is data, never code.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from analysis.errors import UserError, printable
from analysis.io.atomic import atomic_write_bytes

LAST_FILE = "last.pt"
BEST_FILE = "best.pt"
FORMAT = 1


class CheckpointError(UserError):
    """A checkpoint that cannot be continued: unreadable, or written by another run."""


@dataclass
class Evaluation:
    """One evaluation during recovery: after how many steps, and the metrics."""

    step: int
    metrics: dict[str, float]

    def as_dict(self) -> dict[str, Any]:
        """As JSON (the sidecar's history)."""
        return {"step": self.step, **self.metrics}


@dataclass
class TrainingState:
    """Where training stands: the step reached, the best evaluation and every evaluation so far."""

    step: int = 0
    best: Evaluation | None = None
    history: list[Evaluation] = field(default_factory=list)


def save_checkpoint(
    folder: Path,
    identity: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    schedule: torch.optim.lr_scheduler.LRScheduler,
    state: TrainingState,
) -> None:
    """Write ``folder/last.pt`` atomically (a reader sees the former checkpoint or this one, never a part)."""
    payload = {
        "format": FORMAT,
        "identity": identity,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "schedule": schedule.state_dict(),
        "step": state.step,
        "best": None if state.best is None else state.best.as_dict(),
        "history": [evaluation.as_dict() for evaluation in state.history],
        "rng": _rng_states(),
    }
    atomic_write_bytes(folder / LAST_FILE, _serialised(payload))


def save_best(folder: Path, model: torch.nn.Module) -> None:
    """Write the weights of the best evaluation to ``folder/best.pt`` atomically."""
    atomic_write_bytes(folder / BEST_FILE, _serialised(model.state_dict()))


def read_checkpoint(folder: Path, identity: str) -> dict[str, Any] | None:
    """The checkpoint in ``folder`` to continue from, or None when there is none.

    Raises:
        CheckpointError: When ``last.pt`` cannot be read, or belongs to another run (another plan, recipe or data).
    """
    path = folder / LAST_FILE
    if not path.is_file():
        return None
    payload = _load(path)
    if not isinstance(payload, Mapping) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{printable(path)} is not a checkpoint this version writes; move it away, or start "
                              "over with --fresh.")  # fmt: skip
    if payload.get("identity") != identity:
        raise CheckpointError(f"{printable(path)} is the checkpoint of another run (another plan, recipe or data); "
                              "start over with --fresh, or set another Recovery.output_dir to keep it.")  # fmt: skip
    return dict(payload)


def read_best(folder: Path) -> dict[str, torch.Tensor]:
    """The weights in ``folder/best.pt``.

    Raises:
        CheckpointError: When it is missing or unreadable.
    """
    path = folder / BEST_FILE
    if not path.is_file():
        raise CheckpointError(f"{printable(path)} is missing; start over with --fresh.")
    weights = _load(path)
    if not isinstance(weights, dict):
        raise CheckpointError(f"{printable(path)} holds no weights; start over with --fresh.")
    return weights


def restore(
    payload: Mapping[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    schedule: torch.optim.lr_scheduler.LRScheduler,
) -> TrainingState:
    """Load a checkpoint into the model, optimizer and schedule and the random number generators; the state."""
    model.load_state_dict(payload["model"])
    optimizer.load_state_dict(payload["optimizer"])
    schedule.load_state_dict(payload["schedule"])
    _set_rng_states(payload["rng"])
    history = [_evaluation(entry) for entry in payload["history"]]
    best = None if payload["best"] is None else _evaluation(payload["best"])
    return TrainingState(int(payload["step"]), best, history)


def remove_checkpoints(folder: Path) -> None:
    """Delete the checkpoints of ``folder`` (``--fresh``)."""
    for name in (LAST_FILE, BEST_FILE):
        path = folder / name
        if path.exists():
            os.unlink(path)


def _evaluation(entry: Mapping[str, Any]) -> Evaluation:
    return Evaluation(int(entry["step"]), {key: float(value) for key, value in entry.items() if key != "step"})


def _serialised(payload: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return buffer.getvalue()


def _load(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # any unreadable file is one message, whatever torch raised
        raise CheckpointError(f"{printable(path)} cannot be read ({type(error).__name__}); move it away, or start "
                              "over with --fresh.") from None  # fmt: skip


def _rng_states() -> dict[str, Any]:
    states: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _set_rng_states(states: Mapping[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
