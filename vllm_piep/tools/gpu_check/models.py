"""Random-weight models of real shapes, built with transformers from their configs (no
download), and the steps the sections run on them: prefill, batched decode on a static KV
cache, and a packed step of several requests' tokens."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_piep.model.flops import StepBatch, parameter_counts
from vllm_piep.model.shape import ModelShape
from vllm_piep.tools.gpu_check.backend import Backend

CONFIGS = Path(__file__).with_name("models.json")
GIB = 2**30
MEMORY_MARGIN = 4 * GIB  # activations, the allocator's slack, cuBLAS workspaces


def config_of(name: str, variant: str, layers: int | None = None) -> dict[str, Any]:
    entry = json.loads(CONFIGS.read_text())[name]
    config = dict(entry["config"])
    if variant == "dry":
        config.update(entry["dry"])
    if layers is not None:
        config["num_hidden_layers"] = layers
    return config


def dtype_bytes(config: dict[str, Any]) -> int:
    return 4 if config.get("torch_dtype") == "float32" else 2


def layers_that_fit(config: dict[str, Any], free_bytes: int, batch: int, cache_len: int
                    ) -> int:
    """The decoder layers whose weights, and a static KV cache of `batch` x `cache_len`, fit
    in `free_bytes` (all of them when they do)."""
    size = dtype_bytes(config)
    layers = int(config["num_hidden_layers"])
    shape = ModelShape.from_hf_config(config, size)
    total, _ = parameter_counts(shape)
    outside = 2 * shape.vocab * shape.hidden  # embedding and LM head
    per_layer = (total - outside) / layers * size
    kv = batch * cache_len * 2 * shape.kv_heads * shape.head_dim * size
    room = free_bytes - outside * size - MEMORY_MARGIN
    return max(1, min(layers, math.floor(room / (per_layer + kv))))


@dataclass
class LoadedModel:
    name: str
    config: dict[str, Any]
    model: Any
    shape: ModelShape
    backend: Backend
    notes: list[str] = field(default_factory=list)

    @property
    def architecture(self) -> str:
        return str(self.config["architectures"][0])

    def ids(self, *size: int) -> Any:
        import torch

        return torch.randint(0, int(self.config["vocab_size"]), size, device=self.backend.device)

    def forward(self, **kwargs: Any) -> Any:
        import torch

        with torch.inference_mode():
            return self.model(**kwargs)

    def prefill(self, requests: int, tokens: int) -> tuple[Any, StepBatch]:
        """A step computing `requests` prompts of `tokens` each (logits of the last token of
        each, as vLLM samples), and its batch as the scheduler would describe it."""
        ids = self.ids(requests, tokens)

        def step() -> None:
            out = self.forward(input_ids=ids, use_cache=False, logits_to_keep=1)
            out.logits[:, -1].argmax(-1)

        return step, StepBatch.from_rows([(tokens, 0, 0, 1)] * requests)

    def decoder(self, batch: int, context: int, positions: int) -> DecodeRunner:
        return DecodeRunner(self, batch, context, positions)

    def packed(self, tokens: int, last: list[int]) -> None:
        """One step of several requests' tokens packed in one sequence (no KV cache): the
        forward pass of `tokens` tokens, logits at the positions in `last`."""
        import torch

        index = torch.tensor(last, device=self.backend.device)
        out = self.forward(input_ids=self.ids(1, tokens), use_cache=False,
                           logits_to_keep=index)
        out.logits[0].argmax(-1)

    def release(self) -> None:
        import gc

        import torch

        self.model = None
        gc.collect()
        if self.backend.device == "cuda":
            torch.cuda.empty_cache()


class DecodeRunner:
    """Batched decode steps on a static KV cache of `context + positions` positions, filled
    with random keys and values. The step writes position `context + i` (wrapping after
    `positions` steps) and attends to every position of the cache: transformers drops the
    mask of a one-token query, so its batch says so (context: all the cache's positions)."""

    def __init__(self, lm: LoadedModel, batch: int, context: int, positions: int) -> None:
        from transformers import StaticCache

        self.lm, self.batch, self.context, self.positions = lm, batch, context, positions
        self.cache = StaticCache(config=lm.model.config, max_cache_len=context + positions)
        self.ids = lm.ids(batch, 1)
        self.i = 0
        self._run(context + positions - 1)  # allocates the cache's layers
        import torch

        with torch.inference_mode():
            for layer in getattr(self.cache, "layers", ()):
                for name in ("keys", "values"):
                    tensor = getattr(layer, name, None)
                    if tensor is not None and hasattr(tensor, "normal_"):
                        tensor.normal_()

    def _run(self, position: int) -> None:
        import torch

        device = self.lm.backend.device
        with torch.inference_mode():  # newer transformers write where the layer counts, not
            for layer in getattr(self.cache, "layers", ()):  # at `cache_position`
                length = getattr(layer, "cumulative_length", None)
                if isinstance(length, torch.Tensor):
                    length.fill_(position)
        out = self.lm.forward(input_ids=self.ids, past_key_values=self.cache, use_cache=True,
                              cache_position=torch.tensor([position], device=device),
                              position_ids=torch.full((self.batch, 1), position, device=device))
        self.ids = out.logits[:, -1:].argmax(-1)

    def step(self) -> StepBatch:
        self._run(self.context + self.i % self.positions)
        self.i += 1
        return self.batch_work

    @property
    def batch_work(self) -> StepBatch:
        return StepBatch.from_rows([(0, 1, self.context + self.positions - 1, 1)] * self.batch)


def build(backend: Backend, name: str, layers: int | None = None) -> LoadedModel:
    """The model `name` of `models.json` with random weights, on the backend's device; with
    `layers`, only that many decoder layers (the shape says so)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = config_of(name, backend.model_variant, layers)
    fields = {k: v for k, v in config.items() if k not in ("architectures", "model_type",
                                                           "torch_dtype")}
    hf_config = AutoConfig.for_model(config["model_type"], **fields)
    dtype = torch.float32 if dtype_bytes(config) == 4 else backend.dtype
    with torch.device(backend.device):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype,
                                                 attn_implementation="sdpa")
    model.eval()
    shape = ModelShape.from_hf_config(config, dtype_bytes(config))
    return LoadedModel(name, config, model, shape, backend)
