"""Channel cuts in a model's own code: whether a pruned copy still cuts right, and the stored sizes that follow.

A model that splits, chunks or slices its channels (MixNet's mixed convs, Res2Net's scales, DPN's dual path, CSP's
halves, ShuffleNetV2's chunk) does it with sizes it stores or derives from the tensor's width. A pruned copy runs the
same code on a narrower tensor. Where the model stores the sizes in an attribute that its forward pass reads, the
attribute is rewritten after the removal (:data:`STORED_SIZES`); elsewhere the cut is checked: the operator, re-run
on the labels of the narrower tensor (:meth:`ChannelFlow.cuts_right`), must give every piece exactly its own
channels. A unit for which that fails for any one of its channels is left out with the cut as its reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from analysis.structure.channel_flow import ChannelFlow, Cut
from analysis.structure.flow_groups import CoupledGraph, flow_coupling


@dataclass(frozen=True)
class PieceSizes:
    """A module whose forward splits by a stored list (or int) of piece widths: ``torch.split(x, self.<attribute>)``;
    the attribute becomes the list of kept widths."""

    attribute: str

    def follows(self, cut: Cut) -> bool:
        return cut.op in ("split", "split_with_sizes")

    def rewrite(self, module: nn.Module, flow: ChannelFlow, cut: Cut, removed: set[int]) -> None:
        setattr(module, self.attribute, [len(flow.kept(piece, removed)) for piece in cut.pieces])


@dataclass(frozen=True)
class SliceBound:
    """A module whose forward slices its channels at a stored bound: ``x[:, :self.<attribute>]`` and
    ``x[:, self.<attribute>:]``; the bound becomes the kept width of the first part."""

    attribute: str

    def follows(self, cut: Cut) -> bool:
        return len(cut.pieces) == 1 and _span(cut) is not None

    def rewrite(self, module: nn.Module, flow: ChannelFlow, cut: Cut, removed: set[int]) -> None:
        span = _span(cut)
        assert span is not None
        start, end = span
        first = cut.source[:end] if start == 0 else cut.source[:start]
        setattr(module, self.attribute, len(flow.kept(first, removed)))


StoredSizes = PieceSizes | SliceBound

STORED_SIZES: dict[tuple[str, str], StoredSizes] = {
    ("timm.layers.mixed_conv2d", "MixedConv2d"): PieceSizes("splits"),
    ("timm.models.res2net", "Bottle2neck"): PieceSizes("width"),
    ("timm.models.dpn", "DualPathBlock"): SliceBound("num_1x1_c"),
    ("timm.models.rexnet", "LinearBottleneck"): SliceBound("in_channels"),
    ("timm.models.ghostnet", "GhostModule"): SliceBound("out_chs"),
    ("timm.models.ghostnet", "GhostModuleV2"): SliceBound("out_chs"),
}
"""Modules whose forward cuts channels at sizes held in an attribute, by ``(module, class name)``."""


_REGISTERED: dict[type[nn.Module], StoredSizes] = {}


def register(module_type: type[nn.Module], sizes: StoredSizes) -> None:
    """Declare where modules of exactly ``module_type`` store the sizes they cut their channels with."""
    _REGISTERED[module_type] = sizes


def unregister(module_type: type[nn.Module]) -> None:
    """Undo :func:`register` (nothing happens for a class not registered)."""
    _REGISTERED.pop(module_type, None)


def sizes_attribute(module: nn.Module) -> str | None:
    """The attribute in which ``module`` stores the sizes its forward cuts its channels with, or None."""
    sizes = _REGISTERED.get(type(module)) or STORED_SIZES.get((type(module).__module__, type(module).__name__))
    return sizes.attribute if sizes is not None else None


def stored_sizes(module: nn.Module, cut: Cut) -> StoredSizes | None:
    """How ``module``'s stored sizes follow ``cut`` after a removal, or None."""
    sizes = _REGISTERED.get(type(module)) or STORED_SIZES.get((type(module).__module__, type(module).__name__))
    return sizes if sizes is not None and sizes.follows(cut) else None


def cut_problem(graph: CoupledGraph, root: nn.Module, channels: int) -> str | None:
    """Why removing channels of ``root`` would make the model's own code cut a narrower tensor wrongly, or None.

    Each cut the unit's channels pass must either have stored sizes that follow it, or cut right when any one of
    the unit's channels is gone, and when all but its first or all but its last are (the most a ratio removes).
    The cuts a model makes from sizes (``split(n)``, ``chunk(k)``, slices at a bound) depend on how many channels
    each piece loses: right for one and for the most, they are right in between (``chunk(2)`` of 16 channels cuts
    right after one removal from its second half, and wrong after two, which the second check finds)."""
    coupling = flow_coupling(graph, root, range(channels))
    flow = graph.flow
    if coupling is None or flow is None:
        return None
    sets = [flow.group_of(label) for label in flow.produced(graph.names[root])]
    removals = [{group} for group in sets] + [set(sets[1:]), set(sets[:-1])]
    for cut in coupling.cuts:
        module = _module(graph.model, cut.module)
        if stored_sizes(module, cut) is not None:
            continue
        if all(flow.cuts_right(cut, removed) for removed in removals):
            continue
        return (
            f"its channels pass {cut.where} ({type(module).__name__}), which would cut the pruned, narrower tensor "
            "in the wrong place"
        )
    return None


def follow_cuts(graph: CoupledGraph, root: nn.Module, channels: Sequence[int], clone: nn.Module) -> None:
    """After removing ``channels`` of ``root`` from ``clone`` (the model ``graph`` was traced on), rewrite the stored
    sizes of the cuts they pass; a cut that would go wrong is an error (discovery leaves such units out)."""
    follow_joint_cuts(graph, [(root, channels)], clone)


def follow_joint_cuts(
    graph: CoupledGraph, removals: Sequence[tuple[nn.Module, Sequence[int]]], clone: nn.Module
) -> None:
    """:func:`follow_cuts` for several ``(root, channels)`` removals of ``graph``'s model made together on ``clone``:
    each cut any of them passes is rewritten once, for everything they remove together (a cut that two groups pass,
    rewritten for each on its own, would keep the other's channels)."""
    flow = graph.flow
    if flow is None:
        return
    removed: set[int] = set()
    cuts: dict[tuple[str, str, tuple[int, ...]], Cut] = {}
    for root, channels in removals:
        coupling = flow_coupling(graph, root, channels)
        if coupling is None:
            continue
        produced = flow.produced(graph.names[root])
        removed.update(flow.group_of(produced[c]) for c in channels)
        for cut in coupling.cuts:
            cuts.setdefault((cut.module, cut.where, cut.source), cut)
    for cut in cuts.values():
        module = _module(clone, cut.module)
        sizes = stored_sizes(module, cut)
        if sizes is not None:
            sizes.rewrite(module, flow, cut, removed)
        elif not flow.cuts_right(cut, removed):
            raise ValueError(f"removing these channels makes {cut.where} cut the narrower tensor in the wrong place")


def _module(model: nn.Module, name: str) -> nn.Module:
    return model.get_submodule(name) if name else model


def _span(cut: Cut) -> tuple[int, int] | None:
    """Where the one piece of a slice lies in the cut tensor, or None unless it is a prefix or a suffix."""
    piece, source = cut.pieces[0], cut.source
    if not piece:
        return None
    if source[: len(piece)] == piece:
        return 0, len(piece)
    if source[len(source) - len(piece) :] == piece:
        return len(source) - len(piece), len(source)
    return None
