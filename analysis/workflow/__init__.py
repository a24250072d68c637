"""The pipeline as plain functions over typed records: analyse a model, then plan, verify, re-estimate and export.

The command line, torchrun ranks and both Python APIs call these functions, so every entry writes the same files.
"""
