"""Scale-out: torchrun ranks and deterministic shards of the prunable params, merged into one analysis file."""
