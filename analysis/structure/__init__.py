"""What pruning a unit means: prunable units and their coupled channel groups (Torch-Pruning, with customised
pruners for layers it does not know), channel criteria, masking, physical removal, element-wise slices and
MACs/params costs."""
