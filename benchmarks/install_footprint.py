"""Install footprint: what the serving-only ("lean") install adds, its size and its time.

The lean install is the wheel with no extra and without vLLM: what the plugin itself adds to a
vLLM image. The wheel is built by the documented command (`python -m pip wheel --no-deps -w DIR
.` from the repository root), then installed into a fresh scratch virtual environment (`python
-m venv`, the venv's own pip) with pip's configuration and download cache as they are
(`--no-cache` passes `--no-cache-dir`). Reported: the wheel's size; the install's wall time and
where pip took each distribution (pip's installation report and its `Using cached` lines: a
local file, its download cache, or a download; the cache was warm when nothing was
downloaded); the distributions it added; the disk space (allocated blocks, each file
once) it added to site-packages, the package itself, its dependencies in all and the ten
largest; and `import vllm_piep.plugin` in that venv: the median wall time of fresh `python -c
"import vllm_piep.plugin"` runs minus that of `python -c "pass"` runs, alternated, after one
unrecorded run of each. `--calibrate` measures `pip install '.[calibrate]'` from the clone (the
toolkit's extra) the same way, in a second fresh venv. A report, not a test: no budget.

    .venv/bin/python benchmarks/install_footprint.py --json

Progress goes to stderr, one line per phase; the figures to stdout as a table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_overhead import ROOT, finish_run, header, json_option  # noqa: E402

from vllm_piep.cli_errors import HelpFormatter, OneLineParser  # noqa: E402

MB = 1e6
TOP = 10  # the largest dependencies listed
# The wheel as README.md and docs/development.md build it; DIR is a scratch folder here.
WHEEL_BUILD = ("pip", "wheel", "--no-deps", "-w", "DIR", ".")
CALIBRATE = ".[calibrate]"  # the toolkit's install from the clone
PLUGIN_IMPORT = "import vllm_piep.plugin"
# Variables that would make a scratch venv's python see another environment's packages.
FOREIGN_ENV = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE", "VIRTUAL_ENV")
# Run in the scratch venv: every distribution with the disk space of its recorded files
# inside site-packages (allocated blocks, a hard-linked file once).
PROBE = r"""
import importlib.metadata as md, json, os, sysconfig
site = os.path.realpath(sysconfig.get_paths()["purelib"])
seen, out = set(), {}
for dist in md.distributions():
    used = count = 0
    for f in dist.files or ():
        path = os.path.realpath(dist.locate_file(f))
        if not path.startswith(site + os.sep):
            continue
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            used += st.st_blocks * 512
            count += 1
    out[dist.metadata["Name"]] = {"version": dist.version, "bytes": used, "files": count}
print(json.dumps({"site_packages": site, "distributions": out}))
"""
# pip's line for a distribution it takes from its download cache instead of the network.
USING_CACHED = re.compile(r"^\s*Using cached (\S+)", re.MULTILINE)
WHERE = ("cache", "download", "local")  # where pip took a distribution from


@dataclass
class Footprint:
    """One install's figures."""

    requirement: str
    install_s: float
    fetched: dict[str, list[str]]  # the distributions pip took from each of WHERE
    cache: str  # warm, cold, partly warm, off, or not used
    cache_dir: str  # pip's cache folder ("" when pip's cache is off)
    cache_bytes_before: int  # its size before the install
    cache_bytes_after: int  # and after it (what pip stored for the next install)
    added: dict[str, dict[str, Any]]  # the distributions the install added: version, bytes
    site_packages_bytes: int  # what site-packages grew by, on disk
    package_bytes: int  # vllm-piep's own files
    dependencies_bytes: int  # every other distribution added
    largest: list[dict[str, Any]]
    import_s: float  # median of `import vllm_piep.plugin` runs minus median of `pass` runs
    import_runs_s: list[float] = field(default_factory=list)
    pass_runs_s: list[float] = field(default_factory=list)
    pip_version: str = ""
    venv_s: float = 0.0


