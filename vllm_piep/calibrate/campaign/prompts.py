"""The prompts of a campaign: random token ids from the model's vocabulary, the same in every
attempt and campaign for the same seed, cell and request."""

from __future__ import annotations

import json
import random
from pathlib import Path

from vllm_piep.calibrate.campaign.plan import CampaignError

# Token ids below this are left out of prompts: Llama-style vocabularies keep their special
# tokens (<unk>, <s>, </s>, padding) there.
FIRST_PROMPT_ID = 4


def vocab_size(model: str) -> int:
    """From the model's config.json (the text model's, for a multimodal one)."""
    path = Path(model) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CampaignError(f"cannot read the model's config ({path}): {exc}") from exc
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    if not isinstance(size, int) or size <= FIRST_PROMPT_ID:
        raise CampaignError(f"{path}: no usable vocab_size ({size!r})")
    return size


def prompt_ids(seed: int, cell: str, request: int, length: int, vocab: int) -> list[int]:
    """The same token ids for the same (seed, cell, request) in every attempt and campaign, and
    different ones across requests, so that no request hits another's prefix cache."""
    rng = random.Random(f"{seed}:{cell}:{request}")
    return [rng.randrange(FIRST_PROMPT_ID, vocab) for _ in range(length)]
