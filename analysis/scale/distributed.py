"""Scale-out with torchrun: every rank analyses its share of the units into its own shard file; rank 0 merges.

``torchrun --nproc_per_node N run.py --config_path cfg`` (or multi-node torchrun) runs one process per rank, each on
its own device (``cuda:LOCAL_RANK`` when GPUs exist, the CPU with gloo otherwise). The job has three steps, each
ended by a collective that also carries errors, so that one rank's bad input stops every rank with the same message:

1. Rank 0 folds shards that an earlier, interrupted run left behind (sent by every rank, so shards on other
   machines' local disks count too) into the analysis file, and measures or reuses the baseline.
2. Every rank copies that file to its shard ``<stem>.rank<R>.pkl`` and analyses its deterministic share of the
   convs (balanced by estimated cost, see :mod:`analysis.scale.shards`), saving the shard atomically after every unit.
   Rank 0 shows one progress bar for the whole job by watching the shard files.
3. Every rank sends its shard to rank 0, which merges them into the analysis file (byte-identical to a one-process
   run) and writes the ratios and reports; then the shards are removed.

A rank that dies leaves its shard; rerunning with any number of ranks (or without torchrun) resumes from it.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm.contrib.logging import logging_redirect_tqdm

from analysis.errors import UserError
from analysis.io.lock import exclusive
from analysis.io.record import load_record
from analysis.io.results import Sensitivities, copy_analysis, load_sensitivities, sidecar_path
from analysis.progress import progress_bar
from analysis.scale.shards import ShardSpec, merge_records

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT = datetime.timedelta(days=7)  # ranks wait for the slowest one at the end of each step
PROGRESS_POLL_SECONDS = 2.0


@dataclass(frozen=True)
class Rank:
    """This process's place in a torchrun job."""

    rank: int
    world_size: int
    local_rank: int

    @property
    def leader(self) -> bool:
        """Rank 0 merges, prints and reports."""
        return self.rank == 0

    @property
    def shard(self) -> ShardSpec:
        """This rank's share of the units."""
        return ShardSpec(self.rank + 1, self.world_size)

    def shard_file(self, analysis_file: str | os.PathLike[str]) -> Path:
        """This rank's shard: ``out/s.pkl`` -> ``out/s.rank3.pkl``."""
        return rank_file(analysis_file, self.rank)


def rank_file(analysis_file: str | os.PathLike[str], rank: int | str) -> Path:
    """The shard file of ``rank`` (``*`` gives the glob pattern of all of them)."""
    path = Path(analysis_file)
    return path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


def from_environment() -> Rank | None:
    """The rank torchrun set up (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``), or None for a single process."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size < 2 or "RANK" not in os.environ:
        return None
    return Rank(int(os.environ["RANK"]), world_size, int(os.environ.get("LOCAL_RANK", "0")))


def rank_device(spec: str, rank: Rank) -> str:
    """``Global.device`` for this rank: ``auto``/``cuda`` become ``cuda:LOCAL_RANK`` when GPUs exist."""
    if spec in ("auto", "cuda") and torch.cuda.is_available():
        return f"cuda:{rank.local_rank % torch.cuda.device_count()}"
    return spec


@contextmanager
def process_group(device: torch.device) -> Iterator[None]:
    """Join the torchrun job (NCCL on GPUs, gloo on CPUs) for the block."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=COLLECTIVE_TIMEOUT)
    try:
        yield
    finally:
        dist.destroy_process_group()


def agree(error: UserError | None) -> None:
    """End a step on every rank: raise the first rank's user error everywhere, so all ranks stop alike."""
    errors: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, None if error is None else (type(error).__name__, str(error)))
    failed = next((item for item in errors if item is not None), None)
    if failed is not None:
        if error is not None:
            raise error
        raise UserError(failed[1])


