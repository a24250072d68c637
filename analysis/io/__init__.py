"""Files: the analysis pickle (PaddleSlim's format), its JSON sidecar, the two read once as one analysis record, CSV
exports, the atomic store of a run in progress, its lock and fingerprints, the plan search log."""