def normal(name: str) -> str:
    """A distribution's name as pip compares names (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def say(message: str) -> None:
    """One line of progress on stderr."""
    print(f"install_footprint: {message}", file=sys.stderr, flush=True)


def clean_env() -> dict[str, str]:
    """This environment without what would point a scratch venv's python elsewhere; pip's own
    settings (PIP_*) stay: the install is measured as this user's pip makes it."""
    return {k: v for k, v in os.environ.items() if k not in FOREIGN_ENV}


def run(argv: list[str], cwd: Path, timeout: float = 1800) -> subprocess.CompletedProcess[str]:
    """Run a command; a failure raises with the end of its output."""
    done = subprocess.run(argv, cwd=cwd, env=clean_env(), capture_output=True, text=True,
                          timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}:\n"
                           f"{(done.stdout + done.stderr)[-3000:]}")
    return done


def disk_usage(root: Path) -> int:
    """Bytes allocated under `root` (as du counts them: blocks, each inode once)."""
    seen: set[tuple[int, int]] = set()
    used = 0
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            st = os.lstat(os.path.join(folder, name))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                used += st.st_blocks * 512
    return used


def build_wheel(dist: Path) -> tuple[Path, float]:
    """The wheel, built by the documented command from the repository root, and the seconds
    it took."""
    argv = [sys.executable, "-m", *(str(dist) if w == "DIR" else w for w in WHEEL_BUILD)]
    start = time.perf_counter()
    run(argv, cwd=ROOT)
    seconds = time.perf_counter() - start
    (wheel,) = dist.glob("vllm_piep-*.whl")
    return wheel, seconds


def make_venv(path: Path) -> tuple[Path, float]:
    """A fresh virtual environment (its python) and the seconds `python -m venv` took."""
    start = time.perf_counter()
    run([sys.executable, "-m", "venv", str(path)], cwd=path.parent)
    return path / "bin" / "python", time.perf_counter() - start


def probe(python: Path, cwd: Path) -> dict[str, Any]:
    return json.loads(run([str(python), "-I", "-c", PROBE], cwd=cwd).stdout)


def fetched_from(report: dict[str, Any], pip_output: str) -> dict[str, list[str]]:
    """Where pip took each distribution it installed: a local file (a `file:` URL: the wheel,
    a local index or wheel folder), its download cache (pip says `Using cached`), or a
    download. `report` is pip's installation report (`--report`)."""
    cached = {Path(name).name for name in USING_CACHED.findall(pip_output)}
    found: dict[str, list[str]] = {k: [] for k in WHERE}
    for item in report["install"]:
        url = item["download_info"]["url"]
        name = Path(urlparse(url).path).name or item["metadata"]["name"]
        if urlparse(url).scheme == "file":
            found["local"].append(name)
        else:
            found["cache" if name in cached else "download"].append(name)
    return found


def cache_state(fetched: dict[str, list[str]], cache_dir: str) -> str:
    """Whether pip's download cache held what came over the network."""
    if not cache_dir:
        return "off"
    cached, downloaded = len(fetched["cache"]), len(fetched["download"])
    if cached + downloaded == 0:
        return "not used (local files only)"
    if downloaded == 0:
        return "warm"
    return "cold" if cached == 0 else "partly warm"


def pip_cache(python: Path, cwd: Path, no_cache: bool) -> tuple[str, int]:
    """pip's cache folder as the install sees it ("" when off) and its size now."""
    if no_cache:
        return "", 0
    done = subprocess.run([str(python), "-m", "pip", "cache", "dir"], cwd=cwd, env=clean_env(),
                          capture_output=True, text=True, timeout=120)
    if done.returncode != 0:  # pip says its cache is disabled (PIP_NO_CACHE_DIR, pip.conf)
        return "", 0
    folder = Path(done.stdout.strip())
    return str(folder), disk_usage(folder) if folder.is_dir() else 0


