"""A CPU-time limit for one call into Torch-Pruning, whose group search never ends on a few architectures.

Torch-Pruning builds a group by walking the dependency graph and mapping channel indices through every reshape; on
some models (timm's ReXNet and EfficientViT-M, CoAtNet's attention convs) the walk or the index lists grow without
bound. Python cannot stop another thread, so the limit is a ``SIGVTALRM`` timer on the process's CPU time (a busy
machine does not make a search look slower than it is): it applies in the main thread of a Unix process
(``run.py``, torchrun ranks, most scripts) and is skipped elsewhere, or when such a timer is already armed.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType


class TimeLimitReached(Exception):
    """The limited block ran longer than its limit."""


def _can_limit() -> bool:
    return (
        hasattr(signal, "setitimer")
        and threading.current_thread() is threading.main_thread()
        and signal.getitimer(signal.ITIMER_VIRTUAL)[0] == 0.0
    )


@contextmanager
def time_limit(seconds: float) -> Iterator[bool]:
    """Raise :class:`TimeLimitReached` inside the block once the process has spent ``seconds`` of CPU time in it;
    yields whether the limit is on. The previous ``SIGVTALRM`` handler is restored afterwards, also on error.
    """
    if seconds <= 0 or not _can_limit():
        yield False
        return

    def expire(signum: int, frame: FrameType | None) -> None:
        raise TimeLimitReached(f"did not finish in {seconds:g} s of CPU time")

    previous = signal.signal(signal.SIGVTALRM, expire)
    signal.setitimer(signal.ITIMER_VIRTUAL, seconds)
    try:
        yield True
    finally:
        signal.setitimer(signal.ITIMER_VIRTUAL, 0.0)
        signal.signal(signal.SIGVTALRM, previous)
