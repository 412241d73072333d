"""Offline inference (`vllm.LLM`): `LLMEngine.step`'s finished outputs take their records out of
the ledger as `energy` (all samples of n > 1 together), unfinished ones are left alone; a `piep`
key in the engine's additional config turns the plugin on. With fakes: the real run is
tests/e2e/test_offline_llm.py."""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import pytest

from vllm_piep.config import ConfigError, PiepConfig
from vllm_piep.model.components import N_COMPONENTS
from vllm_piep.runtime import cli, start_checks
from vllm_piep.runtime.api_server import offline, response_ids
from vllm_piep.runtime.api_server import outputs as api
from vllm_piep.runtime.api_server.ledger import EnergyLedger
from vllm_piep.runtime.record import StepHeader, WireRecord


def row(prefill: float, decode: float, complete: bool = True) -> bytes:
    per = (prefill + decode) / N_COMPONENTS
    return WireRecord("prior", "prior/x", complete, prefill, decode,
                      (per,) * N_COMPONENTS).to_wire()


HEADER = StepHeader("prior", "prior/x", "0", 0.0, 0, True)


def finished_request(book: EnergyLedger, internal: str, owner: str, prefill: float,
                     decode: float, complete: bool = True) -> None:
    book.update(internal, owner, HEADER, row(prefill, decode, complete))
    book.close(internal, "finished")


def output(owner: str | None, tokens: list[int], finished: bool = True) -> SimpleNamespace:
    """An output of request `ext-<owner>`; a finished one's owner noted as vLLM's finish
    does (`outputs._wrap_finish_request`), with its external id."""
    external = f"ext-{owner}"
    if owner is not None and finished:
        response_ids.remember_finished_owners()
        response_ids.note_finished(SimpleNamespace(parent_req=None, request_id=owner,
                                                   external_req_id=external))
    return SimpleNamespace(request_id=external, finished=finished,
                           outputs=[SimpleNamespace(token_ids=list(range(n))) for n in tokens])


@pytest.fixture(autouse=True)
def fresh_owners(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(response_ids, "_finished", None)


@pytest.fixture
def book(monkeypatch: pytest.MonkeyPatch) -> EnergyLedger:
    book = EnergyLedger()
    monkeypatch.setattr(api, "_ledger", book)
    return book


def step_returning(*outs: Any) -> Any:
    return offline._wrap_step(lambda self: list(outs))


def test_a_finished_output_takes_all_its_samples_records(book: EnergyLedger) -> None:
    finished_request(book, "0_a", "0", prefill=1.0, decode=2.0)  # n = 2: two child requests
    finished_request(book, "1_a", "0", prefill=1.0, decode=4.0)
    out = output("0", tokens=[3, 5])
    [returned] = step_returning(out)(None)
    energy = out.energy
    assert returned is out
    assert energy.joules == pytest.approx(8.0)
    assert (energy.prefill_joules, energy.decode_joules) == pytest.approx((2.0, 6.0))
    assert energy.joules_per_output_token == pytest.approx(1.0)  # 8 J over 3 + 5 tokens
    assert energy.source == "prior" and energy.bundle == "prior/x"
    assert book.size == (0, 0)  # nothing kept once the output has it


def test_unfinished_outputs_are_left_alone_and_keep_their_records(book: EnergyLedger) -> None:
    book.update("7", "7", HEADER, row(1.0, 1.0))
    out = output("7", tokens=[2], finished=False)
    step_returning(out)(None)
    assert not hasattr(out, offline.ENERGY_ATTR)
    assert book.size == (1, 0)


def test_an_unaccounted_step_or_an_unknown_owner_gives_none(book: EnergyLedger) -> None:
    finished_request(book, "3", "3", 1.0, 1.0, complete=False)
    incomplete, unowned = output("3", [2]), output(None, [2])
    step_returning(incomplete, unowned)(None)
    assert incomplete.energy is None and unowned.energy is None
    assert book.size == (0, 0)


def test_a_sample_of_n_is_known_by_its_parents_request_id(book: EnergyLedger) -> None:
    finished_request(book, "0_p", "p", prefill=1.0, decode=1.0)
    response_ids.remember_finished_owners()
    parent = SimpleNamespace(request_id="p", external_req_id="ext-p")
    response_ids.note_finished(SimpleNamespace(parent_req=parent, request_id="0_p",
                                               external_req_id="ext-0_p"))
    out = SimpleNamespace(request_id="ext-p", finished=True,
                          outputs=[SimpleNamespace(token_ids=[1, 2])])
    step_returning(out)(None)
    assert out.energy.joules == pytest.approx(2.0)
    assert response_ids.finished_owner("ext-p") is None  # taken once


def test_a_failing_ledger_leaves_vllms_outputs_intact(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> EnergyLedger:
        raise RuntimeError("injected failure")

    monkeypatch.setattr(offline, "ledger", broken)
    out = output("0", [1])
    assert step_returning(out)(None) == [out]
    assert not hasattr(out, offline.ENERGY_ATTR)


def engine_args(additional_config: Any) -> SimpleNamespace:
    return SimpleNamespace(additional_config=additional_config, tensor_parallel_size=1,
                           pipeline_parallel_size=1, data_parallel_size=1,
                           data_parallel_size_local=None)


@pytest.fixture
def switches(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The plugin off in a clean environment; records activations instead of patching."""
    monkeypatch.setenv("PIEP_ENABLED", "0")  # restored (removed) after the test
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.delenv("VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY", raising=False)
    activations: list[str] = []
    monkeypatch.setattr(cli, "_activate", lambda: activations.append("on"))
    # vLLM's config is a stand-in here: what the options name is checked in test_start_checks.
    monkeypatch.setattr(start_checks, "check_settings",
                        lambda config, *_: activations.append("checked"))
    monkeypatch.setattr(api, "_config", None)
    monkeypatch.setattr(api, "_cuda_devices", None)
    return activations


def test_a_piep_key_in_additional_config_turns_the_plugin_on(switches: list[str]) -> None:
    create = cli._wrap_create_engine_config(lambda self: "vllm config")
    assert create(engine_args({"piep": {"carbon_intensity": 100.0}})) == "vllm config"
    assert os.environ["PIEP_ENABLED"] == "1" and switches == ["on", "checked"]
    assert api._config == PiepConfig(carbon_intensity=100.0) and api._cuda_devices == 1


def test_without_a_piep_key_nothing_changes(switches: list[str]) -> None:
    create = cli._wrap_create_engine_config(lambda self: "vllm config")
    assert create(engine_args({"other_plugin": {}})) == "vllm config"
    assert os.environ["PIEP_ENABLED"] == "0" and switches == [] and api._config is None


def test_bad_piep_options_in_additional_config_are_refused_by_name(switches: list[str]) -> None:
    create = cli._wrap_create_engine_config(lambda self: "vllm config")
    with pytest.raises(ConfigError, match="carbon_intensity"):
        create(engine_args({"piep": {"carbon_intensity": -1}}))
    assert os.environ["PIEP_ENABLED"] == "0" and switches == []  # not turned on half-way
