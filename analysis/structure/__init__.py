"""What pruning a unit means: prunable units and their coupled channel groups (Torch-Pruning), channel criteria,
masking, physical removal, element-wise slices and MACs/params costs."""
