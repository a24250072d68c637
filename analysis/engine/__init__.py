"""The analysis run: the reference engine, the fast engine (torch.fx prefix reuse), adaptive precision, early stop,
BatchNorm re-estimation and evaluation."""
