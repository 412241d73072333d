"""The plugin's switches against the real vLLM: the --plugins flag, refusing a target it does not
recognise without touching it, detail mode's checks, and each process's own patches. (Every
group's install/uninstall round trip runs in tests/vllm_contract, against both vLLM versions.)"""

from __future__ import annotations

import os

import pytest

from vllm_piep.runtime import cli, install
from vllm_piep.runtime.api_server import outputs
from vllm_piep.runtime.engine_core import patches
from vllm_piep.runtime.patching import Patch, install_all
from vllm_piep.runtime.worker import detail, step

pytest.importorskip("vllm")


@pytest.fixture
def clean_vllm():
    yield
    install.deactivate()


def test_unrecognised_target_is_left_untouched() -> None:
    class Upstream:
        def present(self) -> int:
            return 1

    patches = [Patch(Upstream, "present", lambda f: lambda self: 2, "test", "test", "test"),
               Patch(Upstream, "missing", lambda f: f, "test", "test", "test")]
    assert not install_all(patches)
    assert Upstream().present() == 1 and "missing" not in Upstream.__dict__


def test_a_target_whose_parameters_differ_from_the_mirrored_ones_is_left_untouched(
        caplog) -> None:
    """A wrapper that mirrors its target's parameters (`Patch.signature`) refuses a target
    that takes others, and so does the whole group; the same target as verified takes it."""
    import logging

    class Upstream:
        def schedule(self, throttle_prefills: bool = False) -> str:
            return "vllm"

        def other(self) -> str:
            return "vllm"

    def wrap(original):  # type: ignore[no-untyped-def]
        return lambda self, throttle_prefills=False: "piep " + original(self, throttle_prefills)

    def group(signature: str) -> list[Patch]:
        return [Patch(Upstream, "other", lambda f: lambda self: "piep", "t", "t", "t"),
                Patch(Upstream, "schedule", wrap, "t", "t", "t", signature=signature)]

    with caplog.at_level(logging.WARNING, logger="vllm.plugins.piep"):
        assert not install_all(group("(self, throttle_prefills=True)"))
    assert Upstream().schedule() == "vllm" == Upstream().other()
    assert ("its parameters here are (self, throttle_prefills=False), the wrapper mirrors "
            "(self, throttle_prefills=True)") in caplog.text
    patches = group("(self, throttle_prefills=False)")
    try:
        assert install_all(patches)
        assert Upstream().schedule() == "piep vllm" and Upstream().schedule(True) == "piep vllm"
        assert install_all(patches)  # idempotent: an installed wrapper is not checked again
    finally:
        for patch in patches:
            patch.uninstall()
    assert Upstream().schedule() == "vllm"


def test_plugins_flag_parses_and_rejects_typos(clean_vllm, capsys) -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    install.install_cli_flag()
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--model", "m", "--plugins", "piep"])
    assert args.plugins == ["piep"]
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--plugins", "pieep"])
    assert "unknown vLLM plugin 'pieep'. Did you mean 'piep'?" in capsys.readouterr().err


def test_flag_turns_plugin_on(clean_vllm, monkeypatch) -> None:
    import argparse

    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.setenv("PIEP_ENABLED", "0")  # restored (removed) after the test
    install.install_cli_flag()
    assert not any(p.installed for p in install.runtime_patches())
    EngineArgs.from_cli_args(argparse.Namespace(model="m", plugins=["piep"]))
    assert os.environ["PIEP_ENABLED"] == "1"
    assert install.runtime_patches() and all(p.installed for p in install.runtime_patches())


def test_register_without_being_asked_only_adds_the_flag(clean_vllm, monkeypatch) -> None:
    from vllm_piep.plugin import register

    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.setenv("PIEP_ENABLED", "0")
    register()
    register()  # vLLM may call it again
    assert all(p.installed for p in cli.patches())
    runtime = [*step.patches(), *patches.patches(), *outputs.patches()]
    assert not any(p.installed for p in runtime)
    monkeypatch.setenv("VLLM_PLUGINS", "piep")
    register()
    assert all(p.installed for p in runtime)


def test_detail_mode_refuses_compiled_execution_and_says_what_to_do(tiny_model) -> None:
    from vllm.engine.arg_utils import EngineArgs

    from vllm_piep.config import ConfigError

    def config(eager: bool):
        return EngineArgs(model=str(tiny_model), dtype="float32", max_model_len=256,
                          enforce_eager=eager).create_engine_config()

    detail.require_eager(config(True))
    with pytest.raises(ConfigError, match="--enforce-eager"):
        detail.require_eager(config(False))


def test_serve_with_detail_mode_but_compiled_stops_at_once_with_the_fix(clean_vllm,
                                                                        monkeypatch) -> None:
    import argparse

    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.setenv("PIEP_ENABLED", "0")
    install.install_cli_flag()
    detail_config = {"piep": {"mode": "detail", "spans_dir": "/tmp/x"}}
    with pytest.raises(SystemExit, match="add --enforce-eager"):
        EngineArgs.from_cli_args(argparse.Namespace(model="m", plugins=["piep"],
                                                    additional_config=detail_config,
                                                    enforce_eager=False))
    with pytest.raises(SystemExit, match="detail mode needs `spans_dir`"):
        EngineArgs.from_cli_args(argparse.Namespace(
            model="m", plugins=["piep"], additional_config={"piep": {"mode": "detail"}},
            enforce_eager=True))


