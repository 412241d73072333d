"""The main job of the README: serve a model with the plugin, send one request, print its energy.

    python -m vllm_piep.tools.demo --model .cache/tiny-llama [--bundle auto|DIR|none]

`--bundle auto` (the default) lets the plugin pick a calibrated bundle from `models/` that fits
the model, its dtype and this machine's device name (a CPU's model name, a GPU's name); without
one it predicts with the analytic prior and says so.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from vllm_piep.tools.server import ServerError, ServerOptions, VllmServer, exit_on_sigterm

DEFAULT_BUNDLE = "auto"  # the README's example is what this serves (tests/unit/test_docs_facts.py)


def format_energy(usage: dict[str, Any]) -> str:
    energy = usage.get("energy")
    if energy is None:
        return "usage.energy is missing: the plugin did not account this request (see the log)"
    per_token = energy["joules_per_output_token"]
    lines = [
        f"energy of this request: {energy['joules']:.6g} J  "
        f"({usage['prompt_tokens']} prompt + {usage['completion_tokens']} completion tokens; "
        f"{per_token:.6g} J per output token)" if per_token is not None else
        f"energy of this request: {energy['joules']:.6g} J",
        f"  source: {energy['source']} ({energy['bundle']})"
        + ("  -- an analytic estimate from datasheet-style coefficients, not a measurement"
           if energy["source"] == "prior" else _calibrated_with(energy["bundle"])),
        f"  prefill {energy['prefill_joules']:.6g} J, decode {energy['decode_joules']:.6g} J",
        "  breakdown:",
    ]
    total = energy["joules"] or 1.0
    for name, joules in energy["breakdown"].items():
        lines.append(f"    {name:<10} {joules:12.6g} J  {100 * joules / total:6.2f} %")
    return "\n".join(lines)


def _calibrated_with(bundle_id: str) -> str:
    """What the bundle was fitted to and what it matched here (from its manifest): the meter,
    and the device name it was made on, which is all that matched this machine."""
    from vllm_piep.predict.loader import shipped_bundles

    for directory in shipped_bundles():
        manifest = json.loads((directory / "manifest.json").read_text())
        if bundle_id.split(" (")[0] == manifest.get("bundle_id"):  # "<id> (fit to <meter>)"
            serving = manifest.get("serving", {})
            meter = serving.get("meter", "an unnamed meter")
            name = serving.get("device_name")
            device = ("a CPU whose model name is" if serving.get("device_type") == "cpu"
                      else "a GPU named")
            matched = (f" on {device} {name!r}, as this one's (a bundle is picked by that "
                       "name, not by the machine)") if name else ""
            return f"  -- fitted to {meter}{matched}"
    return ""


def is_random_weights(model: str) -> bool:
    """The tiny model `python -m vllm_piep.tools.tiny_model` builds (its stamp is there): its
    weights are drawn at random."""
    from vllm_piep.tools.tiny_model import _STAMP

    return (Path(model) / _STAMP).is_file()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="model directory (or name) to serve")
    parser.add_argument("--prompt", default="def fibonacci(n):")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--log", type=Path, default=None, help="keep the server log here")
    parser.add_argument("--json", action="store_true", help="print the whole response as JSON")
    parser.add_argument("--bundle", default=DEFAULT_BUNDLE,
                        help="calibrated bundle: auto (from models/), a directory, or none")
    args = parser.parse_args(argv)
    exit_on_sigterm()

    extra = []
    if args.bundle != "none":
        extra = ["--additional-config", json.dumps({"piep": {"bundle": args.bundle}})]
    server = VllmServer(ServerOptions(model=args.model, extra_args=extra), log_path=args.log)
    print("$ " + shlex.join(server.command()), flush=True)
    print("starting vLLM with the plugin (about 30-60 s on a CPU)...", flush=True)
    try:
        with server:
            response = server.post("/v1/completions", {
                "model": "model", "prompt": args.prompt, "max_tokens": args.max_tokens,
                "ignore_eos": True, "temperature": 0})
    except ServerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(response, indent=2))
    print(f"prompt: {args.prompt!r}\ncompletion: {response['choices'][0]['text']!r}")
    if is_random_weights(args.model):
        print("  (the tiny model's weights are random: its text means nothing)")
    print(format_energy(response["usage"]))
    return 0 if "energy" in response["usage"] else 1


if __name__ == "__main__":
    sys.exit(main())
