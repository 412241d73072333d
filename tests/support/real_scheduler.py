"""vLLM's real scheduler (`Scheduler`, `AsyncScheduler`) on CPU without a model: built as vLLM's
engine core builds it (its own tests do the same), for the tiny model with a small KV cache (so
that it preempts), a small token budget (so that it chunks prefills) and prefix caching on; fed
seeded requests with random prompts, some sharing prefixes; and driven step after step by the
engine core's loop (`step`, or `step_with_batch_queue` with async scheduling) around a stand-in
model runner: one sampled token per request whose step reaches the end of its known tokens
(plus a random number of accepted drafts where speculative decoding is configured), the step's
time stamped on the output as the plugin's worker wrappers do. Requests finish by max_tokens,
and some are aborted through `finish_requests`. The same seed plays the same steps, with or
without the plugin's wrappers on the scheduler."""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import MethodType
from typing import Any, NamedTuple, Protocol
from unittest import mock

import numpy as np

from vllm_piep.runtime.engine_core import scheduler_accountant
from vllm_piep.runtime.engine_core.accountant import EngineAccountant
from vllm_piep.runtime.record import PICK_DTYPE, PICKS_KEY, ROW_BYTES, ROWS_KEY
from vllm_piep.runtime.worker.step import STEP_TIME_ATTR
from vllm_piep.runtime.worker.steptime import HOST_TIMER, KnownStepTime


@dataclass(frozen=True)
class Setup:
    """The scheduler's settings and the workload's."""

    async_scheduling: bool = False
    spec_tokens: int = 0  # n-gram drafts per step (0: no speculative decoding)
    v2_runner: bool = False  # the scheduler's lists as model runner V2 takes them
    block_size: int = 16
    num_blocks: int = 24  # 384 tokens of KV cache: running requests get preempted
    max_batched: int = 64  # tokens per step: long prompts are chunked
    max_seqs: int = 8
    max_model_len: int = 256
    prompt: tuple[int, int] = (4, 120)  # prompt lengths drawn from this range
    max_tokens: tuple[int, int] = (1, 48)  # max_tokens drawn from this range
    families: int = 3  # shared prompt prefixes (block-aligned lengths)
    family_p: float = 0.5  # a request's prompt starts with one of them
    stop_p: float = 0.2  # a request has stop strings (only the API server acts on them)
    requests: int = 80  # requests in all
    first: int = 6  # requests there before the first step
    arrive_p: float = 0.3  # another arrives before a step
    abort_p: float = 0.015  # a live request is aborted at an update
    accept_p: float = 0.5  # each draft is accepted (the first rejected ends the run)


@contextmanager
def _model_runner(v2: bool) -> Iterator[None]:
    """vLLM's config says model runner V2 (or V1) while this lasts. vLLM on CPU refuses V2 (it
    needs Triton), and the scheduler reads only whether the runner is V2 (at its start)."""
    from vllm.config import VllmConfig

    with mock.patch.object(VllmConfig, "use_v2_model_runner", property(lambda self: v2)):
        yield


