"""What one analysis run is given: how variants are built and scored (:class:`EngineSettings`) and what it evaluates
on (:class:`AnalysisData`).

The defaults of every setting live in one place, the YAML schema (:class:`analysis.config.SensitivityConfig`):
:meth:`EngineSettings.from_section` builds the settings from a section, and the Python APIs build a section from
their own arguments.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from analysis.config import Sampling, SensitivityConfig
from analysis.early_stop import EarlyStop, early_stop_from

Metrics = dict[str, float]
Evaluator = Callable[[nn.Module], Metrics]
Batches = Iterable[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class DecisionSettings:
    """Decision-driven sampling (``precision: decision``): the target each variant is settled against, the chance
    that any decision of the run is wrong, and how many variants that chance is split over (every variant of the
    analysis, set by :func:`analysis.workflow.analyse.run_analysis` before sharding; 0 until then)."""

    target: float
    error: float
    variants: int = 0


@dataclass(frozen=True, kw_only=True)
class EngineSettings:
    """How variants are built and scored; built by :meth:`from_section` (no defaults here, see the module doc)."""

    ratios: Sequence[float]
    criterion: str
    group_reduction: str
    metric: str
    metric_mode: str
    engine: str
    precision: float | None
    seed: int
    granularity: str
    early_stop: EarlyStop | None
    round_to: int
    adaptive_bn: bool
    numerics: str = "exact"
    decision: DecisionSettings | None = None
    progress: bool | None = None

    @property
    def sampled(self) -> bool:
        """Whether variants may see only part of the images (adaptive precision or decision-driven sampling)."""
        return self.precision is not None or self.decision is not None

    @classmethod
    def from_section(
        cls,
        section: SensitivityConfig,
        *,
        seed: int = 0,
        numerics: str = "exact",
        progress: bool | None = None,
        **overrides: Any,
    ) -> EngineSettings:
        """The settings of a ``SensitivityAnalysis`` section with ``Global.seed`` and ``Global.numerics``
        (``overrides`` replace single values, e.g. a metric the YAML schema does not offer, or an
        :class:`EarlyStop` built elsewhere)."""
        sampling = Sampling(section.precision, section.decision_error, section.decision_precision)
        decision = None
        if sampling.decision:
            assert section.target_loss is not None  # checked with the config
            decision = DecisionSettings(float(section.target_loss), float(section.decision_error))
        precision = section.decision_precision if sampling.decision else section.precision
        values: dict[str, Any] = {
            "ratios": section.pruned_ratios,
            "criterion": section.criterion,
            "group_reduction": section.group_reduction,
            "metric": section.metric,
            "metric_mode": section.metric_mode,
            "engine": section.engine,
            "precision": None if precision is None else float(precision),
            "decision": decision,
            "seed": seed,
            "granularity": section.granularity,
            "early_stop": early_stop_from(section.early_stop_mode, section.early_stop_value),
            "round_to": section.round_to,
            "adaptive_bn": section.adaptive_bn,
            "numerics": numerics,
            "progress": progress,
        }
        return cls(**{**values, **overrides})

    def fingerprint(self, calibration: str | None = None) -> dict[str, Any]:
        """The settings an analysis file's numbers depend on (a file resumes only under the same ones); keys that
        earlier versions did not write are left out at their default, so those files still resume.

        Args:
            calibration: Fingerprint of the calibration images (part of it with ``adaptive_bn``).
        """
        return {
            "criterion": self.criterion,
            "group_reduction": self.group_reduction,
            "metric": self.metric,
            "metric_mode": self.metric_mode,
            # exact and estimated losses never mix in one file
            "precision": None if self.precision is None else [self.precision, self.seed],
            # decision-driven files hold losses settled against one target: they resume only for that target
            **({"decision": [self.decision.target, self.decision.error, self.seed]} if self.decision else {}),
            **({"granularity": "element"} if self.granularity == "element" else {}),
            **({"round_to": self.round_to} if self.round_to > 1 else {}),
            **({"adaptive_bn": True, "calibration": calibration} if self.adaptive_bn else {}),
            # approximate losses never mix with exact ones, nor those of two speed modes
            **({"numerics": self.numerics} if self.numerics != "exact" else {}),
        }


@dataclass
class AnalysisData:
    """What variants are evaluated on.

    Attributes:
        evaluate: Returns the metrics of a model (keys include the settings' metric).
        example_input: A batch used to trace dependencies and to check masking against physical pruning.
        batches: The evaluation data as re-iterable batches, which the fast engine needs (``evaluate`` must compute
            its metrics over exactly these batches); None runs the reference engine.
        fingerprint: Identifies the evaluation data and preprocessing (None when unknown, e.g. a callable).
        calibration: Batches on which ``adaptive_bn`` re-estimates the affected BatchNorm statistics of each variant.
        calibration_fingerprint: Identifies those images and their preprocessing.
    """

    evaluate: Evaluator
    example_input: torch.Tensor
    batches: Batches | None = None
    fingerprint: str | None = None
    calibration: Batches | None = None
    calibration_fingerprint: str | None = None
