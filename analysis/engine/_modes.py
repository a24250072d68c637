"""How a param is evaluated: by masking (zeroing its group's slices in place) where that equals removing the
channels, else on a physically pruned copy. Decided per param by comparing the two on a few images."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch_pruning as tp
from torch import nn

from analysis.engine.approximation import EXACT_TOLERANCE
from analysis.engine.batchnorm import BatchNorm, layers_in_copy, reestimate, reestimated
from analysis.inputs.device import is_out_of_memory
from analysis.structure.groups import PrunableUnit, removal_group
from analysis.structure.masking import masked
from analysis.structure.physical import checking_copy

logger = logging.getLogger(__name__)

CHECK_IMAGES = 4  # images on which masking is compared with physical pruning (the difference shows on any image)


@dataclass
class ModeCheck:
    """How a param is evaluated: ``mask``, ``physical``, ``element``, or None (physical pruning failed,
    ``difference`` says why); with the masked logits of the check images at the channels checked, which the fast
    engine compares against."""

    mode: str | None
    difference: float | str
    channels: Sequence[int] = field(default_factory=list)
    masked_logits: torch.Tensor | None = None


class MaskCheck:
    """Compares masked and physically pruned logits of one model.

    Args:
        model: The model, in eval mode on its device.
        graph: Its dependency graph.
        example_input: The batch physical pruning traces; its first :data:`CHECK_IMAGES` images are compared.

    Attributes:
        tolerance: The largest difference, as a fraction of the largest logit (at least 1), at which masking is
            taken to equal removal (a speed mode raises it to its measured noise floor, see
            :func:`~analysis.engine.approximation.mask_tolerance`).
    """

    def __init__(self, model: nn.Module, graph: tp.DependencyGraph, example_input: torch.Tensor) -> None:
        self.model, self.graph, self.example_input = model, graph, example_input
        self.images = example_input[:CHECK_IMAGES]
        self.tolerance = EXACT_TOLERANCE

    def choose(self, param: PrunableUnit, channels: Sequence[int], batchnorms: Sequence[BatchNorm] | None) -> ModeCheck:
        """Masking is used only when it agrees with physical pruning at ``channels``; with ``batchnorms`` (adaptive
        BN: the layers a variant re-estimates) they must also agree after both re-estimate those statistics.

        The physically pruned model is a :func:`~analysis.structure.physical.checking_copy` (it computes what a full
        pruned copy computes, made without a deep copy or a new trace): this check runs once per unit and on small
        data was a large share of a run."""
        root = self.model.get_submodule(param.module_name)
        try:
            copy = checking_copy(self.model, self.graph, param.module_name, channels, own=batchnorms or ())
            with torch.inference_mode():
                physical = copy(self.images).float()
        except Exception as error:  # Torch-Pruning cannot remove these channels: report it, do not guess
            if is_out_of_memory(error):
                raise  # the machine, not the unit: leaving the unit out would record a wrong reason
            logger.debug("Physical pruning of %s failed", param.name, exc_info=True)
            text = str(error).splitlines()[0][:200] if str(error) else ""
            return ModeCheck(None, f"{type(error).__name__}: {text}")
        group = removal_group(self.graph, root, channels)
        with masked(self.graph, group), torch.inference_mode():
            masked_logits = self.model(self.images)
        difference = float((masked_logits.float() - physical).abs().max())
        tolerance = self.tolerance * max(1.0, float(physical.abs().max()))
        if difference <= tolerance and batchnorms is not None:
            difference = max(difference, self._calibrated_difference(copy, group, batchnorms))
        if difference <= tolerance:
            return ModeCheck("mask", difference, list(channels), masked_logits)
        logger.info(
            "%s: masking differs from physical pruning by %.3g (channel-normalising layer or f(0) != 0 in its "
            "group); evaluating it on physically pruned copies.", param.name, difference,
        )  # fmt: skip
        return ModeCheck("physical", difference, list(channels))

    def _calibrated_difference(self, copy: nn.Module, group: tp.Group, layers: Sequence[BatchNorm]) -> float:
        """Largest logit difference between the masked model and the physically pruned ``copy`` after both
        re-estimate the affected BatchNorm statistics on the example batch (train-mode statistics must agree too)."""
        example = [self.example_input]  # one calibration batch of images
        with masked(self.graph, group), reestimated(self.model, layers, example), torch.inference_mode():
            masked_logits = self.model(self.images).float()
        reestimate(copy, layers_in_copy(self.model, copy, layers), example)
        with torch.inference_mode():
            return float((masked_logits - copy(self.images).float()).abs().max())
