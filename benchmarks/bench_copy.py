#!/usr/bin/env python
"""Time ``jointly_pruned_copy``: one group and six groups of torchvision models at 224 px, random weights.

The removals are 30% of the output channels (the last ones) of the first prunable conv units of distinct groups (what
a plan removes); discovery (``find_prunable``) is not timed. Each copy is timed ``--repeats`` times: the first call
includes whatever tracing the copy needs, the later ones show what a plan's repeated copies of one model cost.

    python benchmarks/bench_copy.py                                  # resnet18 and resnet50, 1 and 6 groups
    python benchmarks/bench_copy.py --models densenet121 --groups 3 --repeats 2
"""

from __future__ import annotations

import argparse
import time

import torch
import torchvision
from torch import nn

from analysis.structure.criteria import lowest_channels
from analysis.structure.groups import PrunableUnit, find_prunable
from analysis.structure.physical import jointly_pruned_copy


def distinct_groups(units: list[PrunableUnit], count: int, ratio: float = 0.3) -> list[tuple[str, list[int]]]:
    """Removals for the first ``count`` prunable conv units whose groups share no unit."""
    taken: set[str] = set()
    removals: list[tuple[str, list[int]]] = []
    for unit in units:
        if not unit.prunable or unit.kind != "conv" or unit.name in taken:
            continue
        taken.update([unit.name, *unit.coupled_params])
        removals.append((unit.module_name, _last(unit, ratio)))
        if len(removals) == count:
            break
    return removals


def _last(unit: PrunableUnit, ratio: float) -> list[int]:
    """``ratio`` of the unit's channels, the last ones (evenly per conv group where its group has grouped convs)."""
    blocks = max(1, len(unit.conv_blocks))
    count = max(blocks, round(unit.channels * ratio) // blocks * blocks)
    scores = torch.arange(unit.channels, dtype=torch.float).flip(0)  # deterministic: the last channels go
    return lowest_channels(scores, count, unit.conv_blocks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["resnet18", "resnet50"])
    parser.add_argument("--groups", nargs="+", type=int, default=[1, 6])
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"torch threads: {torch.get_num_threads()}")
    for name in args.models:
        model: nn.Module = torchvision.models.get_model(name, weights=None).eval()
        example = torch.randn(1, 3, args.size, args.size)
        units = find_prunable(model, example)
        for count in args.groups:
            removals = distinct_groups(units, count)
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                jointly_pruned_copy(model, removals, example)
                times.append(time.perf_counter() - start)
            shown = ", ".join(f"{t:.2f}" for t in times)
            print(f"{name:<12} {len(removals)} group(s): {shown} s", flush=True)


if __name__ == "__main__":
    main()
