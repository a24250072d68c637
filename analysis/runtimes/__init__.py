"""Measuring what a model costs where it is deployed: latency on a runtime (torch eager, ONNX Runtime, or any
command given an ONNX file), and the ONNX export those runtimes read, checked against PyTorch."""
