"""Where the decoded images live on a GPU run, and how their batches reach the device.

On a CUDA device a decoded uint8 cache (the evaluation or the calibration images) stays in GPU memory when it takes at
most ``Global.device_cache_share`` of the free GPU memory: a batch is then a slice of it (a gather for a given
order), normalised where it lies, without a copy. Otherwise it is kept in pinned (page-locked) host memory and every
batch is copied on a side CUDA stream one batch ahead, so that the copy of the next batch overlaps the work on the
current one. On the CPU (and other devices) the cache stays in RAM as it is.

Every placement gives the same batches, bit for bit: the same uint8 bytes in the same order, normalised on the
target device by the same function. :func:`prefetched` holds the one-batch-ahead order; on the CPU it runs without
streams or pinning, so that the order every device uses is tested on every machine.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Literal, TypeVar

import torch

logger = logging.getLogger(__name__)

Placement = Literal["device", "pinned", "host"]
"""``device``: in GPU memory; ``pinned``: in page-locked host memory; ``host``: in ordinary RAM."""

Batch = tuple[torch.Tensor, torch.Tensor]
Selection = slice | torch.Tensor  # a run of rows, or the positions of the rows in order

Item = TypeVar("Item")
Staged = TypeVar("Staged")
Ready = TypeVar("Ready")


def cache_placement(
    device: torch.device,
    cache_bytes: int,
    free_device_bytes: int | None,
    share: float,
    free_host_bytes: int | None = None,
) -> Placement:
    """Where a decoded cache of ``cache_bytes`` should live for batches on ``device``.

    ``host`` off CUDA; on CUDA ``device`` when the cache takes at most ``share`` of ``free_device_bytes`` (``share``
    0, or free memory unknown: never), else ``pinned``, unless ``free_host_bytes`` is given and smaller than the
    pinned copy (:func:`pinned_copy_bytes`): then ``host``, since pinning would exhaust the machine's memory.
    """
    if device.type != "cuda":
        return "host"
    if share > 0 and free_device_bytes is not None and cache_bytes <= share * free_device_bytes:
        return "device"
    if free_host_bytes is not None and pinned_copy_bytes(cache_bytes) > free_host_bytes:
        return "host"
    return "pinned"


def pinned_copy_bytes(cache_bytes: int) -> int:
    """Host memory a pinned copy of ``cache_bytes`` takes: torch's pinned allocator rounds every allocation up to a
    power of two (so up to twice the bytes)."""
    return 1 << max(cache_bytes - 1, 0).bit_length()


def free_device_bytes(device: torch.device) -> int | None:
    """Free memory of a CUDA device as its driver reports it (None for other devices)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free


def describe_placement(
    placement: Placement,
    cache_bytes: int,
    free_device_bytes: int | None,
    share: float,
    free_host_bytes: int | None = None,
) -> str:
    """Why :func:`cache_placement` chose ``placement``, for the log line (the same arguments)."""
    size = f"{cache_bytes / 1e9:.2f} GB"
    free = "unknown free GPU memory" if free_device_bytes is None else f"the {free_device_bytes / 1e9:.2f} GB free"
    if placement == "device":
        return (
            f"in GPU memory ({size}, at most Global.device_cache_share {share} of {free}); batches are sliced there "
            "without copies"
        )
    if placement == "pinned":
        why = (
            "Global.device_cache_share is 0" if share <= 0 else f"more than Global.device_cache_share {share} of {free}"
        )
        return f"in pinned host memory ({size}, {why}); each batch is copied one batch ahead on a side CUDA stream"
    if free_host_bytes is None:
        return f"in host memory ({size})"
    return (
        f"in ordinary host memory ({size}): it does not fit in GPU memory and a pinned copy would take "
        f"{pinned_copy_bytes(cache_bytes) / 1e9:.2f} GB (rounded up to a power of two), more than the "
        f"{free_host_bytes / 1e9:.2f} GB of memory available; copies to the GPU do not overlap with compute"
    )


def placed(tensor: torch.Tensor, placement: Placement, device: torch.device) -> torch.Tensor:
    """``tensor`` where ``placement`` says: on ``device``, in pinned host memory, or in host memory (copied only
    when it is elsewhere).

    Raises:
        RuntimeError: When the pinned or device memory cannot be allocated.
    """
    if placement == "device":
        return tensor.to(device)
    host = tensor.cpu()
    return host.pin_memory() if placement == "pinned" and not host.is_pinned() else host