def build_scheduler(model: Path, setup: Setup) -> Any:
    """vLLM's scheduler for `setup`, as its engine core makes it (the class its config names,
    the block sizes it resolves), with one full-attention KV cache group of `num_blocks`.
    Raises `Unsupported` for a setting this vLLM cannot build on CPU."""
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    with _model_runner(False):
        model_config = ModelConfig(model=str(model), dtype="float32", seed=0,
                                   skip_tokenizer_init=True, max_model_len=setup.max_model_len)
        scheduler_config = SchedulerConfig(
            max_num_seqs=setup.max_seqs, max_num_batched_tokens=setup.max_batched,
            max_model_len=setup.max_model_len, enable_chunked_prefill=True,
            async_scheduling=setup.async_scheduling, is_encoder_decoder=False)
        cache_config = CacheConfig(block_size=setup.block_size, enable_prefix_caching=True)
        speculative_config = _ngram(setup.spec_tokens, setup.async_scheduling) \
            if setup.spec_tokens else None
        vllm_config = VllmConfig(model_config=model_config, scheduler_config=scheduler_config,
                                 cache_config=cache_config,
                                 speculative_config=speculative_config)
    _async_as_on_gpu(vllm_config, setup.async_scheduling)
    spec = FullAttentionSpec(block_size=setup.block_size, num_kv_heads=1, head_size=1,
                             dtype=torch.float32)
    kv_cache_config = KVCacheConfig(num_blocks=setup.num_blocks, kv_cache_tensors=[],
                                    kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    cache_config.num_gpu_blocks = setup.num_blocks
    block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    cls = vllm_config.scheduler_config.get_scheduler_cls()
    with _model_runner(setup.v2_runner):
        scheduler = cls(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                        structured_output_manager=StructuredOutputManager(vllm_config),
                        block_size=block_size, hash_block_size=hash_block_size,
                        log_stats=False)
    assert scheduler.use_v2_model_runner == setup.v2_runner
    return scheduler


class Unsupported(Exception):
    """A setting this vLLM cannot build on CPU (the test skips, saying why)."""


def _version() -> str:
    import vllm

    return vllm.__version__


def _ngram(k: int, async_scheduling: bool) -> Any:
    """n-gram drafts: vLLM's `ngram` drafter, or with async scheduling its `ngram_gpu` one
    (the n-gram drafter vLLM allows with async scheduling)."""
    from vllm.config import SpeculativeConfig

    method = "ngram_gpu" if async_scheduling else "ngram"
    try:
        return SpeculativeConfig(method=method, num_speculative_tokens=k,
                                 prompt_lookup_max=3, prompt_lookup_min=1)
    except Exception as exc:  # noqa: BLE001  (vLLM says why in its own words)
        raise Unsupported(f"vLLM {_version()} cannot configure {method} speculative decoding "
                          f"on CPU: {exc}") from exc


def _async_as_on_gpu(vllm_config: Any, wanted: bool) -> None:
    """Async scheduling as asked. vLLM's CPU platform turns it off in its config hook, after
    the config has checked that the rest allows it (as on a GPU, which leaves it on); the
    scheduler reads only `scheduler_config.async_scheduling` (its class, its loop's depth)."""
    from vllm.platforms import current_platform

    config = vllm_config.scheduler_config
    if bool(config.async_scheduling) == wanted:
        return
    if wanted and current_platform.is_cpu():
        config.async_scheduling = True
        return
    raise Unsupported(f"vLLM {_version()} turns async scheduling "
                      f"{'off' if wanted else 'on'} for this setup")


class Seen(NamedTuple):
    """One `schedule()` as it returned: copies of the lists the plugin reads, and what the
    loop knew of the requests then."""

    index: int  # the call's number
    at: int  # when it returned (the loop's calls are numbered in order)
    output: Any  # the SchedulerOutput itself
    cached: list[str]
    cached_start: list[int]
    cached_outs: list[int]
    resumed: set[str]  # cached ones that resume after a preemption (model runner V1)
    new: list[str]
    new_start: list[int]
    scheduled: dict[str, int]
    spec: dict[str, list[int]]
    preempted: set[str]  # requests this call preempted
    sampling: set[str]  # requests whose step reaches the end of their known tokens
    # Each scheduled request's tokens: its prompt and its outputs so far (with async
    # scheduling, not those of the step in flight).
    known: dict[str, int]


class Updated(NamedTuple):
    """One `update_from_output`: the step it took and what it returned, and the requests
    aborted just before it (while the step ran) and just after it."""

    seen: Seen
    at: int  # when it returned
    outputs: dict[int, Any]
    accepted: dict[str, int]  # the drafts the step accepted, by request
    aborted_before: list[str]
    aborted_after: list[str]


class Watcher(Protocol):
    """What a test does at each point of the loop."""

    def after_schedule(self, seen: Seen) -> None: ...

    def before_update(self, seen: Seen) -> None: ...

    def after_update(self, update: Updated) -> None: ...


class RealLoop:
    """vLLM's engine loop over a real scheduler and a stand-in model runner (module docstring).
    `scheduler`'s methods are called through the instance, so wrappers bound to it (`install`)
    run as they do in vLLM's engine core."""

    def __init__(self, scheduler: Any, setup: Setup, seed: int) -> None:
        from vllm.v1.request import RequestStatus

        self.scheduler, self.setup = scheduler, setup
        self.rng = random.Random(seed)
        self.vocab = scheduler.vllm_config.model_config.get_vocab_size()
        self.families = [self._tokens(setup.block_size * self.rng.randint(1, 3))
                         for _ in range(setup.families)]
        self.aborted_status = RequestStatus.FINISHED_ABORTED
        self.block_hasher = _block_hasher(scheduler)
        self.made = 0
        self.all_requests: dict[str, Any] = {}  # every request made, by id
        self.calls = 0  # schedule and update calls so far
        self.seen: list[Seen] = []
        self.updates: list[Updated] = []
        self._preemptions: dict[str, int] = {}
        # Steps in flight: the engine core's batch queue (1: its plain `step`).
        with _model_runner(scheduler.use_v2_model_runner):
            self.depth = scheduler.vllm_config.max_concurrent_batches

    # -- the workload ---------------------------------------------------------------------------
    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(n)]

    def _add_request(self) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        s, rng = self.setup, self.rng
        n = rng.randint(*s.prompt)
        prompt = []
        if rng.random() < s.family_p:
            prompt = list(rng.choice(self.families))[:n - 1]
        prompt += self._tokens(n - len(prompt))
        stop = ["\n\n"] if rng.random() < s.stop_p else None
        params = SamplingParams(max_tokens=rng.randint(*s.max_tokens), stop=stop)
        req_id = f"req-{self.made}"
        self.made += 1
        request = Request(request_id=req_id, prompt_token_ids=prompt, sampling_params=params,
                          pooling_params=None, block_hasher=self.block_hasher)
        self.all_requests[req_id] = request
        self.scheduler.add_request(request)

    def _arrivals(self) -> None:
        if self.made == 0:
            for _ in range(min(self.setup.first, self.setup.requests)):
                self._add_request()
        elif self.made < self.setup.requests and self.rng.random() < self.setup.arrive_p:
            self._add_request()

    def _abort_some(self) -> list[str]:
        live = sorted(self.scheduler.requests)
        ids = [r for r in live if self.rng.random() < self.setup.abort_p]
        if ids:
            self.scheduler.finish_requests(ids, self.aborted_status)
        return ids

    # -- one schedule and its model output --------------------------------------------------------
    def _schedule(self) -> Seen:
        scheduler = self.scheduler
        out = scheduler.schedule(False)
        scheduler.get_grammar_bitmask(out)  # vLLM asks for it right after dispatching the step
        cached = out.scheduled_cached_reqs
        requests = scheduler.requests
        preempted = set()
        for req_id, request in requests.items():
            if request.num_preemptions > self._preemptions.get(req_id, 0):
                preempted.add(req_id)
            self._preemptions[req_id] = request.num_preemptions
        known = {r: requests[r].num_prompt_tokens + requests[r].num_output_tokens
                 for r in out.num_scheduled_tokens}
        seen = Seen(
            index=len(self.seen), at=self._tick(), output=out, cached=list(cached.req_ids),
            cached_start=list(cached.num_computed_tokens),
            cached_outs=list(cached.num_output_tokens),
            resumed=set(getattr(cached, "resumed_req_ids", ()) or ()),
            new=[r.req_id for r in out.scheduled_new_reqs],
            new_start=[r.num_computed_tokens for r in out.scheduled_new_reqs],
            scheduled=dict(out.num_scheduled_tokens),
            spec={r: list(t) for r, t in (out.scheduled_spec_decode_tokens or {}).items()},
            preempted=preempted,
            sampling={r for r in out.num_scheduled_tokens if not requests[r].is_prefill_chunk},
            known=known)
        self.seen.append(seen)
        return seen

    def _tick(self) -> int:
        self.calls += 1
        return self.calls

    def _model_output(self, seen: Seen) -> tuple[Any, dict[str, int]]:
        """What the model runner hands back for the step: a token for each request that
        samples, and the accepted drafts (each accepted with `accept_p`, up to the first
        rejected); the step's time, a function of its tokens with some noise. And the number
        of drafts accepted, by request."""
        from vllm.v1.outputs import ModelRunnerOutput

        req_ids = list(seen.scheduled)
        rng = self.rng
        sampled = []
        accepted: dict[str, int] = {}
        for r in req_ids:
            if r not in seen.sampling:
                sampled.append([])
                continue
            n = 0
            for _ in seen.spec.get(r, ()):
                if rng.random() >= self.setup.accept_p:
                    break
                n += 1
            accepted[r] = n
            sampled.append(self._tokens(1 + n))
        output = ModelRunnerOutput(req_ids=req_ids,
                                   req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                   sampled_token_ids=sampled)
        if req_ids:  # the worker stamps every output with requests
            tokens = sum(seen.scheduled.values())
            step_ns = 400_000 + 12_000 * tokens + rng.randrange(100_000)
            setattr(output, STEP_TIME_ATTR, KnownStepTime(step_ns, HOST_TIMER))
        return output, accepted

    def _drafts(self, seen: Seen) -> None:
        """Synchronous speculative decoding: the drafter's proposals for the requests of the
        step just updated, as the engine core hands them over after the step."""
        from vllm.v1.outputs import DraftTokenIds

        req_ids = [r for r in seen.scheduled if r in seen.sampling]
        drafts = [self._tokens(self.rng.randint(0, self.setup.spec_tokens)) for _ in req_ids]
        self.scheduler.update_draft_token_ids(DraftTokenIds(req_ids, drafts))

    def _update(self, seen: Seen, watch: Watcher | None) -> None:
        model_output, accepted = self._model_output(seen)
        aborted_before = self._abort_some() if self.rng.random() < 0.5 else []
        if watch is not None:
            watch.before_update(seen)
        outputs = self.scheduler.update_from_output(seen.output, model_output)
        at = self._tick()
        aborted_after = self._abort_some() if self.rng.random() < 0.5 else []
        update = Updated(seen, at, outputs, accepted, aborted_before, aborted_after)
        self.updates.append(update)
        if watch is not None:
            watch.after_update(update)
        if self.setup.spec_tokens and not self.setup.async_scheduling and seen.scheduled:
            self._drafts(seen)

    def run(self, steps: int, watch: Watcher | None = None) -> None:
        """`steps` schedule calls at most (fewer once every request is done), as vLLM's
        engine core loop makes them: `step` (sync), or `step_with_batch_queue` with the
        config's concurrent batches (async); `watch` sees each step as it is scheduled, just
        before its update, and its update."""
        in_flight: deque[Seen] = deque()
        scheduler = self.scheduler
        for _ in range(steps):
            self._arrivals()
            if scheduler.has_requests():
                seen = self._schedule()
                if watch is not None:
                    watch.after_schedule(seen)
                in_flight.appendleft(seen)
                executed = bool(seen.scheduled)
                if len(in_flight) < self.depth and (executed or scheduler.has_requests()):
                    continue
            elif not in_flight:
                if self.made >= self.setup.requests:
                    break
                continue
            self._update(in_flight.pop(), watch)
        while in_flight:
            self._update(in_flight.pop(), watch)