def timed_runs(python: Path, cwd: Path, runs: int) -> tuple[list[float], list[float]]:
    """Wall seconds of fresh `python -c "pass"` and `python -c "import vllm_piep.plugin"`
    runs, alternated, after one unrecorded run of each (the OS's file cache)."""
    env = clean_env()

    def once(code: str) -> float:
        start = time.perf_counter()
        subprocess.run([str(python), "-c", code], cwd=cwd, env=env, check=True, timeout=300)
        return time.perf_counter() - start

    once("pass"), once(PLUGIN_IMPORT)
    bare: list[float] = []
    plugin: list[float] = []
    for _ in range(runs):
        bare.append(once("pass"))
        plugin.append(once(PLUGIN_IMPORT))
    return bare, plugin


def imported_from(python: Path, cwd: Path) -> Path:
    """Where the venv's python imports the package from (the venv, not the clone)."""
    out = run([str(python), "-c", f"{PLUGIN_IMPORT}, vllm_piep; print(vllm_piep.__file__)"],
              cwd=cwd).stdout
    return Path(out.strip().splitlines()[-1])


def measure(requirement: str, cwd: Path, scratch: Path, name: str, args: argparse.Namespace
            ) -> Footprint:
    """Install `requirement` (run from `cwd`) into a fresh venv under `scratch` and measure."""
    venv = scratch / f"venv-{name}"
    say(f"{name}: creating a fresh venv ({venv})")
    python, venv_s = make_venv(venv)
    pip_version = run([str(python), "-m", "pip", "--version"], cwd=scratch).stdout.split()[1]
    before = probe(python, scratch)
    site = Path(before["site_packages"])
    site_before = disk_usage(site)

    cache_dir, cache_bytes = pip_cache(python, scratch, args.no_cache)
    say(f"{name}: pip install {requirement} (pip {pip_version}, cache "
        f"{cache_dir or 'off'}: {cache_bytes / MB:.0f} MB)")
    report = scratch / f"pip-report-{name}.json"
    argv = [str(python), "-m", "pip", "install", "--disable-pip-version-check",
            "--report", str(report), *(["--no-cache-dir"] if args.no_cache else []),
            requirement]
    start = time.perf_counter()
    done = run(argv, cwd=cwd)
    install_s = time.perf_counter() - start
    fetched = fetched_from(json.loads(report.read_text()), done.stdout)

    say(f"{name}: sizing site-packages")
    grown = disk_usage(site) - site_before  # before any import can write bytecode there
    cache_after = pip_cache(python, scratch, args.no_cache)[1]
    after = probe(python, scratch)
    added = {n: d for n, d in after["distributions"].items()
             if n not in before["distributions"]}
    package = sum(d["bytes"] for n, d in added.items() if normal(n) == "vllm-piep")
    ranked = sorted(((n, d) for n, d in added.items() if normal(n) != "vllm-piep"),
                    key=lambda item: -item[1]["bytes"])

    say(f"{name}: timing `{PLUGIN_IMPORT}`, {args.imports} runs against `pass`")
    where = imported_from(python, scratch)
    if not where.resolve().is_relative_to(venv):
        raise RuntimeError(f"the venv imported vllm_piep from {where}, not from {venv}")
    bare, plugin = timed_runs(python, scratch, args.imports)
    return Footprint(
        requirement=requirement, install_s=install_s, fetched=fetched,
        cache=cache_state(fetched, cache_dir), cache_dir=cache_dir,
        cache_bytes_before=cache_bytes, cache_bytes_after=cache_after, added=added,
        site_packages_bytes=grown, package_bytes=package,
        dependencies_bytes=sum(d["bytes"] for _, d in ranked),
        largest=[{"name": n, **d} for n, d in ranked[:TOP]],
        import_s=statistics.median(plugin) - statistics.median(bare),
        import_runs_s=plugin, pass_runs_s=bare, pip_version=pip_version, venv_s=venv_s)


def fetched_counts(f: Footprint) -> str:
    return " / ".join(str(len(f.fetched[k])) for k in WHERE)


