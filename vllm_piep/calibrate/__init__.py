"""The offline toolkit: train, export, evaluate and report (`python -m vllm_piep.calibrate`)."""
