"""The names of the files an export writes into its folder (:mod:`analysis.planning.export` and the export step of
:mod:`analysis.workflow.export` write them): the output checks refuse an export folder where one of them would
overwrite an input, and a new export removes those an older one left that it does not write itself."""

from __future__ import annotations

MODEL_FILE = "pruned_model.pt"
"""The whole pruned ``nn.Module``, pickled."""
STATE_DICT_FILE = "pruned_state_dict.pt"
"""The pruned weights alone."""
CHANNELS_FILE = "pruned_channels.json"
"""The shapes of the layers the pruning changed, the plan, and how the export was checked."""
RATIOS_FILE = "channel_prune.yaml"
"""The applied ratios as an ACT ``ChannelPrune`` block."""
ONNX_FILE = "pruned_model.onnx"
"""The pruned model as ONNX (with the onnx extra and ``SensitivityAnalysis.export_onnx``)."""

EXPORT_FILES = (MODEL_FILE, STATE_DICT_FILE, CHANNELS_FILE, RATIOS_FILE, ONNX_FILE)
"""Every file an export may write."""