def prefetched(
    items: Iterable[Item], stage: Callable[[Item], Staged], finish: Callable[[Staged], Ready]
) -> Iterator[Ready]:
    """``finish(stage(item))`` for every item, in order, one item ahead: item k+1 is staged after item k is finished
    and before it is yielded, so that whatever staging starts (a copy on a side stream) runs while the caller works
    on item k."""
    iterator = iter(items)
    for first in iterator:
        staged = stage(first)
        break
    else:
        return
    for item in iterator:
        ready = finish(staged)
        staged = stage(item)
        yield ready
    yield finish(staged)


class Stager:
    """Makes the batches of a decoded uint8 cache on ``device``: selects the rows, copies them to the device (from
    host memory on CUDA: on a side stream, one batch ahead) and normalises them there.

    Attributes:
        seconds: Time spent making batches, cumulative: selecting rows, issuing their copies and normalising them, as
            measured on the host (the device may still be working on them when it is counted). With ``measure``,
            the device is synchronised before and after every step, so that the time is the steps' real time (and
            nothing overlaps): for benchmarks only.
        measure: Whether to synchronise around every step (off by default: it would stall the pipeline).
    """

    def __init__(self, device: torch.device, normalise: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.device = device
        self.normalise = normalise
        self.seconds = 0.0
        self.measure = False
        self._stream: torch.cuda.Stream | None = None

    def batches(
        self, images: torch.Tensor, labels: torch.Tensor, batch_size: int, order: torch.Tensor | None = None
    ) -> Iterator[Batch]:
        """Normalised batches of ``batch_size`` images and their labels on the device: the rows in order, or those at
        ``order`` (positions on the CPU), wherever ``images`` and ``labels`` live (the device or host memory)."""
        count = len(images) if order is None else len(order)
        if order is not None:
            order = order.to(images.device)  # once per pass: a gather from GPU memory takes its positions there
        starts = range(0, count, batch_size)
        selections: list[Selection] = [
            slice(start, start + batch_size) if order is None else order[start : start + batch_size] for start in starts
        ]
        if self.device.type == "cuda" and images.device.type == "cpu":
            stream = self._side_stream()
            pinned = images.is_pinned(), labels.is_pinned()
            yield from prefetched(
                selections,
                lambda selection: self._timed(lambda: self._copy_ahead(images, labels, selection, stream, pinned)),
                lambda staged: self._timed(lambda: self._after_copy(staged, stream)),
            )
            return
        yield from prefetched(
            selections,
            lambda selection: self._timed(lambda: self._select(images, labels, selection)),
            lambda staged: self._timed(lambda: (self.normalise(staged[0]), staged[1])),
        )

    def _select(self, images: torch.Tensor, labels: torch.Tensor, selection: Selection) -> Batch:
        """The rows on the device: a view or a gather where the cache is already there (on the CPU, in GPU memory),
        else a copy on the current stream (a device without streams)."""
        return images[selection].to(self.device, non_blocking=True), labels[selection].to(self.device)

    def _copy_ahead(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        selection: Selection,
        stream: torch.cuda.Stream,
        pinned: tuple[bool, bool],
    ) -> Batch:
        """Issue the copy of the rows from host memory on the side ``stream`` (asynchronous from pinned memory)."""
        host_images, host_labels = _rows(images, selection, pinned[0]), _rows(labels, selection, pinned[1])
        with torch.cuda.stream(stream):
            return host_images.to(self.device, non_blocking=True), host_labels.to(self.device, non_blocking=True)

    def _after_copy(self, staged: Batch, stream: torch.cuda.Stream) -> Batch:
        """Make the current stream wait for the copy, tell the allocator the copied tensors are used there (their
        memory came from the side stream's pool), and normalise on the current stream."""
        images, labels = staged
        current = torch.cuda.current_stream(self.device)
        current.wait_stream(stream)
        images.record_stream(current)
        labels.record_stream(current)
        return self.normalise(images), labels

    def _side_stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        return self._stream

    def _timed(self, step: Callable[[], Batch]) -> Batch:
        """Run ``step`` and add its time to :attr:`seconds` (synchronised around it with :attr:`measure`)."""
        synchronise = self.measure and self.device.type == "cuda"
        if synchronise:
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        result = step()
        if synchronise:
            torch.cuda.synchronize(self.device)
        self.seconds += time.perf_counter() - start
        return result


def _rows(tensor: torch.Tensor, selection: Selection, pinned: bool) -> torch.Tensor:
    """The selected rows of a host tensor: a view for a run of rows, else a gather, into pinned memory when the
    tensor is pinned (so that its copy stays asynchronous; torch's pinned allocator frees the buffer only once the
    copy that read it is done)."""
    if isinstance(selection, slice) or not pinned:
        return tensor[selection]
    out = torch.empty((len(selection), *tensor.shape[1:]), dtype=tensor.dtype, pin_memory=True)
    return torch.index_select(tensor, 0, selection, out=out)
