"""Every change the plugin makes to vLLM lives in this package (verified on vLLM 0.32 and 0.33).

- cli.py: EngineArgs.add_cli_args, EngineArgs.from_cli_args -- the `--plugins piep` flag
- step.py: Worker.execute_model, Worker.sample_tokens -- step time and step spans where the
  model runs
- detail.py: Worker.load_model, Worker.shutdown -- the rank's span file and, in detail mode,
  module hooks on the loaded model; CPUWorker.compile_or_warm_up_model -- eager pipeline stages
  (on the CPU platform only: importing the CPU worker changes torch for the whole process);
  GroupCoordinator collectives (installed in detail mode only) -- collective spans
- engine_core/patch_*.py (listed by engine_core/patches.py): Scheduler.schedule -- each
  request's work in the step, and the state of requests aborted from outside freed (read off
  finished_req_ids); Scheduler.update_from_output -- predict, split, attach running totals
  to the outputs; Scheduler.get_grammar_bitmask, MsgpackEncoder.encode_into -- where that
  work runs, off the loop's critical path; EngineCoreProc._notify_idle_state_callbacks --
  the idle flush
- engine_core/patch_executor_init.py, worker/patch_initialize_from_config.py:
  Executor.__init__, Worker.initialize_from_config -- with `meter_scope: worker`, the engine's
  sink for its workers' meter readings, and each worker's meter thread
- outputs.py: OutputProcessor.process_outputs -- pop the records before vLLM reads the field
  (and count outputs that arrive after the API server finished a request);
  OutputProcessor.add_request -- the response being built learns its requests;
  OutputProcessor._finish_request, abort_requests -- close records, count them on /metrics
- offline.py: LLMEngine.step -- `energy` on the finished RequestOutputs of offline inference
  (`vllm.LLM`)
- tracing.py: OutputProcessor.do_tracing -- a finished request's energy on vLLM's
  `llm_request` OpenTelemetry span (with `--otlp-traces-endpoint`)
- tenant.py: vLLM's app middleware set-up, BaseServing._check_model -- the billing ledger's
  tenant, from a request header or the OpenAI `user` field
- endpoints.py: the serving methods of completions, chat (0.32: the SSE stream generator;
  0.33: `chat_completion_stream_generator_raw`), batch chat, the Responses API and Anthropic
  messages -- usage.energy on responses

Each patch keeps the original on its wrapper and can be uninstalled; each refuses to install
when vLLM lacks the attribute it wraps, and is registered with why, how, the vLLM versions it
is verified on and when it can go (`Patch`; docs/vllm.md lists them).
The CLI patch is installed whenever the plugin is loaded (the flag must exist before parsing);
the others only when the plugin is enabled (`--plugins piep` or VLLM_PLUGINS naming piep).
"""

from __future__ import annotations

import importlib
import multiprocessing
from collections.abc import Callable
from typing import Any

from vllm_piep.once import logger
from vllm_piep.runtime.patching import VERIFIED_VLLM, Patch, install_all, uninstall_all

_cli: list[Patch] = []
_runtime: list[Patch] = []  # per-request energy: all or none
# Span files; eager pipeline stages on CPU; each endpoint; offline outputs: each all or none.
_optional: list[list[Patch]] = []


def install_cli_flag() -> bool:
    from vllm_piep.runtime import cli

    if not _cli:
        _cli.extend(cli.patches())
        cli.set_activation(activate)
    return install_all(_cli)