def run_ranks(
    analysis_file: str | os.PathLike[str],
    rank: Rank,
    analyse: Callable[..., int | None],
    overwrite: bool = False,
) -> Sensitivities | None:
    """The three steps of a torchrun job (see the module docstring).

    Args:
        analysis_file: The job's analysis file.
        rank: This process's rank.
        analyse: Runs the analysis, ``analyse(analysis_file=..., shard=..., baseline_only=..., progress=...)``,
            returning the number of (param, ratio) pairs the whole job has (for the progress bar).
        overwrite: Start afresh: the analysis file and every shard are replaced.

    Returns:
        On rank 0 the merged sensitivities (in model order); None on the other ranks.
    """
    main = Path(analysis_file)
    mine = rank.shard_file(main)
    leftovers = sorted(main.parent.glob(rank_file(main, "*").name))
    sent = _gather([] if overwrite else [load_record(path, missing_ok=True) for path in leftovers])
    error: UserError | None = None
    total = None
    if rank.leader:
        try:
            with exclusive(main):
                if overwrite:
                    _remove([main])
                elif any(sent):
                    previous = [load_record(main)] if main.exists() else []
                    merge_records(main, previous + [item for items in sent for item in items])
            total = analyse(analysis_file=main, shard=None, baseline_only=True, progress=False)
        except UserError as caught:
            error = caught
    agree(error)
    _remove(leftovers)
    dist.barrier()  # no rank may still be removing an old rank<R>.pkl once a new one is written

    copy_analysis(main, mine)
    stop = threading.Event()
    monitor = _start_progress(main, stop, total) if rank.leader else None
    try:
        with logging_redirect_tqdm(loggers=[logging.getLogger("analysis")]):  # log lines above rank 0's bar
            analyse(analysis_file=mine, shard=rank.shard, baseline_only=False, progress=False)
    except UserError as caught:
        error = caught
    try:
        agree(error)  # every rank has finished its share; rank 0's bar counts until then
    finally:
        stop.set()
        if monitor is not None:
            monitor.join()

    shards = _gather([load_record(mine, missing_ok=True)])
    merged = None
    if rank.leader:
        try:
            with exclusive(main):
                mine_and_theirs = [record for records in shards for record in records]
                merged = merge_records(main, [load_record(main, missing_ok=True), *mine_and_theirs])
        except UserError as caught:
            error = caught
    agree(error)
    _remove([mine])
    return merged


def fold_local_shards(analysis_file: str | os.PathLike[str], discard: bool = False) -> list[Path]:
    """Merge the rank shards an interrupted torchrun job left beside ``analysis_file`` into it, then remove them
    (``discard``: only remove them, for a run that starts afresh).

    Lets a run without torchrun (or with another number of ranks) resume a torchrun job. Returns the shards found.
    """
    main = Path(analysis_file)
    leftovers = sorted(main.parent.glob(rank_file(main, "*").name))
    if leftovers and discard:
        _remove(leftovers)
    elif leftovers:
        with exclusive(main):
            files = ([main] if main.exists() else []) + leftovers
            merge_records(main, [load_record(path, missing_ok=True) for path in files])
        _remove(leftovers)
        logger.info("Merged %d shard(s) of an interrupted torchrun job into %s.", len(leftovers), main)
    return leftovers


def _gather(items: Sequence[Any]) -> list[Any]:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, list(items))
    return gathered


def _remove(paths: Sequence[Path]) -> None:
    for path in paths:
        for file in (sidecar_path(path), path):
            with suppress(FileNotFoundError):
                file.unlink()


def _start_progress(main: Path, stop: threading.Event, total: int | None) -> threading.Thread:
    """Rank 0's one bar for the whole job: (param, ratio) pairs in all shard files it can see, polled."""

    def count() -> int:
        seen: dict[tuple[str, float], None] = {}
        for path in main.parent.glob(rank_file(main, "*").name):
            with suppress(UserError, OSError):
                seen.update(dict.fromkeys((n, r) for n, curve in load_sensitivities(path).items() for r in curve))
        return len(seen)

    def watch() -> None:
        start = count()
        with progress_bar(
            None, desc="sensitivity (all ranks)", unit="variant", total=total, initial=start, dynamic_ncols=True
        ) as bar:
            while not stop.wait(PROGRESS_POLL_SECONDS):
                bar.update(max(0, count() - bar.n))
            bar.update(max(0, count() - bar.n))

    thread = threading.Thread(target=watch, name="progress", daemon=True)
    thread.start()
    return thread
