"""Every vLLM patch the plugin can install, in one list, and the table docs/vllm.md shows
(`python -m vllm_piep.runtime.registry` prints it: the same table under every supported vLLM).
Importing this imports vLLM."""

from __future__ import annotations

from vllm_piep.runtime.patching import Patch


def groups() -> dict[str, list[Patch]]:
    """The patch groups by name, as this vLLM offers them (the CPU platform's own group is
    empty elsewhere)."""
    from vllm_piep.runtime import cli, install
    from vllm_piep.runtime.api_server import endpoints, offline, outputs, tenant, tracing
    from vllm_piep.runtime.engine_core import patch_executor_init
    from vllm_piep.runtime.engine_core import patches as engine_core
    from vllm_piep.runtime.worker import detail, step
    from vllm_piep.runtime.worker import patch_initialize_from_config as worker_meter

    return {
        "cli (always)": cli.patches(),
        "worker": step.patches(),
        "engine core": [*engine_core.patches(), install._in_process_worker_patch()],
        "API server": [*outputs.patches(), *endpoints.patches()],
        **{f"API server: {name}": make() for name, make in endpoints.OPTIONAL_GROUPS.items()},
        "offline (vllm.LLM)": offline.patches(),
        "trace spans": tracing.patches(),
        "ledger tenant": tenant.patches(),
        "span files": detail.span_patches(),
        "detail mode": detail.collective_patches(),
        "CPU platform only": detail.cpu_eager_pipeline_patches(),
        "workers meter themselves (meter_scope)": [patch_executor_init.patch(),
                                                   worker_meter.patch()],
    }


def all_patches() -> list[Patch]:
    return [p for group in groups().values() for p in group]


def every_version(patch: Patch) -> list[Patch]:
    """`patch` and the patches other vLLM versions get in its place (the chat stream's target
    differs between 0.32 and 0.33), in one order whichever vLLM is installed."""
    from vllm_piep.runtime.api_server.endpoints import chat_stream_patches

    variants = chat_stream_patches()
    if any((p.target, p.name) == (patch.target, patch.name) for p in variants):
        return variants
    return [patch]


def markdown_table() -> str:
    """One row per patch, every vLLM version's target where they differ (each row says the
    versions it is verified on), whichever vLLM runs this; patches of a group that share their
    description (the collectives) share a row."""
    rows: dict[tuple[str, str, str, str, tuple[str, ...]], list[str]] = {}
    for name, patches in groups().items():
        for p in (v for installed in patches for v in every_version(installed)):
            rows.setdefault((name, p.why, p.how, p.until, p.verified), []).append(
                f"`{p.target_name}.{p.name}`")
    lines = ["| group | target | why | how | can go when | verified on |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {name} | {', '.join(targets)} | {why} | {how} | {until} | "
              f"{', '.join(verified)} |"
              for (name, why, how, until, verified), targets in rows.items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
