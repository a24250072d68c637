#!/usr/bin/env python
"""Time a dense and a pruned model against each other in this fresh process, independently of the library's timing.

It loads the two files itself (ONNX files into its own ONNX Runtime sessions, CPU provider, graph optimisation
``all``, ``--threads`` intra-op threads; or ``.pt`` files holding whole PyTorch modules, loaded with
``weights_only=False``: only for files this benchmark wrote itself, and run eagerly under ``inference_mode`` with
``--threads`` torch threads) and alternates them: dense, pruned, dense, ..., dense (``--rounds`` pruned timings, each
between two dense ones). Each timing is the median of many single calls (warm-up calls first, then calls for
``--seconds``, at least ``--min-calls``). Each pruned timing is compared with the mean of the dense timings just before
and after it: its reduction is ``1 - pruned / that mean``. It prints one JSON object: the timings, the per-round
reductions, their median, their smallest and largest (the interval), and the dense drift (``max / min - 1`` of the
dense timings). Nothing of the ``analysis`` package is imported.

    python benchmarks/independent_latency.py dense.onnx pruned.onnx --batch 1 --rounds 7 --threads 2
    python benchmarks/independent_latency.py dense.pt pruned.pt --shape 3x224x224 --batch 1 --rounds 7 --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def onnx_call(path: Path, batch: int, threads: int) -> Callable[[], object]:
    """One inference of the ONNX file at ``path`` on ``batch`` random inputs, in a session of its own."""
    import numpy as np
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    (first,) = session.get_inputs()
    shape = [batch, *(int(n) for n in first.shape[1:])]
    feed = {first.name: np.random.default_rng(0).standard_normal(shape).astype(np.float32)}
    names = [session.get_outputs()[0].name]
    return lambda: session.run(names, feed)


def torch_call(path: Path, batch: int, threads: int, shape: tuple[int, ...]) -> Callable[[], object]:
    """One eager inference of the whole module saved at ``path`` on ``batch`` random inputs of ``shape``."""
    import torch

    sys.path.insert(0, str(REPO_ROOT))  # modules defined in the repository (the demo models) unpickle from here
    if threads:
        torch.set_num_threads(threads)
    model = torch.load(path, weights_only=False, map_location="cpu").eval()  # our own file, written by the benchmark
    inputs = torch.randn((batch, *shape), generator=torch.Generator().manual_seed(0))

    def call() -> object:
        with torch.inference_mode():
            return model(inputs)

    return call


def timing(call: Callable[[], object], seconds: float, min_calls: int, warmup: int = 3) -> float:
    """Median ms of single calls of ``call``: ``warmup`` untimed calls, then calls for ``seconds`` (``min_calls`` at
    least)."""
    for _ in range(warmup):
        call()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_calls or time.perf_counter() - start < seconds:
        before = time.perf_counter()
        call()
        times.append((time.perf_counter() - before) * 1000.0)
    return statistics.median(times)


def alternate(dense: Callable[[], object], pruned: Callable[[], object], rounds: int, seconds: float,
              min_calls: int) -> dict[str, object]:  # fmt: skip
    """D P D P ... D with ``rounds`` pruned timings; the per-round reductions and their summary."""
    dense_ms = [timing(dense, seconds, min_calls)]
    pruned_ms: list[float] = []
    for _ in range(rounds):
        pruned_ms.append(timing(pruned, seconds, min_calls))
        dense_ms.append(timing(dense, seconds, min_calls))
    reductions = [1.0 - p / ((a + b) / 2) for p, a, b in zip(pruned_ms, dense_ms, dense_ms[1:], strict=False)]
    return {
        "dense_ms": [round(t, 4) for t in dense_ms],
        "pruned_ms": [round(t, 4) for t in pruned_ms],
        "reductions": [round(r, 5) for r in reductions],
        "median_reduction": round(statistics.median(reductions), 5),
        "interval": [round(min(reductions), 5), round(max(reductions), 5)],
        "dense_drift": round(max(dense_ms) / min(dense_ms) - 1.0, 5),
    }


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, time the two files, print the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dense", type=Path, help="the dense model: .onnx, or .pt (a whole module saved by torch.save)")
    parser.add_argument("pruned", type=Path, help="the pruned model, of the same kind")
    parser.add_argument("--batch", type=int, default=1, help="inputs per call")
    parser.add_argument("--rounds", type=int, default=7, help="pruned timings, each between two dense timings")
    parser.add_argument("--threads", type=int, default=0, help="intra-op (torch) threads; 0: the runtime's default")
    parser.add_argument("--seconds", type=float, default=1.0, help="seconds of timed calls per timing")
    parser.add_argument("--min-calls", type=int, default=10, help="timed calls per timing at least")
    parser.add_argument("--shape", default="", help="CxHxW of one input (.pt files only; ONNX files say it)")
    args = parser.parse_args(argv)
    kinds = {args.dense.suffix, args.pruned.suffix}
    if kinds == {".onnx"}:
        dense, pruned = (onnx_call(path, args.batch, args.threads) for path in (args.dense, args.pruned))
        runtime = "onnxruntime"
    elif kinds == {".pt"}:
        if not args.shape:
            parser.error("--shape CxHxW is needed for .pt files")
        shape = tuple(int(n) for n in args.shape.split("x"))
        dense, pruned = (torch_call(path, args.batch, args.threads, shape) for path in (args.dense, args.pruned))
        runtime = "torch"
    else:
        parser.error("both files must be .onnx, or both .pt")
    result = alternate(dense, pruned, args.rounds, args.seconds, args.min_calls)
    print(json.dumps({"runtime": runtime, "batch": args.batch, "threads": args.threads, "rounds": args.rounds,
                      "seconds_per_timing": args.seconds, **result}))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
