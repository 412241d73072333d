"""Start and stop a real `vllm serve` subprocess: for the demo, the tests, the benchmarks and the
calibration campaign.

Everything vLLM leaves behind goes where it can be removed: the process runs in its own
session (stopped by process group, by PID, never by name) with a private TMPDIR (zmq sockets,
`vllm_dist_*` files); shared-memory segments and semaphores it creates under
/dev/shm are found by comparing before and after and, once its processes are gone, removed
unless a live process still holds them (another server running beside it). Readiness is a
real one-token generation, not /health (which answers before a broken model fails its first
request). Kernels that vLLM compiles even when eager (the tensor-parallel vocabulary mask) stay
in torch's own cache, as for a plain `vllm serve`, so that a start reuses the last one's and
compiles nothing; torch's precompiled C++ header, which it would write under the private TMPDIR
and so rebuild at every start for kernels already cached, is off unless the user sets it.
"""

from __future__ import annotations

import getpass
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

PluginMode = Literal["flag", "env", "off"]
_SHM = Path("/dev/shm")
_LOKY_SEMAPHORE = re.compile(r"sem\.loky-(\d+)-")


class ServerError(RuntimeError):
    """The server failed to start or answer; the message carries the tail of its log."""


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit, so that `with VllmServer(...)` blocks stop their servers
    when a script using them is terminated (Ctrl-C already raises KeyboardInterrupt)."""
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_PORT_TAKEN = "Address already in use"  # vLLM's API server could not bind its port
_PORT_TRIES = 3


@dataclass
class ServerOptions:
    model: str
    plugin: PluginMode = "flag"  # `--plugins piep`, `VLLM_PLUGINS=piep`, or without the plugin
    port: int = 0  # 0: pick a free one
    max_model_len: int = 256
    dtype: str = "float32"
    enforce_eager: bool = True
    kv_cache_gib: int = 1
    extra_args: Sequence[str] = ()
    extra_env: Mapping[str, str] = field(default_factory=dict)
    startup_timeout_s: float = 300.0


def _running(pid: int) -> bool:
    """The process exists and is not a zombie (a zombie's /proc entry outlives it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


def shm_entries() -> set[str]:
    try:
        return set(os.listdir(_SHM))
    except OSError:
        return set()


def held_shm(pids: Collection[int] | None = None) -> set[str]:
    """/dev/shm entries some live process (of `pids`; default: any) maps or holds open: in use,
    whoever made them (another server running at the same time must keep its buffers). A loky
    semaphore that a process is passing to its child is held by none for a moment; loky names
    its creator: held while that runs."""
    held: set[str] = set()
    for name in shm_entries():
        creator = _LOKY_SEMAPHORE.match(name)
        if creator and _running(int(creator.group(1))) and (
                pids is None or int(creator.group(1)) in pids):
            held.add(name)
    prefix = str(_SHM) + "/"
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or (pids is not None and int(proc.name) not in pids):
            continue
        try:
            for line in (proc / "maps").read_text().splitlines():
                path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
                if path.startswith(prefix):
                    held.add(path[len(prefix):].split(" ")[0])
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith(prefix):
                    held.add(target[len(prefix):].split(" ")[0])
        except OSError:  # gone, or not ours to read
            continue
    return held


def stop_group(proc: subprocess.Popen[Any],
               signals: Sequence[tuple[signal.Signals, float]]) -> None:
    """Each signal to the process's group in turn, waiting that long for the process to exit
    after each, until it has."""
    for sig, wait_s in signals:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _group_pids(pgid: int) -> set[int]:
    """The live (not zombie) processes of a process group."""
    pids = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.add(int(proc.name))
    return pids


def _group_alive(pgid: int) -> bool:
    """Whether a process of the group still runs (zombies do not: where PID 1 does not reap
    orphans, a killed worker can stay one for good)."""
    return bool(_group_pids(pgid))


def inductor_cache_dir() -> str:
    """torch's default inductor cache for this user under this process's temporary directory
    (`torch._inductor.runtime.cache_dir_utils.default_cache_dir`), which a server's private
    TMPDIR would otherwise move to a directory that goes when it stops."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    safe = re.sub(r'[\\/:*?"<>|]', "_", user)
    return os.path.join(tempfile.gettempdir(), f"torchinductor_{safe}")


class VllmServer:
    """`with VllmServer(ServerOptions(model=...)) as server: server.post(...)`"""

    def __init__(self, options: ServerOptions, log_path: Path | None = None) -> None:
        self.options = options
        self.port = options.port or free_port()
        self._workdir = Path(tempfile.mkdtemp(prefix="piep-vllm-"))
        self.log_path = log_path or self._workdir / "server.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self._shm_before: set[str] = set()
        # /dev/shm entries the server's processes were seen holding: removed when it stops
        # (a buffer of another server starting beside it is never this server's to remove).
        self._shm_ours: set[str] = set()
        self._log_file: Any = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def command(self) -> list[str]:
        o = self.options
        vllm = str(Path(sys.executable).with_name("vllm"))
        cmd = [vllm, "serve", o.model, "--host", "127.0.0.1", "--port", str(self.port),
               "--max-model-len", str(o.max_model_len), "--dtype", o.dtype,
               "--shutdown-timeout", "5", "--served-model-name", "model"]
        if o.enforce_eager:
            cmd.append("--enforce-eager")
        if o.plugin == "flag":
            cmd += ["--plugins", "piep"]
        return cmd + list(o.extra_args)

    def environment(self) -> dict[str, str]:
        o = self.options
        env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", "PIEP_ENABLED")}
        tmp = self._workdir / "tmp"
        tmp.mkdir(exist_ok=True)
        env.update({
            "TMPDIR": str(tmp),
            "TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR")
            or inductor_cache_dir(),
            "TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS":
                os.environ.get("TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS", "0"),
            "HF_HUB_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": str(o.kv_cache_gib),
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        })
        if o.plugin == "env":
            env["VLLM_PLUGINS"] = "piep"
        env.update(o.extra_env)
        return env

    def start(self, wait: bool = True) -> VllmServer:
        """Starts `vllm serve`; with `wait`, returns once it answers a completion (a node of
        workers only, `--headless`, never does: start it without). The port picked free can be
        taken by another process before vLLM binds it: a start that loses it that way starts
        again on another (twice at most), where the port was this object's to pick."""
        tries_left = _PORT_TRIES - 1
        while True:
            try:
                return self._start(wait)
            except ServerError as exc:
                if not (tries_left and self.options.port == 0 and _PORT_TAKEN in str(exc)):
                    raise
            tries_left -= 1
            self.port = free_port()
            default_log = self.log_path.parent == self._workdir
            self._workdir = Path(tempfile.mkdtemp(prefix="piep-vllm-"))
            if default_log:
                self.log_path = self._workdir / "server.log"

    def _start(self, wait: bool) -> VllmServer:
        self._shm_before = shm_entries()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "wb")
        self._proc = subprocess.Popen(
            self.command(), env=self.environment(), stdout=self._log_file,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            if wait:
                self._wait_ready()
        except BaseException:
            self.stop()
            raise
        self._note_shm()
        return self

    def _note_shm(self) -> None:
        """The /dev/shm entries the server's processes hold now, as the server's own."""
        if self._proc is not None:
            self._shm_ours |= held_shm(_group_pids(self._proc.pid)) - self._shm_before

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.options.startup_timeout_s
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                raise ServerError(f"vllm serve exited with {self._proc.returncode} during "
                                  f"startup; log {self.log_path}:\n{self.log_tail()}")
            try:
                self.post("/v1/completions", {"model": "model", "prompt": "ready?",
                                              "max_tokens": 1}, timeout=30)
                return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                time.sleep(1.0)
        raise ServerError(f"vllm serve not ready after {self.options.startup_timeout_s:.0f} s; "
                          f"log {self.log_path}:\n{self.log_tail()}")

    def post(self, path: str, body: dict[str, Any], timeout: float = 120) -> dict[str, Any]:
        raw = self.post_text(path, body, timeout)
        return json.loads(raw) if raw.strip() else {}

    def post_text(self, path: str, body: dict[str, Any], timeout: float = 120) -> str:
        """The whole response body as text (a stream's events, once it has ended)."""
        req = urllib.request.Request(self.base_url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.read().decode()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:2000]
            raise ServerError(f"POST {path} -> HTTP {exc.code}: {detail}") from exc

    def get_text(self, path: str, timeout: float = 30) -> str:
        with urllib.request.urlopen(self.base_url + path, timeout=timeout) as resp:
            return resp.read().decode()

    def log_tail(self, lines: int = 40) -> str:
        """The log's last lines, without the leak reports nanobind prints at every exit."""
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        kept = [t for t in text if not t.startswith(("nanobind: leaked", " - leaked ",
                                                      " - ... skipped remainder"))]
        return "\n".join(kept[-lines:])

    def stop(self) -> None:
        self._note_shm()
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            stop_group(proc, ((signal.SIGINT, 30), (signal.SIGTERM, 10), (signal.SIGKILL, 10)))
        if proc is not None:
            # Workers may outlive the API server briefly; the group is ours alone.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            # Killed, they are gone as soon as the kernel has freed their memory, which a
            # loaded machine can take seconds to do; their buffers are in use until then.
            deadline = time.monotonic() + 120
            while _group_alive(proc.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        for name in self._shm_ours - held_shm():
            try:
                (_SHM / name).unlink()
            except OSError:
                pass
        self._shm_ours = set()
        shutil.rmtree(self._workdir, ignore_errors=True)  # pass log_path to keep the log

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
