"""A real Prometheus (the Debian package's binary, which scripts/setup.sh unpacks under .cache)
scraping given targets, queried through its HTTP API."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def prometheus_binary() -> Path | None:
    found = shutil.which("prometheus")
    if found:
        return Path(found)
    cached = ROOT / ".cache" / "prometheus" / "usr" / "bin" / "prometheus"
    return cached if cached.exists() else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Prometheus:
    """Scrapes `targets` (host:port) every `interval_s` until `stop`."""

    def __init__(self, binary: Path, targets: list[str], workdir: Path,
                 interval_s: float = 1.0) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        config = workdir / "prometheus.yml"
        every = f"{round(interval_s * 1000)}ms"  # Prometheus durations take no fractions
        config.write_text(
            f"global:\n  scrape_interval: {every}\n  evaluation_interval: {every}\n"
            f"scrape_configs:\n  - job_name: vllm\n    static_configs:\n"
            f"      - targets: {json.dumps(targets)}\n")
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(workdir / "prometheus.log", "wb")
        self._proc = subprocess.Popen(
            [str(binary), f"--config.file={config}", f"--storage.tsdb.path={workdir / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=2):
                    return
            except OSError:
                if self._proc.poll() is not None:
                    break
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"prometheus did not start; log {workdir / 'prometheus.log'}")

    def query(self, expr: str, at: float | None = None) -> dict[str, Any]:
        """The API's answer to an instant query (status, data, or error)."""
        params = {"query": expr, **({"time": f"{at:.3f}"} if at is not None else {})}
        url = self.url + "/api/v1/query?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=30) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:  # a bad query: 400 with the error
            return json.loads(exc.read())

    def scrapes(self) -> float:
        """How many times the target was scraped so far (`up`'s samples over the last hour)."""
        answer = self.query("count_over_time(up[1h])")
        result = answer.get("data", {}).get("result", [])
        return float(result[0]["value"][1]) if result else 0.0

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        self._log.close()
