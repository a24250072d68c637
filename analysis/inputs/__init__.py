"""Inputs of a job: the evaluation and calibration images, the model, the device, and a job's assembled inputs."""
