"""What pruning a conv means: prunable params and their coupled channel groups (Torch-Pruning), channel criteria,
masking, physical removal, element-wise slices and MACs/params costs."""