def _block_hasher(scheduler: Any) -> Any:
    """The requests' block hasher, as vLLM's engine core makes it with prefix caching on."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    config = scheduler.vllm_config.cache_config
    hash_fn = get_hash_fn_by_name(config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    return get_request_block_hasher(scheduler.hash_block_size, hash_fn)


def install(scheduler: Any, acc: EngineAccountant) -> None:
    """The plugin's wrappers of the engine loop's calls, bound to this scheduler instance
    (its class keeps vLLM's), with `acc` as its accountant."""
    from support.engine_loop import PluginWrappers

    cls = type(scheduler)
    for name in ("schedule", "get_grammar_bitmask", "update_from_output"):
        wrap = getattr(PluginWrappers, f"_wrap_{name}")
        setattr(scheduler, name, MethodType(wrap(getattr(cls, name)), scheduler))
    scheduler.__dict__[scheduler_accountant.ACCOUNTANT_ATTR] = acc


class Carried(NamedTuple):
    """One output a step's update returned: its request, whether it finished the request,
    and the row it carried (None: none)."""

    step: int  # the update's number
    req_id: str
    finished: bool
    row: bytes | None


def carried(updates: list[Updated]) -> list[Carried]:
    """Every output of every update, in order, with the row it carried (`runtime/record.py`:
    a rows block on each client's first output; `PICKS_KEY` names the outputs it is for)."""
    got = []
    for k, update in enumerate(updates):
        for engine_outputs in update.outputs.values():
            outs = engine_outputs.outputs
            if not outs:
                continue
            params = outs[0].kv_transfer_params or {}
            block = params.get(ROWS_KEY, b"")
            picks = params.get(PICKS_KEY)
            if picks is not None:
                positions = np.frombuffer(picks, PICK_DTYPE).tolist()
            else:
                positions = list(range(len(outs))) if block else []
            rows = {i: block[j * ROW_BYTES:(j + 1) * ROW_BYTES] for j, i in enumerate(positions)}
            got.extend(Carried(k, out.request_id, out.finish_reason is not None, rows.get(i))
                       for i, out in enumerate(outs))
    return got
