"""Drop-in APIs of other tools: PaddleSlim's analysis_prune and NNI's SensitivityAnalysis, ChannelDependency, counters
and mask-conflict fixing."""
