"""The metrics a variant is scored by, each described once: every step (config, losses, sampling, plans, reports)
reads its facts here instead of keeping its own list of names.

Adding a metric means adding one :class:`Metric` to :data:`METRICS` (and, if it is computed from logits in a new way,
teaching :mod:`analysis.engine.evaluate` or :mod:`analysis.engine.fidelity` to compute it).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Metric:
    """What a metric is, as far as losses, sampling, plans and reports care.

    Attributes:
        name: Its key in the metrics of a pass and in the sidecar.
        higher_is_better: Direction: a loss is positive when the metric moved the other way.
        label_free: Compares each image with the unpruned model's own output (no labels needed; the baseline pass
            keeps the dense outputs).
        continuous: Its per-image values are not just 0/1 (adaptive precision estimates their variance directly).
        bounded: A fraction in [0, 1] (an accuracy or an agreement), so a relative loss is at most 1.
        scaled: ``metric_mode: relative`` divides its loss by the baseline (False where the baseline is 0 by
            definition: the loss is then the metric itself in both modes).
        ranked_by: The metric a measured plan's finalists are chosen by after an analysis of this metric: the metric
            itself where plans are scored against labels, else ``top1`` (the joint evaluation uses labels).
        meaning: What its loss means, for reports (label-free metrics, whose loss is not an accuracy drop).
        user: Offered in the YAML's ``SensitivityAnalysis.metric`` (False: set by a Python API only).
    """

    name: str
    higher_is_better: bool
    label_free: bool = False
    continuous: bool = False
    bounded: bool = False
    scaled: bool = True
    ranked_by: str = ""
    meaning: str = ""
    user: bool = True

    def divides_by_baseline(self, mode: str) -> bool:
        """Whether a loss in ``mode`` (``relative`` or ``absolute``) is divided by the baseline."""
        return mode == "relative" and self.scaled

    def worse_by(self, baseline: float, value: float) -> float:
        """How much worse ``value`` is than ``baseline`` (positive: worse)."""
        return baseline - value if self.higher_is_better else value - baseline

    def better_first(self, value: float) -> float:
        """A sort key: larger is better."""
        return value if self.higher_is_better else -value


METRICS: dict[str, Metric] = {
    metric.name: metric
    for metric in (
        Metric("top1", higher_is_better=True, bounded=True, ranked_by="top1"),
        Metric("top5", higher_is_better=True, bounded=True, ranked_by="top5"),
        Metric("ce", higher_is_better=False, continuous=True, ranked_by="ce"),
        Metric(
            "agreement",
            higher_is_better=True,
            label_free=True,
            bounded=True,
            ranked_by="top1",
            meaning="1 - agreement: the share of images whose top-1 class differs from the unpruned model's",
        ),
        Metric(
            "kl",
            higher_is_better=False,
            label_free=True,
            continuous=True,
            # KL(p_dense || p_pruned) is 0 for the dense model by definition, so a loss relative to the baseline
            # would divide by zero for every model; both modes record the divergence itself, which already is
            # measured from the dense model (in nats; 0 = the dense model's predictions exactly).
            scaled=False,
            ranked_by="top1",
            meaning="mean KL(p_unpruned || p_pruned) in nats over the images",
        ),
        # NNI's SensitivityAnalysis: the number the user's evaluator returns, higher is better.
        Metric("score", higher_is_better=True, continuous=True, ranked_by="top1", user=False),
    )
}
"""Every metric, by name."""

METRIC_NAMES = tuple(name for name, metric in METRICS.items() if metric.user)
"""The values of ``SensitivityAnalysis.metric``."""

LABEL_FREE_METRICS = tuple(name for name, metric in METRICS.items() if metric.label_free)
"""The metrics that need no labels."""


def metric_named(name: str) -> Metric:
    """The :class:`Metric` called ``name`` (a name from a validated config or a Python API).

    Raises:
        KeyError: For a name no metric has (the config refuses those with a message before this is reached).
    """
    return METRICS[name]
