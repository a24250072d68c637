"""Splitting an analysis into deterministic shards, and merging analysis files back into one.

A shard is a subset of the analysed conv weights (whole params, so coupled evaluations are never split). Params are
assigned greedily, most expensive first, each to the shard with the least estimated work so far (longest
processing time first); the estimate is the number of ratios times the MACs of the network from the conv onwards,
which is what the fast engine re-runs per variant. The same model, params and ratios give the same shards on
every machine.

Merging follows PaddleSlim's ``merge_sensitive`` (later files win for the same (param, ratio)), refuses files whose
fingerprints (model weights, data, settings) differ, and writes the result in model order, so merged shards are
byte-identical to the analysis file of a single uninterrupted run.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from analysis.errors import AnalysisFileError, ConfigError
from analysis.io.record import AnalysisRecord, load_record
from analysis.io.results import Sensitivities
from analysis.io.sidecar import Sidecar
from analysis.io.store import AnalysisStore, Fingerprint
from analysis.structure.groups import PrunableUnit

logger = logging.getLogger(__name__)

_SHARD_SPEC = re.compile(r"^\s*(\d+)\s*/\s*(\d+)\s*$")


@dataclass(frozen=True)
class ShardSpec:
    """The ``index``-th (1-based) of ``count`` shards."""

    index: int
    count: int

    @classmethod
    def parse(cls, text: str, key: str = "--shard") -> ShardSpec:
        """Parse ``I/N`` (1 <= I <= N).

        Raises:
            ConfigError: ``text`` is not of that form.
        """
        match = _SHARD_SPEC.match(text)
        if match is None or not 1 <= int(match[1]) <= int(match[2]):
            raise ConfigError(f"{key} must be I/N with 1 <= I <= N (e.g. 1/4 for the first of four), got {text!r}.")
        return cls(int(match[1]), int(match[2]))

    def path(self, analysis_file: str | os.PathLike[str]) -> Path:
        """The shard's own analysis file: ``out/s.pkl`` -> ``out/s.shard1of4.pkl``."""
        path = Path(analysis_file)
        return path.with_name(f"{path.stem}.shard{self.index}of{self.count}{path.suffix}")


def downstream_macs(conv_order: Sequence[str], macs_per_module: Mapping[str, int]) -> dict[str, int]:
    """For each conv (module name, forward order): the MACs of itself and every conv/linear that runs after it.

    Layers that are not convs (linears) count as running after every conv.
    """
    convs = [name for name in conv_order if name in macs_per_module]
    tail = sum(macs for name, macs in macs_per_module.items() if name not in set(convs))
    result: dict[str, int] = {}
    for name in reversed(convs):
        tail += macs_per_module[name]
        result[name] = tail
    return result


def assign(costs: Sequence[tuple[str, float]], count: int) -> list[list[str]]:
    """Split ``(name, cost)`` pairs into ``count`` shards of similar total cost; names keep their input order.

    Longest processing time first: the most expensive unassigned name goes to the shard with the least work (the
    lowest shard number on ties), which is deterministic and within 4/3 of the best possible split.
    """
    position = {name: i for i, (name, _) in enumerate(costs)}
    loads = [0.0] * count
    shards: list[list[str]] = [[] for _ in range(count)]
    for name, cost in sorted(costs, key=lambda pair: (-pair[1], position[pair[0]])):
        target = min(range(count), key=lambda i: (loads[i], i))
        loads[target] += cost
        shards[target].append(name)
    return [sorted(shard, key=position.__getitem__) for shard in shards]


def shard_params(
    params: Sequence[PrunableUnit], macs_per_module: Mapping[str, int], conv_order: Sequence[str], spec: ShardSpec
) -> list[PrunableUnit]:
    """The params of shard ``spec``, in model order; the split depends only on the model and ``params``."""
    downstream = downstream_macs(conv_order, macs_per_module)
    shards = assign([(p.name, float(downstream.get(p.module_name, 1))) for p in params], spec.count)
    chosen = set(shards[spec.index - 1])
    return [p for p in params if p.name in chosen]


def merge_files(output: str | os.PathLike[str], inputs: Sequence[str | os.PathLike[str]]) -> Sensitivities:
    """Merge analysis files (and their sidecars) into ``output``; later inputs win for the same (param, ratio).

    Raises:
        AnalysisFileError: An input cannot be read, or two inputs were computed on another model, other data or
            with other settings (their sidecar fingerprints differ).
    """
    if not inputs:
        raise ConfigError("merge needs at least one input analysis file.")
    return merge_records(output, [load_record(path) for path in inputs])


def merge_records(output: str | os.PathLike[str], records: Sequence[AnalysisRecord]) -> Sensitivities:
    """Like :func:`merge_files`, for analysis records already read (e.g. sent by ranks); later records win."""
    loaded = [(str(record.path), record.sensitivities, record.sidecar) for record in records]
    with_sidecar: list[tuple[str, Sidecar]] = [(label, sidecar) for label, _, sidecar in loaded if sidecar is not None]
    reference_label, reference = with_sidecar[0] if with_sidecar else ("", Sidecar())
    for label, sidecar in with_sidecar[1:]:
        if sidecar.fingerprint != reference.fingerprint:
            raise AnalysisFileError(
                f"{label} was computed on another model, other data or with other settings than {reference_label} "
                "(their sidecar fingerprints differ); merge only shards of one analysis."
            )
    for label, _, found in loaded:
        if found is None:
            logger.warning("%s has no sidecar: it cannot be checked against the others; merging it anyway.", label)
    order = list(reference.model_order or [])
    for _, sensitivities, _ in loaded:
        order += [name for name in sensitivities if name not in set(order)]
    fingerprint = Fingerprint.of(reference.fingerprint)
    store = AnalysisStore(output, fingerprint, order, overwrite=True, config=reference.config)
    for _, sensitivities, found in loaded:
        store.absorb(sensitivities, found)
    store.save()
    return store.ordered()