def print_tables(wheel: dict[str, Any], results: dict[str, Footprint], runs: int) -> None:
    console = Console()
    table = Table(title="Install footprint (MB = 10^6 bytes, on disk)")
    table.add_column("figure")
    for name in results:
        table.add_column(name, justify="right")
    rows = [
        ("wheel size", lambda f: f"{wheel['bytes'] / MB:.3f} MB"),
        ("wheel build (pip wheel), wall time", lambda f: f"{wheel['build_s']:.1f} s"),
        ("pip install, wall time", lambda f: f"{f.install_s:.1f} s"),
        ("pip's download cache (MB before / after)",
         lambda f: f"{f.cache} ({f.cache_bytes_before / MB:.0f} / {f.cache_bytes_after / MB:.0f})"),
        ("taken from the cache / downloaded / local files", fetched_counts),
        ("distributions added (vllm-piep included)", lambda f: str(len(f.added))),
        ("site-packages grew by (files and folders)",
         lambda f: f"{f.site_packages_bytes / MB:.1f} MB"),
        ("  vllm-piep itself", lambda f: f"{f.package_bytes / MB:.2f} MB"),
        ("  its dependencies in all", lambda f: f"{f.dependencies_bytes / MB:.1f} MB"),
        (f"import vllm_piep.plugin minus pass, medians of {runs}",
         lambda f: f"{f.import_s * 1e3:.0f} ms"),
        ("  python -c pass, median", lambda f: f"{statistics.median(f.pass_runs_s) * 1e3:.0f} ms"),
    ]
    for label, cell in rows:
        table.add_row(label, *(cell(f) for f in results.values()))
    console.print(table)
    for name, f in results.items():
        top = Table(title=f"{name}: the {TOP} largest dependencies")
        for column in ("distribution", "version", "MB", "share of dependencies"):
            top.add_column(column, justify="left" if column == "distribution" else "right")
        for d in f.largest:
            top.add_row(d["name"], d["version"], f"{d['bytes'] / MB:.1f}",
                        f"{d['bytes'] / max(f.dependencies_bytes, 1):.0%}")
        console.print(top)


def parse_args() -> argparse.Namespace:
    parser = OneLineParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--calibrate", action="store_true",
                        help=f"also measure pip install '{CALIBRATE}' from the clone")
    parser.add_argument("--no-cache", action="store_true",
                        help="install with --no-cache-dir (default: pip's cache as it is)")
    parser.add_argument("--imports", type=int, default=7,
                        help="interpreter runs of each kind for the import time")
    parser.add_argument("--keep", type=Path, default=None, metavar="DIR",
                        help="build and install under DIR (created) and keep it; default: a "
                        "temporary folder, removed at the end")
    json_option(parser, "install_footprint.json")
    args = parser.parse_args()
    if args.imports < 1:
        parser.error(f"--imports {args.imports}: must be at least 1")
    if args.keep is not None and args.keep.exists() and any(args.keep.iterdir()):
        parser.error(f"--keep {args.keep}: exists and is not empty")
    return args


def main() -> int:
    args = parse_args()
    info = header("install footprint of the lean (serving-only) install")
    with tempfile.TemporaryDirectory(prefix="piep-install-") as temp:
        scratch = (args.keep or Path(temp)).resolve()
        scratch.mkdir(parents=True, exist_ok=True)
        say(f"building the wheel: python -m {' '.join(WHEEL_BUILD)} (DIR: {scratch / 'dist'})")
        wheel_path, build_s = build_wheel(scratch / "dist")
        wheel = {"name": wheel_path.name, "bytes": wheel_path.stat().st_size,
                 "build_s": build_s}
        results = {"lean": measure(str(wheel_path), scratch, scratch, "lean", args)}
        if args.calibrate:
            results["calibrate"] = measure(CALIBRATE, ROOT, scratch, "calibrate", args)
    say("done")
    print_tables(wheel, results, args.imports)
    finish_run(info, args, {"wheel": wheel,
                            "installs": {n: asdict(f) for n, f in results.items()}})
    return 0  # a report, not a test: no budget


if __name__ == "__main__":
    sys.exit(main())
