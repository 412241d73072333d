"""The engine core's closed form against vLLM's real scheduler (`support/real_scheduler.py`: the
`Scheduler` or `AsyncScheduler` vLLM's engine core builds, on CPU, without a model, with
preemption, chunked prefill, prefix caching, n-gram speculative decoding, aborts, and model
runner V1's and V2's lists).

The accountant's cheap checks (`accountant.py`, `_regular`) rely on what vLLM's scheduler does
step after step: a cached request that decodes one token goes on one token later with one token
scheduled; a step's scheduled tokens are the tokens it computes from `num_computed_tokens` (the
count before the step), so a prefill chunk's next step starts where it ended; a preempted
request is not scheduled until it resumes, and then recomputes from 0 or its prefix-cache hit;
a new request starts at its prefix-cache hit, which only tokens vLLM has seen can make; and the
lists the plugin keeps by reference stay as `schedule` returned them until the step's update.
The first test watches the real scheduler keep them; the second installs the plugin's wrappers
on it and checks that the served accountant (split rule, closed form, sparse rows) puts on every
output the row the reference (every step predicted whole by the step graph) puts there."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm")

from support.real_scheduler import (  # noqa: E402
    RealLoop,
    Seen,
    Setup,
    Unsupported,
    Updated,
    build_scheduler,
    carried,
    install,
)

from vllm_piep.model.devices import DeviceProfile, cpu_spec  # noqa: E402
from vllm_piep.predict.prior import PriorPredictor  # noqa: E402
from vllm_piep.runtime.engine_core.accountant import EngineAccountant  # noqa: E402
from vllm_piep.runtime.engine_core.scheduled import (  # noqa: E402
    ScheduledStep,
    new_requests,
    raw_step,
    step_batch,
)

SETUPS = {
    "sync": Setup(),
    "async": Setup(async_scheduling=True),
    "sync-ngram": Setup(spec_tokens=3),
    "async-ngram": Setup(async_scheduling=True, spec_tokens=3),
    "sync-v2": Setup(v2_runner=True),
    "async-v2": Setup(async_scheduling=True, v2_runner=True),
    "async-ngram-v2": Setup(async_scheduling=True, spec_tokens=3, v2_runner=True),
}
STEPS = 2000  # schedule calls at most: the workload's requests are done well before
SEEDS = (0, 1, 2, 3)  # workloads per setup


def _scheduler(model: Path, setup: Setup) -> Any:
    try:
        return build_scheduler(model, setup)
    except Unsupported as exc:
        pytest.skip(str(exc))


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class Watch:
    """What the real scheduler shows step after step, checked as it goes (`after_schedule`,
    `before_update`) and across steps (`check_pairs`, `check_preemptions`)."""

    def __init__(self, loop: RealLoop) -> None:
        self.loop = loop
        self.counts: dict[str, int] = dict.fromkeys(("decode pairs", "chunk pairs", "draft pairs",
                                     "preempted", "resumed",
                                     "prefix hits", "spec steps", "aborted in flight",
                                     "ended with a step in flight",
                                     "scheduled after finishing"), 0)
        self.tokens_seen: dict[str, list[int]] = {}  # each request's tokens at its last step
        self.finished: set[str] = set()

    def after_schedule(self, seen: Seen) -> None:
        loop = self.loop
        scheduler = loop.scheduler
        out = seen.output
        # The step as the plugin reads it (`patch_schedule`): every scheduled request once,
        # the cached ones first, with what the accountant needs of each.
        raw = raw_step(out, new_requests(out.scheduled_new_reqs, scheduler.requests))
        assert raw.req_ids == seen.cached + seen.new
        assert sorted(raw.req_ids) == sorted(seen.scheduled)
        assert len(raw.start[0]) == len(raw.outs[0]) == len(seen.cached)
        assert len(raw.start[1]) == len(raw.outs[1]) == len(seen.new)
        assert raw.n() == [seen.scheduled[r] for r in raw.req_ids]
        assert raw.draws() == [1 + len(seen.spec.get(r, ())) for r in raw.req_ids]
        assert raw.new_prompts == {r: scheduler.requests[r].num_prompt_tokens for r in seen.new}
        step = ScheduledStep.of_raw(raw)
        assert step.sched.shape == (4, len(raw.req_ids))
        # The requests whose step the plugin takes to sample (a row of logits each, and one per
        # draft) are those that reach the end of their known tokens.
        prompts = np.array([scheduler.requests[r].num_prompt_tokens for r in raw.req_ids],
                           np.float64)
        rows = step_batch(step.sched, prompts).sampled_rows
        assert {r for r, n in zip(raw.req_ids, rows, strict=True) if n > 0} == seen.sampling
        assert all(n > 0 for n in seen.scheduled.values())
        # Speculative tokens only on requests that sample, after their one known token.
        assert set(seen.spec) <= seen.sampling
        for r, drafts in seen.spec.items():
            assert seen.scheduled[r] >= 1 + len(drafts), (seen.index, r)
        self.counts["spec steps"] += bool(seen.spec)
        assert not seen.preempted & set(seen.scheduled), seen.index
        self.counts["preempted"] += len(seen.preempted)
        self.counts["scheduled after finishing"] += len(self.finished & set(seen.scheduled))
        # A new or resumed request starts at its prefix-cache hit: below its known tokens,
        # and no longer than a prefix of what vLLM has seen: requests' tokens so far, this
        # step's included (vLLM caches a step's full blocks as it schedules them: a prompt
        # shares the blocks of one scheduled before it).
        starting = list(zip(seen.new, seen.new_start, strict=True))
        for r, start in zip(seen.cached, seen.cached_start, strict=True):
            if r in seen.resumed:
                starting.append((r, start))
            else:
                self.tokens_seen[r] = list(scheduler.requests[r].all_token_ids)
        for r, start in starting:
            tokens = list(scheduler.requests[r].all_token_ids)
            assert 0 <= start < seen.known[r], (seen.index, r, start)
            if start:
                self.counts["prefix hits"] += 1
                longest = max(map(partial(_common_prefix, tokens), self.tokens_seen.values()),
                              default=0)
                assert start <= longest, (seen.index, r, start, longest)
            assert start + seen.scheduled[r] <= seen.known[r] + len(seen.spec.get(r, ()))
            self.tokens_seen[r] = tokens

    def before_update(self, seen: Seen) -> None:
        """The lists the plugin keeps by reference are as `schedule` returned them."""
        out = seen.output
        cached = out.scheduled_cached_reqs
        assert list(cached.req_ids) == seen.cached, seen.index
        assert list(cached.num_computed_tokens) == seen.cached_start, seen.index
        assert list(cached.num_output_tokens) == seen.cached_outs, seen.index
        assert [r.num_computed_tokens for r in out.scheduled_new_reqs] == seen.new_start
        assert out.num_scheduled_tokens == seen.scheduled, seen.index
        spec = out.scheduled_spec_decode_tokens or {}
        assert {r: list(t) for r, t in spec.items()} == seen.spec, seen.index

    def after_update(self, update: Updated) -> None:
        step = set(update.seen.scheduled)
        self.counts["aborted in flight"] += len(step & set(update.aborted_before))
        ended = {out.request_id for eo in update.outputs.values() for out in eo.outputs
                 if out.finish_reason is not None}
        ended.update(update.aborted_before, update.aborted_after)
        self.finished |= ended
        # Async scheduling: the next step, already scheduled, may name a request that ended.
        ahead = {r for s in self.loop.seen[update.seen.index + 1:] for r in s.scheduled}
        self.counts["ended with a step in flight"] += len(ended & ahead)
        for r in step:  # what vLLM saw of the step's requests
            self.tokens_seen[r] = list(self.loop.all_requests[r].all_token_ids)

    def check_pairs(self) -> None:
        """Two consecutive steps (that scheduled tokens) of a cached request that did not
        resume in between: the second goes on from where the first ended, less the drafts
        rejected by the updates between the two schedules (the first's with sync scheduling,
        the one before it with async); after a step that sampled, the next computes the
        sampled token and its drafts, nothing else; a one-token decode without drafts goes on
        one token later."""
        loop = self.loop
        steps = [s for s in loop.seen if s.scheduled]
        for a, b in zip(steps, steps[1:], strict=False):
            start_a = dict(zip(a.cached + a.new, a.cached_start + a.new_start, strict=True))
            between = [u for u in loop.updates if a.at < u.at < b.at]
            for r, start in zip(b.cached, b.cached_start, strict=True):
                if r in b.resumed or r not in a.scheduled:
                    continue
                rejected = sum(len(u.seen.spec[r]) - u.accepted[r] for u in between
                               if r in u.seen.spec and r in u.accepted)
                assert start == start_a[r] + a.scheduled[r] - rejected, (a.index, b.index, r)
                if r in a.sampling:
                    assert b.scheduled[r] == 1 + len(b.spec.get(r, ())), (b.index, r)
                if r in a.spec:
                    self.counts["draft pairs"] += 1
                elif a.scheduled[r] == 1 and r in a.sampling:
                    self.counts["decode pairs"] += 1
                    assert start == start_a[r] + 1, (a.index, b.index, r)
                else:
                    self.counts["chunk pairs"] += 1

    def check_preemptions(self, v2_runner: bool) -> None:
        """A preempted request is not scheduled until it resumes: its first step after is a
        resumed one (model runner V1: a cached one named in `resumed_req_ids`; V2: a new
        one), from 0 or its prefix-cache hit (`after_schedule` checks the hit). A request
        resumes only after a preemption."""
        seen = self.loop.seen
        preempted_at: dict[str, int] = {}
        made: set[str] = set()  # requests scheduled before
        for s in seen:
            for r in s.scheduled:
                resumes = r in s.new if v2_runner else r in s.resumed
                if r in preempted_at:
                    assert resumes, (preempted_at[r], s.index, r)
                    del preempted_at[r]
                    self.counts["resumed"] += 1
                else:
                    assert r not in s.resumed and (r not in s.new or r not in made), \
                        (s.index, r)
            made.update(s.scheduled)
            for r in s.preempted:
                preempted_at[r] = s.index


@pytest.mark.parametrize("name", list(SETUPS))
def test_the_real_scheduler_keeps_what_the_closed_form_relies_on(tiny_model: Path,
                                                                 name: str) -> None:
    """`Watch`'s checks on every step of a few seeded workloads; each thing they are about
    happened."""
    setup = SETUPS[name]
    counts: Counter[str] = Counter()
    for seed in SEEDS:
        loop = RealLoop(_scheduler(tiny_model, setup), setup, seed)
        watch = Watch(loop)
        loop.run(STEPS, watch)
        assert not loop.scheduler.requests, f"seed {seed}: the workload did not finish"
        watch.check_pairs()
        watch.check_preemptions(setup.v2_runner)
        counts.update(watch.counts)
    # The workload made the scheduler do each thing the checks are about.
    for what in ("decode pairs", "chunk pairs", "preempted", "resumed", "prefix hits",
                 "aborted in flight"):
        assert counts[what] > 0, (what, counts)
    for what in ("spec steps", "draft pairs"):
        assert (counts[what] > 0) == bool(setup.spec_tokens), (what, counts)
    # A request that ended is never scheduled again; only with async scheduling can the
    # step already scheduled when it ended name it (aborted, or at max_tokens with drafts).
    assert counts["scheduled after finishing"] == 0, counts
    assert (counts["ended with a step in flight"] > 0) == setup.async_scheduling, counts


def _prior(shape: Any) -> PriorPredictor:
    return PriorPredictor(shape, DeviceProfile.from_spec(cpu_spec(cores=2), 4))


def _played(model: Path, setup: Setup, seed: int, acc: EngineAccountant) -> RealLoop:
    loop = RealLoop(_scheduler(model, setup), setup, seed)
    install(loop.scheduler, acc)
    loop.run(STEPS)
    assert not loop.scheduler.requests, "the workload did not finish"
    with acc.lock:
        acc.deferred.run()
    return loop


@pytest.mark.parametrize("name", list(SETUPS))
def test_served_rows_on_the_real_scheduler_are_the_references(tiny_model: Path, shape: Any,
                                                             name: str) -> None:
    """The plugin's wrappers on the real scheduler, served (split rule, closed form, rows on
    finishing outputs and on every output of a request with stop strings) and the reference
    (every step predicted whole, a row on every output), on the same workload."""
    # Twice the requests: past `AUDIT_EVERY` steps of decode runs, so that an audit checks
    # what the cheap checks accepted.
    setup = replace(SETUPS[name], requests=2 * SETUPS[name].requests)
    prior = _prior(shape)
    for seed in SEEDS[:2]:
        served = EngineAccountant(lambda: prior)
        served.sparse = True
        reference = EngineAccountant(lambda: prior, split_rule=False)
        reference.sparse = False
        played = _played(tiny_model, setup, seed, served)
        ref = _played(tiny_model, setup, seed, reference)
        # The same workload, scheduled the same: the plugin changes nothing vLLM does.
        assert [s.scheduled for s in played.seen] == [s.scheduled for s in ref.seen]
        got, want = carried(played.updates), carried(ref.updates)
        # Every output leaves in the same step, in the same place.
        assert [c[:3] for c in got] == [c[:3] for c in want]
        dense = {r for r, request in played.all_requests.items()
                 if request.sampling_params.stop}
        rows = 0
        for g, w in zip(got, want, strict=True):
            assert (g.row is not None) == (g.finished or g.req_id in dense), g[:3]
            assert w.row is not None, w[:3]
            if g.row is not None:
                rows += 1
                np.testing.assert_allclose(np.frombuffer(g.row, np.float64),
                                           np.frombuffer(w.row, np.float64), rtol=1e-9,
                                           atol=1e-12 * reference.total_joules,
                                           err_msg=f"seed {seed}: {g[:3]}")
        assert rows > 0 and any(g.finished for g in got)
        assert served.total_joules == pytest.approx(reference.total_joules, rel=1e-9)
        assert served.errors == reference.errors == 0
        assert served.audit_failures == 0
        assert served.regular_steps > 0  # the closed form was used
        assert served.audits > 0
