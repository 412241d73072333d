"""The signed hand-off of a disaggregated prefill's energy (`vllm_piep.peer_energy`): accepted
only when signed with the peer key, for its own request, once and in time; anything else is
dropped and counted, never added."""

from __future__ import annotations

import math

import pytest

from vllm_piep.model.components import COMPONENTS
from vllm_piep.peer_energy import (
    MAX_AGE_S,
    PART_KEY,
    PartReader,
    Received,
    combine,
    figures_of,
    sign_part,
)

KEY = b"a shared secret of the fleet"
NOW = 1_800_000_000.0


def usage_energy(joules: float, source: str = "prior", bundle: str = "prior/x",
                 prefill_share: float = 0.75) -> dict:
    breakdown = {name: joules * (i + 1) / math.fsum(range(1, len(COMPONENTS) + 1))
                 for i, name in enumerate(COMPONENTS)}
    total = math.fsum(breakdown.values())
    return {"joules": total, "joules_per_output_token": total, "prefill_joules":
            total * prefill_share, "decode_joules": total * (1 - prefill_share),
            "breakdown": breakdown, "interval": (0.9 * total, 1.1 * total),
            "interval_level": 0.9, "bundle": bundle, "source": source}


class Rejections:
    def __init__(self) -> None:
        self.reasons: list[str] = []

    def __call__(self, reason: str) -> None:
        self.reasons.append(reason)


def reader(key: bytes | None = KEY, now: float = NOW) -> tuple[PartReader, Rejections]:
    rejected = Rejections()
    return PartReader(key, clock=lambda: now, on_rejected=rejected), rejected


def test_a_signed_part_is_read_back_whole_for_the_same_request_under_either_endpoint() -> None:
    energy = usage_energy(12.5)
    part = sign_part(energy, "cmpl-abc", KEY, now=NOW)
    got, rejected = reader()
    received = got.read(part, "chatcmpl-abc")  # prefill by completions, decode by chat
    assert received == Received(role="prefill", figures=figures_of(energy), verified=True)
    assert rejected.reasons == []


@pytest.mark.parametrize(("change", "reason"), [
    (lambda p: p["figures"].update(joules=p["figures"]["joules"] * 10), "bad_signature"),
    (lambda p: p["figures"].update(joules=0.0), "bad_signature"),  # lowered: refused too
    (lambda p: p.update(sig=None), "bad_signature"),
    (lambda p: p.update(sig="0" * 64), "bad_signature"),
    (lambda p: p.update(request_id="other"), "bad_signature"),  # signed over the id
    (lambda p: p.update(issued_at=NOW + 1), "bad_signature"),
    (lambda p: p.update(v=2), "malformed"),
    (lambda p: p.update(extra=1), "malformed"),
    (lambda p: p["figures"].update(joules=-1.0), "malformed"),
    (lambda p: p["figures"].update(joules=float("nan")), "malformed"),
])
def test_a_changed_part_is_dropped_and_counted(change, reason: str) -> None:
    part = sign_part(usage_energy(3.0), "cmpl-abc", KEY, now=NOW)
    change(part)
    got, rejected = reader()
    assert got.read(part, "cmpl-abc") is None
    assert rejected.reasons == [reason]


@pytest.mark.parametrize("raw", [None, "a string", 7, [], {"v": 1}])
def test_what_is_not_a_part_is_malformed(raw: object) -> None:
    got, rejected = reader()
    assert got.read(raw, "cmpl-abc") is None and rejected.reasons == ["malformed"]


def test_another_key_another_request_too_old_or_seen_before_is_dropped() -> None:
    part = sign_part(usage_energy(3.0), "cmpl-abc", b"another fleet's key", now=NOW)
    got, rejected = reader()
    assert got.read(part, "cmpl-abc") is None

    part = sign_part(usage_energy(3.0), "cmpl-abc", KEY, now=NOW)
    assert got.read(part, "cmpl-xyz") is None  # a part carried into another request

    old = sign_part(usage_energy(3.0), "cmpl-abc", KEY, now=NOW - MAX_AGE_S - 1)
    assert got.read(old, "cmpl-abc") is None
    assert reader(now=NOW - MAX_AGE_S + 1)[0].read(
        sign_part(usage_energy(3.0), "cmpl-abc", KEY, now=NOW), "cmpl-abc") is not None

    assert got.read(part, "cmpl-abc") is not None
    assert got.read(part, "cmpl-abc") is None  # the same part a second time
    assert rejected.reasons == ["bad_signature", "other_request", "expired", "replayed"]


def test_without_a_key_a_part_is_shown_unverified_and_not_added() -> None:
    prefill, decode = usage_energy(40.0), usage_energy(10.0, prefill_share=0.0)
    part = sign_part(prefill, "cmpl-abc", None, now=NOW)
    assert part["sig"] is None
    received = reader(key=None)[0].read(part, "cmpl-whatever")
    assert received is not None and not received.verified
    out = combine(decode, [received], completion_tokens=5)
    assert out["joules"] == decode["joules"]
    assert out["instances"] == [
        {"role": "prefill", "joules": prefill["joules"], "source": "prior",
         "bundle": "prior/x", "verified": False},
        {"role": "decode", "joules": decode["joules"], "source": "prior", "bundle": "prior/x",
         "verified": True}]
    assert out["interval"] == decode["interval"]  # nothing added: the decode's own interval
    # With a key, an unsigned part is not the peer's: dropped.
    assert reader()[0].read(part, "cmpl-abc") is None


def test_combine_adds_the_verified_part_everywhere_the_response_says_energy() -> None:
    prefill = usage_energy(40.0, source="measured", bundle="nvml")
    decode = usage_energy(10.0, prefill_share=0.0)
    received = reader()[0].read(sign_part(prefill, "cmpl-abc", KEY, now=NOW), "cmpl-abc")
    assert received is not None
    out = combine(decode, [received], completion_tokens=4)
    assert out["joules"] == pytest.approx(prefill["joules"] + decode["joules"], rel=1e-12)
    assert out["joules_per_output_token"] == pytest.approx(out["joules"] / 4, rel=1e-12)
    assert out["prefill_joules"] == pytest.approx(prefill["prefill_joules"], rel=1e-12)
    assert out["decode_joules"] == pytest.approx(
        prefill["decode_joules"] + decode["decode_joules"], rel=1e-12)
    assert list(out["breakdown"]) == list(decode["breakdown"])
    for name in COMPONENTS:
        assert out["breakdown"][name] == pytest.approx(
            prefill["breakdown"][name] + decode["breakdown"][name], rel=1e-12)
    assert math.fsum(out["breakdown"].values()) == pytest.approx(out["joules"], rel=1e-12)
    assert out["source"] == "mixed" and out["bundle"] == "nvml,prior/x"
    assert out["interval"] is None and out["interval_level"] is None
    assert [(i["role"], i["verified"]) for i in out["instances"]] == [("prefill", True),
                                                                      ("decode", True)]
    assert decode["joules"] == usage_energy(10.0, prefill_share=0.0)["joules"]  # not mutated


def test_the_part_lives_under_one_key_beside_the_connectors_params() -> None:
    params = {"remote_engine_id": "e", "remote_block_ids": [1, 2],
              PART_KEY: sign_part(usage_energy(1.0), "cmpl-a", KEY, now=NOW)}
    assert set(params) - {PART_KEY} == {"remote_engine_id", "remote_block_ids"}
    assert set(params[PART_KEY]) == {"v", "role", "request_id", "issued_at", "figures", "sig"}