@pytest.mark.slow
def test_each_vllm_process_gets_its_own_patches() -> None:
    """An engine core gets the scheduler patches and not the worker modules (memory); the
    worker patches follow if its executor runs the worker in-process."""
    import subprocess
    import sys

    code = """
import multiprocessing, os, sys
multiprocessing.current_process().name = "EngineCore"
os.environ["PIEP_ENABLED"] = "1"
from vllm_piep.runtime import install
assert install.activate()
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.executor.uniproc_executor import UniProcExecutor
assert hasattr(Scheduler.update_from_output, "__wrapped__")
assert "vllm.v1.worker.gpu_worker" not in sys.modules, "worker modules loaded"
install._install_worker_side()  # what UniProcExecutor._init_executor does first
from vllm.v1.worker.gpu_worker import Worker
assert hasattr(Worker.execute_model, "__wrapped__")
assert hasattr(UniProcExecutor._init_executor, "__wrapped__")
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_an_unverified_vllm_is_installed_into_and_said_once(clean_vllm, monkeypatch,
                                                             caplog) -> None:
    import logging

    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    monkeypatch.setenv("PIEP_ENABLED", "1")
    monkeypatch.setattr(install, "_runtime", [])  # a fresh process
    monkeypatch.setattr(install, "_optional", [])
    with caplog.at_level(logging.INFO, logger="vllm.plugins.piep"):
        assert install.activate()
    assert "vLLM 0.99.0 is not a version the plugin is verified on (0.32.0, 0.33.0)" in (
        caplog.text)
    assert install.verified("0.32.0+cpu") and not install.verified("0.99.0")


def test_a_vllm_whose_target_moved_serves_without_energy_and_says_why(clean_vllm, monkeypatch,
                                                                      caplog) -> None:
    import logging

    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_piep.plugin import register

    monkeypatch.setenv("PIEP_ENABLED", "1")
    monkeypatch.delattr(Scheduler, "update_from_output")  # a release that renamed it
    monkeypatch.setattr(install, "_runtime", [])
    monkeypatch.setattr(install, "_optional", [])
    with caplog.at_level(logging.WARNING, logger="vllm.plugins.piep"):
        register()
    assert "not patching vllm.v1.core.sched.scheduler.Scheduler.update_from_output" in (
        caplog.text)
    assert "vLLM serves without usage.energy" in caplog.text
    assert not any(p.installed for p in install.runtime_patches())


def test_a_predictor_or_meter_that_cannot_serve_refuses_to_start(clean_vllm,
                                                                  monkeypatch) -> None:
    import argparse

    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.setenv("PIEP_ENABLED", "0")
    install.install_cli_flag()

    def serve(options: dict) -> None:
        EngineArgs.from_cli_args(argparse.Namespace(model="m", plugins=["piep"],
                                                    additional_config={"piep": options}))

    with pytest.raises(SystemExit, match=r"option `predictor` = 'nonexistent_mod:make' \(from "
                                         r"--additional-config\) cannot be used: "
                                         r"ModuleNotFoundError"):
        serve({"predictor": "nonexistent_mod:make"})
    with pytest.raises(SystemExit, match=r"option `predictor` = 'nonexistent_mod' .*must be "
                                         r"`module:callable`"):
        serve({"predictor": "nonexistent_mod"})
    with pytest.raises(SystemExit, match=r"unknown meter 'nvm'"):
        serve({"meter": "nvm"})
    with pytest.raises(SystemExit, match=r"option `meter` = 'nonexistent_mod:meter' \(from "
                                         r"--additional-config\) cannot be used: "
                                         r"ModuleNotFoundError"):
        serve({"meter": "nonexistent_mod:meter"})
    with pytest.raises(SystemExit, match=r"option `predictor` = 'math:pi' .* cannot be used: "
                                         r"TypeError: 'pi' is not callable"):
        serve({"predictor": "math:pi"})
    serve({"predictor": "math:floor", "meter": "math:floor"})  # importable: vLLM goes on


def test_invalid_json_in_the_additional_config_is_named(clean_vllm, capsys) -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    install.install_cli_flag()
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    assert parser.parse_args(["--model", "m", "--additional-config",
                              '{"piep": {"meter": "auto"}}']).additional_config == {
        "piep": {"meter": "auto"}}
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--additional-config", "{'piep': {}}"])
    err = capsys.readouterr().err
    assert "not valid JSON (Expecting property name enclosed in double quotes at column 2)" \
        in err and "cannot be converted to" not in err
    # A value without plugin options keeps vLLM's own message.
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--additional-config", "{'other': 1}"])
    assert "cannot be converted to" in capsys.readouterr().err
