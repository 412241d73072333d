"""`python -m vllm_piep.meter`: the singular spelling of `python -m vllm_piep.meters` (the CLI that
measures a window or a command's run); the meters themselves live in `vllm_piep.meters`."""
