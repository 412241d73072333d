"""vllm_piep: per-request energy for vLLM (PIE-P on IrEne's model tree).

Importing this package does not import vLLM; `vllm_piep.runtime.install` is the only part that does.
"""

__version__ = "0.1.0"
