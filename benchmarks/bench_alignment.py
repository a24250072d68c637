#!/usr/bin/env python
"""Aligned against unaligned channel counts: how much faster a model runs with every group pruned at one ratio, the
counts as the analysis takes them (``round(C * r)``) or rounded to keep a multiple of ``--multiple`` channels (what
``latency_round_to`` does to a latency plan).

Each variant is timed between timings of the dense model on the runtime (``bracket``, 3 rounds), the variants
interleaved and the whole sequence repeated ``--repeats`` times; it prints each reduction and the MACs removed. The
model and its analysis are ``bench_latency.py``'s (random weights at ``--size`` px, the analysis reused from its
``--out`` folder when there is one, else run on ``--images`` images).

    python benchmarks/bench_alignment.py --model mobilenet_v2 --runtime onnxruntime --ratios 0.15 0.3
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_latency  # this folder's benchmark: the same models and analyses

from analysis.planning.plan import Planner, open_planner
from analysis.runtimes.compare import bracket
from analysis.runtimes.runtime import make_runtime
from analysis.runtimes.settings import RuntimeSettings
from analysis.structure.flops import count_cost
from analysis.structure.groups import eval_mode
from analysis.structure.physical import jointly_pruned_copy


def uniform_removals(
    planner: Planner, channels: dict[str, int], ratio: float, multiple: int
) -> list[tuple[str, list[int]]]:
    """Every group (``{key: channels}``) pruned at ``ratio``: ``round(C * ratio)`` channels, or with ``multiple``
    above 1 the count keeping the nearest multiple of it (at least one multiple)."""
    removals = []
    for key, total in channels.items():
        count = round(total * ratio)
        if multiple > 1:
            count = total - max(multiple, multiple * round((total - count) / multiple))
        count = min(count, total - 1)
        if count > 0:
            removals.append((planner.by_name[key].module_name, planner.removed(key, count)))
    return removals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="mobilenet_v2", choices=bench_latency.TORCHVISION_MODELS)
    parser.add_argument("--runtime", default="onnxruntime", choices=("onnxruntime", "torch"))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.15, 0.3])
    parser.add_argument("--multiple", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--images", type=int, default=128)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--out", type=Path, default=bench_latency.REPO_ROOT / "benchmarks" / "_data" / "latency")
    args = parser.parse_args(argv)
    analysis = argparse.Namespace(out=args.out, ratios=[0.1, 0.2, 0.3, 0.4, 0.5, 0.6], images=args.images,
                                  size=args.size, reuse_analysis=True)  # fmt: skip
    inputs, record, *_ = bench_latency.analyse(args.model, analysis)
    model, example = inputs.model, inputs.example_input
    runtime = make_runtime(args.runtime, torch.device("cpu"), settings=RuntimeSettings())
    with eval_mode(model):
        planner, options = open_planner(model, example, record, "macs")
        channels = {group.key: group.channels for group in options}
        dense_macs = count_cost(model, example).macs
        variants = {}
        for ratio in args.ratios:
            for multiple in (1, args.multiple):
                copy = jointly_pruned_copy(model, uniform_removals(planner, channels, ratio, multiple), example).eval()
                variants[(ratio, multiple)] = (copy, 1.0 - count_cost(copy, example).macs / dense_macs)
        found: dict[tuple[float, int], list[float]] = {key: [] for key in variants}
        with runtime.prepare(model, tuple(example.shape[1:])) as dense:
            for repeat in range(args.repeats):
                for key, (copy, _) in variants.items():
                    with runtime.prepare(copy, tuple(example.shape[1:])) as candidate:
                        measured = bracket(dense, candidate, args.batch)
                    found[key].append(measured.reduction)
                    print(f"repeat {repeat}: ratio {key[0]:g}, multiple {key[1]}: {measured.reduction:.1%} faster "
                          f"(dense {measured.dense_median:.2f} ms, drift {measured.drift:.1%})")  # fmt: skip
    print(f"\n{args.model}, {args.runtime} batch {args.batch}, {args.size} px, every group pruned at once:")
    for (ratio, multiple), reductions in found.items():
        kept = "as analysed" if multiple == 1 else f"keeping multiples of {multiple}"
        print(
            f"  ratio {ratio:g}, {kept}: {variants[(ratio, multiple)][1]:.1%} fewer MACs, "
            f"{statistics.median(reductions):.1%} faster (runs: {', '.join(f'{r:.1%}' for r in reductions)})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