def activate() -> bool:
    """Install the engine and API patches (idempotent). False if vLLM is not recognised. The
    optional groups (span files, eager pipeline stages on CPU, each endpoint, offline outputs)
    install on their own: a vLLM without their targets still serves energy.

    Each vLLM process gets what runs in it (vLLM names its processes): an engine core only
    the scheduler patches (the worker patches import ~20 MB of vLLM modules it never runs,
    unless its executor runs the worker in-process, which installs them then); a worker only
    the worker patches; the API server, and any other process, all of them."""
    from vllm_piep.runtime.api_server import endpoints, outputs
    from vllm_piep.runtime.engine_core import patch_executor_init
    from vllm_piep.runtime.engine_core import patches as engine_core
    from vllm_piep.runtime.worker import detail, step
    from vllm_piep.runtime.worker import patch_initialize_from_config as worker_meter

    if not _runtime:
        _say_version()
        role = multiprocessing.current_process().name
        if role.startswith("EngineCore"):
            _runtime.extend([*engine_core.patches(), _in_process_worker_patch()])
            _optional.append([patch_executor_init.patch()])
        elif role.startswith("VllmWorker"):
            _runtime.extend(step.patches())
            _optional.extend([detail.span_patches(), detail.cpu_eager_pipeline_patches(),
                              [worker_meter.patch()]])
        else:
            _runtime.extend([*step.patches(), *engine_core.patches(), *outputs.patches(),
                             *endpoints.patches()])
            _optional.extend([detail.span_patches(), detail.cpu_eager_pipeline_patches(),
                              [patch_executor_init.patch()], [worker_meter.patch()]])
            _optional.extend([*_endpoint_groups(),
                              *_api_server_group("offline", "offline outputs (vllm.LLM) carry no "
                                                 "energy: this vLLM's LLMEngine"),
                              *_api_server_group("tracing", "trace spans carry no energy: "
                                                 "this vLLM's request tracing"),
                              *_api_server_group("tenant", "billing ledger rows carry no "
                                                 "tenant: this vLLM's serving code")])
    if not install_all(_runtime):
        return False  # the optional groups would have no records to work with
    for group in _optional:
        install_all(group)
    return True


def _endpoint_groups() -> list[list[Patch]]:
    from vllm_piep.runtime.api_server import endpoints

    groups = []
    for name, make in endpoints.OPTIONAL_GROUPS.items():
        try:
            groups.append(make())
        except Exception as exc:  # noqa: BLE001  (a vLLM without that endpoint)
            logger.warning("vllm_piep: %s responses carry no usage.energy: this vLLM's %s "
                           "serving code cannot be patched (%s: %s)", name, name,
                           type(exc).__name__, exc)
    return groups


def _api_server_group(module: str, without: str) -> list[list[Patch]]:
    """The patches of one optional API-server module (`offline`, `tracing`), or none where
    this vLLM lacks their targets (`without`: what then goes without energy, and why)."""
    try:
        return [importlib.import_module(f"vllm_piep.runtime.api_server.{module}").patches()]
    except Exception as exc:  # noqa: BLE001  (a vLLM without the module's targets)
        logger.warning("vllm_piep: %s cannot be patched (%s: %s)", without,
                       type(exc).__name__, exc)
        return []


def vllm_version() -> str:
    try:
        from vllm import __version__

        return str(__version__)
    except Exception:  # noqa: BLE001  (a broken build: the patches will say what is missing)
        return "unknown"


def verified(version: str) -> bool:
    """Whether `version` (a local build such as `0.32.0+cpu` counts as its release) is one
    the patches were verified on."""
    return version.split("+", 1)[0] in VERIFIED_VLLM


def _say_version() -> None:
    version = vllm_version()
    if verified(version):
        logger.info("vllm_piep: installing into vLLM %s (verified)", version)
    else:
        logger.warning("vllm_piep: vLLM %s is not a version the plugin is verified on (%s); "
                       "installing wherever every target is present, and a group whose "
                       "target moved stays off with its own warning", version,
                       ", ".join(VERIFIED_VLLM))


def _in_process_worker_patch() -> Patch:
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        def _init_executor(self: Any, *args: Any, **kwargs: Any) -> Any:
            _install_worker_side()
            return original(self, *args, **kwargs)

        return _init_executor

    return Patch(UniProcExecutor, "_init_executor", wrap,
                 why="installs the worker patches when the worker runs in the engine core",
                 how="before the original: installs the worker and span patches (and the CPU "
                     "platform's own, on CPU only) in this process",
                 until="vLLM loads general plugins with the worker's role known")


def _install_worker_side() -> None:
    from vllm_piep.runtime.worker import detail, step
    from vllm_piep.runtime.worker import patch_initialize_from_config as worker_meter

    group = step.patches()
    install_all(group)
    _runtime.extend(p for p in group if p not in _runtime)
    for optional in (detail.span_patches(), detail.cpu_eager_pipeline_patches(),
                     [worker_meter.patch()]):
        install_all(optional)
        _optional.append(optional)


def deactivate() -> None:
    from vllm_piep.runtime.worker import detail

    uninstall_all(detail.collective_patches())
    for group in _optional:
        uninstall_all(group)
    uninstall_all(_runtime)
    uninstall_all(_cli)


def runtime_patches() -> list[Patch]:
    return [*_runtime, *(p for group in _optional for p in group)]
