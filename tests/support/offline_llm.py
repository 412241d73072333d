"""Offline inference in its own process, for tests/e2e/test_offline_llm.py: `vllm.LLM` on a model,
a warm-up, then `generate` (several prompts, and one prompt with n = 3 samples) and `chat`;
writes what each RequestOutput carries, the records each output took from the ledger, what
the ledger holds afterwards and the engine's step energy over the same calls, as JSON.

    python offline_llm.py MODEL OUT.json [--additional-config JSON]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

COUNTERS = ("piep_engine_step_joules_total", "piep_request_outcome_joules_total")


def counters() -> dict[str, float]:
    """The plugin's step and outcome counters in this process, by outcome."""
    from prometheus_client import REGISTRY

    found: dict[str, float] = {}
    for family in REGISTRY.collect():
        for sample in family.samples:
            if sample.name in COUNTERS:
                key = sample.name + "/" + sample.labels.get("outcome", "")
                found[key] = found.get(key, 0.0) + sample.value
    return found


def describe(kind: str, output: Any, records: dict[str, int], owners: dict[str, str | None]
             ) -> dict[str, Any]:
    energy = getattr(output, "energy", "absent")
    owner = owners.get(output.request_id)
    return {
        "kind": kind,
        "finished": output.finished,
        "has_energy": energy != "absent",
        "energy": None if energy in ("absent", None) else energy.model_dump(),
        "completion_tokens": sum(len(c.token_ids) for c in output.outputs),
        "samples": len(output.outputs),
        "records": records.get(owner, 0) if owner is not None else 0,
    }


def tap_ledger() -> dict[str, int]:
    """Records each owner took from the ledger (the plugin's own `take`, counted)."""
    from vllm_piep.runtime.api_server.ledger import EnergyLedger

    taken: dict[str, int] = {}
    original = EnergyLedger.take

    def take(self: EnergyLedger, owners: Any, returned: bool = True) -> Any:
        owners = list(owners)
        records = original(self, owners, returned)
        for owner in owners:
            taken[owner] = taken.get(owner, 0) + len(records)
        return records

    EnergyLedger.take = take  # type: ignore[method-assign]
    return taken


def tap_owners() -> dict[str, str | None]:
    """The owner the plugin found for each finished output, by the output's request id."""
    from vllm_piep.runtime.api_server import offline

    found: dict[str, str | None] = {}
    original = offline.finished_owner

    def finished_owner(external_id: str) -> str | None:
        found[external_id] = original(external_id)
        return found[external_id]

    offline.finished_owner = finished_owner  # type: ignore[assignment]
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out", type=Path)
    parser.add_argument("--additional-config", type=json.loads, default=None)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    records, owners = tap_ledger(), tap_owners()
    extra = {} if args.additional_config is None else {
        "additional_config": args.additional_config}
    llm = LLM(model=args.model, dtype="float32", max_model_len=256, enforce_eager=True,
              seed=0, **extra)
    llm.generate(["warm up"], SamplingParams(max_tokens=2), use_tqdm=False)

    before = counters()
    lengths = [3, 6, 9, 12]
    prompts = [f"value_{n} = " for n in lengths]
    greedy = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0) for n in lengths]
    plain = llm.generate(prompts, greedy, use_tqdm=False)
    samples = llm.generate(["x = "], SamplingParams(n=3, max_tokens=5, ignore_eos=True,
                                                    temperature=1.0, seed=1), use_tqdm=False)
    chat = llm.chat([{"role": "user", "content": "hello"}],
                    SamplingParams(max_tokens=4, ignore_eos=True, temperature=0),
                    use_tqdm=False)
    after = counters()

    from vllm_piep.runtime.api_server import outputs

    book = outputs._ledger
    report = {
        "outputs": [*(describe("generate", o, records, owners) for o in plain),
                    *(describe("n3", o, records, owners) for o in samples),
                    *(describe("chat", o, records, owners) for o in chat)],
        "counters": {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after},
        "ledger": None if book is None else {
            "open_closed": list(book.size), "claimed": len(book._claimed)},
        "source": None if book is None or book.last_header is None else
        book.last_header.source,
    }
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
