"""`python -m vllm_piep.calibrate`: the campaign on a real vLLM (run, whatif) and the trainer
on published measurements (evaluate, report, train).

    run --model PATH --tp 1,2 --pp 1 --batch 8,16,32,64 --out-len 512,1024 --meter auto
        --out DIR [--quick] [--resume]
        profile in detail mode with repeated and synchronization sampling, then build the
        dataset, evaluate, train and export the bundle, and write the report (all in DIR)
    finish --out DIR      (re)build dataset, evaluation, bundle and report of a campaign
    whatif --bundle DIR [--tp 1,2,4] [--batch 1,8,32] [--context 512] [--png PATH]
           [--json PATH]
        predicted time and energy per output token; points outside the campaign's measured
        grid are marked extrapolated, refused beyond 4x it; --json writes the rows (a list of
        objects whose keys carry their units: time_per_token_ms, joules_per_token, ...)

    evaluate --dataset irene --data DIR --protocol leave-one-model-out --json OUT [--html DIR]
    evaluate --dataset mlenergy --data CSV --structures CSV --protocol leave-one-model-out
             --json OUT [--html DIR]
    (other protocols: leave-one-batch-out, leave-one-tp-out, kfold: 3-fold over trees)
    report --json OUT --html DIR
    fit-prior --data CSV [--data CSV] --structures CSV [--out vllm_piep/model/prior_fit.json]
        fit the prior's GPU powers to ML.ENERGY deployments (v2 or v3 tables)
    validate-prior --data CSV --structures CSV [--out DIR]
        price every published deployment as the engine would; table, summary, plot
    train --dataset irene --data DIR --out BUNDLE_DIR

The evaluation JSON is a fixed contract other tools read: {"dataset", "protocol", "n_trees",
"levels": {level: {"mape": percent, "n": count, ...}}, "per_model": {model: {level: percent}},
"baselines": {name: {"levels": {...}, "per_model": {...}}}, ...}. `mape` is IrEne's: the mean
over held-out models of 100 |P - G| / G averaged over each model's nodes. The per-node
predictions go next to it (`<OUT>.predictions.parquet`) for the report.

Bad input (a missing, empty or malformed file, a wrong column, a value out of range, an output
file whose directory does not exist) prints one line naming it and exits 2; exit 1 is a bug.
Output directories (--out DIR, --html DIR) are created.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import pandas as pd
from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.table import Table

from vllm_piep.calibrate import prior_cli
from vllm_piep.calibrate.campaign.cli import int_list, positive_int
from vllm_piep.calibrate.campaign.plan import CampaignError
from vllm_piep.calibrate.errors import PROTOCOLS, FitError, ProtocolError
from vllm_piep.cli_errors import (
    HelpFormatter,
    OneLineParser,
    UsageError,
    existing_file,
    output_file,
    run_cli,
)
from vllm_piep.datasets.model import BadRows, DatasetError, TreeDataset
from vllm_piep.predict.bundle import BundleError

PROG = "python -m vllm_piep.calibrate"

DATASETS = ("irene", "mlenergy")
# Where each dataset's measured energies come from: every figure names its ground truth.
GROUND_TRUTH = {
    "irene": "IrEne's release, device_1: wall power meter (emonPi, 170 ms samples), joules "
             "per run; features include NVML GPU energy",
    "mlenergy/v2": "ML.ENERGY leaderboard v2: GPU energy per request from NVML on A100-40GB "
                   "(GPU only, no host)",
    "mlenergy/v3": "ML.ENERGY leaderboard v3: GPU energy per request from NVML over the steady "
                   "state on H100 80GB (GPU only, no host)",
}


def ground_truth(args: argparse.Namespace) -> str:
    if args.dataset == "irene":
        return GROUND_TRUTH["irene"]
    from vllm_piep.datasets.mlenergy import mlenergy_version
    return GROUND_TRUTH[f"mlenergy/{mlenergy_version(args.data)}"]


def load_dataset(args: argparse.Namespace) -> TreeDataset:
    policy = BadRows(args.bad_rows)
    if args.dataset == "irene":
        from vllm_piep.datasets.irene import load_irene
        if not Path(args.data).is_dir():
            raise UsageError(f"--data {args.data}: not a directory, expected an IrEne device "
                             "directory (e.g. data/irene/device_1)")
        return load_irene(args.data, policy)
    if args.structures is None:
        raise UsageError(f"{args.command} --dataset mlenergy needs --structures CSV "
                         "(model_structures.csv)")
    from vllm_piep.datasets.mlenergy import load_mlenergy
    ds = load_mlenergy(existing_file(args.data, "leaderboard CSV"),
                       existing_file(args.structures, "structure CSV"), policy)
    if ds.trees.empty:
        raise UsageError(f"{args.data}: no usable row ({len(ds.issues)} bad rows, e.g. "
                         f"{ds.issues[0] if ds.issues else 'none'})")
    return ds


def run_evaluate(args: argparse.Namespace, console: Console) -> dict[str, object]:
    from vllm_piep.calibrate import evaluate as ev  # scikit-learn: the calibrate extra
    ds = load_dataset(args)
    if ds.issues:
        console.print(f"[yellow]{len(ds.issues)} bad rows skipped[/] (all listed in the JSON "
                      f"under bad_rows), e.g. {escape(str(ds.issues[0]))}")
    extra: dict[str, object] = {"bad_rows": [str(i) for i in ds.issues],
                                "data": str(args.data),
                                "ground_truth": ground_truth(args)}
    if args.dataset == "irene":
        evaluation = ev.evaluate_protocol(ds, ev.irene_methods(ds.features), args.protocol,
                                          progress=not args.no_progress)
        targets = ev.IRENE_TARGETS
    else:
        from vllm_piep.datasets.mlenergy import is_multimodal
        mm = is_multimodal(ds.trees)
        text = ds.subset(ds.trees.tree_id[~mm])
        evaluation = ev.evaluate_protocol(text, ev.mlenergy_methods(), args.protocol,
                                          progress=not args.no_progress)
        extra["multimodal"] = multimodal_apart(text, ds.subset(ds.trees.tree_id[mm]))
        extra["structures"] = str(args.structures)
        evaluation.notes.append("text LLMs only; multimodal deployments are scored apart "
                                "(predicted by the model trained on all text models)")
        evaluation.notes.append("no gpu_only baseline: this energy is the GPU's own NVML "
                                "reading, so a GPU-energy proxy would be the answer itself")
        targets = ev.MLENERGY_TARGETS
    # The targets are leave-one-model-out figures set on IrEne and ML.ENERGY v2; other
    # protocols and the v3 table report none.
    if args.protocol != "leave-one-model-out" or "v3" in str(extra["ground_truth"]):
        targets = {}
    result = ev.result_json(evaluation, targets, extra)
    out = Path(args.json)
    pred_path = out.with_name(out.name + ".predictions.parquet")
    result["predictions_file"] = pred_path.name
    write_atomic(pred_path, lambda p: evaluation.predictions.to_parquet(p, index=False))
    write_atomic(out, lambda p: Path(p).write_text(json.dumps(result, indent=1)))
    print_table(result, console)
    console.print(f"wrote {out} and {pred_path}")
    if args.html:
        from vllm_piep.calibrate.report import write_report
        page = write_report(result, evaluation.predictions, args.html)
        console.print(f"report: {page}")
    return result


def multimodal_apart(text: TreeDataset, mm: TreeDataset) -> dict[str, object]:
    """Multimodal deployments predicted by the predictor fitted on every text model."""
    from vllm_piep.calibrate import evaluate as ev
    if mm.trees.empty:
        return {}
    method = ev.mlenergy_methods()[0]
    pred = method.fit_predict(text, mm)
    nodes = mm.with_tree_columns(["model"])
    table = nodes.assign(method=method.name, level=nodes.level,
                         predicted_j=pred.reindex(ev._keys(nodes)).to_numpy(),
                         measured_j=nodes.energy_j)
    levels, per_model = ev.score(table)
    return {"levels": levels, "per_model": per_model}


def write_atomic(path: Path, write) -> None:  # type: ignore[no-untyped-def]
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def print_table(result: dict, console: Console) -> None:  # type: ignore[type-arg]
    levels = list(result["levels"])
    table = Table(title=f"{result['dataset']} {result['protocol']} "
                        f"({result['n_trees']} trees): MAPE %, mean over held-out models")
    table.add_column("method")
    for lv in levels:
        table.add_column(lv, justify="right")
    rows = [(result["method"], result["levels"])]
    rows += [(name, b["levels"]) for name, b in result["baselines"].items()]
    for name, lv in rows:
        table.add_row(name, *(f"{lv[x]['mape']:.2f}" if x in lv else "-" for x in levels))
    if result.get("targets"):
        table.add_row("target (<)", *(f"{result['targets'].get(x, float('nan')):.2f}"
                                      for x in levels))
    console.print(table)
    per = Table(title=f"{result['method']} per held-out model")
    per.add_column("model")
    for lv in levels:
        per.add_column(lv, justify="right")
    for model, values in result["per_model"].items():
        per.add_row(model, *(f"{values[x]:.2f}" if x in values else "-" for x in levels))
    console.print(per)
    mm = result.get("multimodal") or {}
    if mm.get("levels"):
        console.print(f"multimodal (apart): model MAPE {mm['levels']['model']['mape']:.2f} % "
                      f"over {mm['levels']['model']['n']} deployments")


# What `report` needs of an evaluation JSON and its predictions (both written by `evaluate`).
REPORT_KEYS: dict[str, type] = {"predictions_file": str, "levels": dict, "per_model": dict,
                                "baselines": dict}
PREDICTION_COLUMNS = ("model", "level", "method", "measured_j", "predicted_j")


def read_evaluation(path: str) -> tuple[dict[str, object], pd.DataFrame]:
    """An `evaluate --json` file and its predictions, checked; a UsageError names what is
    wrong."""
    src = existing_file(path, "evaluation JSON")
    try:
        result = json.loads(src.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"{src}: not JSON ({exc}), expected the file `evaluate --json` "
                         "wrote") from None
    if not isinstance(result, dict):
        raise UsageError(f"{src}: a JSON {type(result).__name__}, expected the object "
                         "`evaluate --json` writes")
    for key, kind in REPORT_KEYS.items():
        if not isinstance(result.get(key), kind):
            raise UsageError(f"{src}: field {key!r} is {result.get(key)!r}, expected a "
                             f"{kind.__name__} (a file `evaluate --json` writes)")
    pred_path = src.with_name(str(result["predictions_file"]))
    existing_file(pred_path, f"predictions file (named by {src} predictions_file)")
    try:
        pred = pd.read_parquet(pred_path)
    except Exception as exc:  # pyarrow raises several types for a file that is not parquet
        raise UsageError(f"{pred_path}: not a parquet table ({type(exc).__name__})") from None
    missing = [c for c in PREDICTION_COLUMNS if c not in pred.columns]
    if missing:
        raise UsageError(f"{pred_path}: missing columns {missing}")
    if not result["levels"] and pred.empty:
        raise UsageError(f"{src}: no levels and no predictions to report")
    return result, pred


def run_report(args: argparse.Namespace, console: Console) -> None:
    from vllm_piep.calibrate.report import write_report
    result, pred = read_evaluation(args.json)
    console.print(f"report: {write_report(result, pred, args.html)}")


def run_train(args: argparse.Namespace, console: Console) -> None:
    """Fit the evaluated main predictor on all of the dataset (text LLMs only for ML.ENERGY,
    as evaluated) and export it."""
    from vllm_piep.calibrate import evaluate as ev
    from vllm_piep.calibrate.export import export_bundle
    from vllm_piep.calibrate.train import TreePredictor
    ds = load_dataset(args)
    params: dict[str, object] = {}
    if args.dataset == "mlenergy":
        from vllm_piep.datasets.mlenergy import is_multimodal
        ds = ds.subset(ds.trees.tree_id[~is_multimodal(ds.trees)])
        params = ev.mlenergy_predictor()
    # The manifest's metrics: the same predictor scored leave-one-model-out on this data.
    scored = ev.leave_one_model_out(ds, [ev.tree_method(ev.MAIN, "", **params)],
                                    progress=not args.no_progress)
    levels, per_model = ev.score(scored.predictions)
    metrics = {"protocol": "leave-one-model-out", "mape_percent": levels,
               "per_model_percent": per_model}
    predictor = TreePredictor(**params).fit(ds)
    path = export_bundle(predictor, ds, args.out, hardware=args.hardware or ds.name,
                         command=" ".join(["python -m vllm_piep.calibrate", *sys.argv[1:]]),
                         metrics=metrics, ground_truth=ground_truth(args))
    console.print(f"bundle: {path}")


def run_campaign_command(args: argparse.Namespace, console: Console) -> int:
    from vllm_piep.calibrate.campaign import run_command
    from vllm_piep.calibrate.pipeline import finish_campaign

    status = run_command(args, console)  # a refused plan or a failed campaign: UsageError
    if status == 0:
        finish_campaign(Path(args.out), console, progress=not args.no_progress)
    return status


def run_from_metrics(args: argparse.Namespace, console: Console) -> None:
    from vllm_piep.calibrate.from_metrics import (
        correction_from_metrics,
        estimate_warning,
        read_metrics,
    )

    try:
        text = read_metrics(args.source)
        fit = correction_from_metrics(text, args.source)
    except OSError as exc:
        raise UsageError(f"{args.source}: cannot read ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise UsageError(f"{args.source}: not text, expected a Prometheus /metrics page") \
            from None
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    fit.write(Path(args.out))
    console.print(f"{fit.bundle}: static x {fit.static_ratio:.3g}, dynamic x "
                  f"{fit.dynamic_ratio:.3g} (from {fit.measured_joules:.4g} J by the meter "
                  f"{fit.meter or '(not recorded)'} against {fit.predicted_joules:.4g} J "
                  f"predicted, {fit.engines} engine(s)); wrote {args.out}: serve it with "
                  "`prior_correction`")
    warning = estimate_warning(fit)
    if warning is not None:  # an estimate corrects the prior: written, and said once
        print(f"{PROG} from-metrics: warning: {warning}", file=sys.stderr)


def print_whole(console: Console, table: Table) -> None:
    """Print a table with nothing cut: to a file or a pipe, which have no width, at its natural
    width, one line per row; in a narrower terminal its columns fold their headers and cells
    onto more lines (they must be made with overflow="fold")."""
    if not console.is_terminal:
        natural = Measurement.get(console, console.options.update_width(10_000), table).maximum
        console.width = max(console.width, natural)
    console.print(table)


def run_whatif(args: argparse.Namespace, console: Console) -> None:
    from vllm_piep.calibrate.whatif import EXTRAPOLATION_FACTOR, plot_whatif, whatif_table

    table = whatif_table(args.bundle, args.tp, args.batch, args.context, args.pp)
    grid = table.attrs["measured"]
    t = Table(title=f"what-if, {table.attrs['bundle_id']} (meter: {table.attrs['meter']}); "
                    f"measured: TP {grid['tp']}, batch {grid['batch']}")
    for col in ("tp", "batch", "measured_config", "extrapolated", "time_per_token_ms",
                "joules_per_token", "tokens_per_s", "static_share"):
        t.add_column(col, justify="right", overflow="fold")  # folded, never cut
    for r in table.itertuples():
        t.add_row(str(r.tp), str(r.batch), r.measured_config,
                  "yes" if r.extrapolated else "", f"{r.time_per_token_ms:.2f}"
                  + (" (floor)" if r.time_floored else ""),
                  f"{r.joules_per_token:.4g}" + (" (floor)" if r.energy_floored else ""),
                  f"{r.tokens_per_s:.1f}", f"{r.static_share:.0%}")
    print_whole(console, t)
    if table.extrapolated.any():
        console.print(f"extrapolated: outside the measured grid (up to {EXTRAPOLATION_FACTOR}x "
                      "it); (floor): the model's value fell below the physical lower bound "
                      "and the bound is shown (docs/calibration.md, what-if)")
    if args.png:
        console.print(f"plot: {plot_whatif(table, args.png)}")
    if args.json:
        rows = json.loads(table.to_json(orient="records", double_precision=15))
        write_atomic(Path(args.json),
                     lambda p: Path(p).write_text(json.dumps(rows, indent=1) + "\n"))
        console.print(f"rows: {args.json}")


def parser() -> argparse.ArgumentParser:
    from vllm_piep.calibrate.campaign import add_run_arguments

    p = OneLineParser(prog=PROG, description=__doc__, formatter_class=HelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, formatter_class=HelpFormatter)

    no_progress = {"action": "store_true", "help": "no progress bar"}
    run = command("run", "the profiling campaign on a real vLLM, then dataset, evaluation, "
                  "bundle and report (all in --out)")
    add_run_arguments(run)
    run.add_argument("--no-progress", **no_progress)
    fin = command("finish", "(re)build dataset, evaluation, bundle and report of a campaign")
    fin.add_argument("--out", required=True, help="the campaign directory (holds campaign.json)")
    fin.add_argument("--no-progress", **no_progress)
    wi = command("whatif", "predicted time and energy per output token across TP degrees and "
                 "batch sizes, from a campaign bundle; a point outside the campaign's measured "
                 "grid is marked extrapolated, one beyond 4x it refused, and no value is shown "
                 "below its physical lower bound (docs/calibration.md)")
    wi.add_argument("--bundle", required=True, help="a campaign bundle directory "
                    "(manifest.json), e.g. vllm_piep/bundles/cpu-tiny-llama")
    wi.add_argument("--tp", type=int_list, default=None,
                    help="tensor-parallel degrees, e.g. 1,2,4 (default: the TP degrees the "
                         "campaign measured)")
    wi.add_argument("--pp", type=positive_int, default=1, help="pipeline-parallel degree")
    wi.add_argument("--batch", type=int_list, default=None,
                    help="requests per decode step, e.g. 1,8,32 (default: the batch sizes the "
                         "campaign measured)")
    wi.add_argument("--context", type=positive_int, default=None,
                    help="tokens already in each request's context (default: the middle of "
                         "the campaign's measured contexts)")
    wi.add_argument("--png", default=None,
                    help="also write the plot (time vs energy per token) to this PNG file, in "
                         "an existing directory (default: no plot)")
    wi.add_argument("--json", default=None, metavar="PATH",
                    help="also write the rows to this JSON file, in an existing directory: a "
                         "list of objects with the table's fields and a few more, units in "
                         "their keys (time_per_token_ms, joules_per_token, tokens_per_s, "
                         "static_share a fraction of 1, context_tokens) (default: none)")
    for name in ("evaluate", "train"):
        s = command(name, "score the tree predictor and its baselines on published "
                    "measurements" if name == "evaluate" else
                    "fit the tree predictor on published measurements and export a bundle")
        s.add_argument("--dataset", choices=DATASETS, required=True,
                       help="irene: IrEne's device directory; mlenergy: an ML.ENERGY "
                            "leaderboard table (v2 or v3, told apart by its columns)")
        s.add_argument("--data", required=True, help="IrEne device directory or ML.ENERGY CSV")
        s.add_argument("--structures", help="model_structures.csv (needed with --dataset "
                       "mlenergy)")
        s.add_argument("--bad-rows", choices=[b.value for b in BadRows], default="skip",
                       help="skip: report bad rows and go on; reject: refuse the data")
        if name == "evaluate":
            s.add_argument("--protocol", choices=PROTOCOLS, default="leave-one-model-out",
                           help="how trees are held out")
            s.add_argument("--json", required=True, help="the evaluation JSON to write (the "
                           "per-node predictions go beside it, <JSON>.predictions.parquet)")
            s.add_argument("--html", help="also write the report (PNG + index.html) in this "
                           "directory (default: no report)")
        else:
            s.add_argument("--out", required=True, help="bundle directory to write")
            s.add_argument("--hardware", help="hardware label for the manifest (default: the "
                           "dataset's name)")
        s.add_argument("--no-progress", **no_progress)
    fm = command("from-metrics", "a prior correction from a measured server's /metrics "
                 "(piep_measured_ratio)")
    fm.add_argument("source", help="the server's /metrics URL, or a file it was saved to")
    fm.add_argument("--out", default="prior-correction.json", help="where to write it")
    prior_cli.add_arguments(sub, HelpFormatter)
    r = command("report", "the HTML report of an evaluation JSON")
    r.add_argument("--json", required=True, help="an evaluation JSON written by "
                   "`evaluate --json` (its predictions parquet beside it)")
    r.add_argument("--html", required=True, help="directory for index.html and the PNGs")
    return p


# Each command's options that name a file to write: its directory must exist.
OUTPUT_FILES = {"evaluate": ("json",), "whatif": ("png", "json"), "from-metrics": ("out",),
                "fit-prior": ("out",)}


def check_output_files(args: argparse.Namespace) -> None:
    """Refuse, before any work, an output file whose directory does not exist."""
    for dest in OUTPUT_FILES.get(args.command, ()):
        if getattr(args, dest, None):
            output_file(getattr(args, dest), f"--{dest}")


def dispatch(args: argparse.Namespace, console: Console) -> int:
    check_output_files(args)
    if args.command == "run":
        return run_campaign_command(args, console)
    if args.command == "finish":
        from vllm_piep.calibrate.pipeline import finish_campaign
        finish_campaign(Path(args.out), console, progress=not args.no_progress)
    elif args.command == "whatif":
        run_whatif(args, console)
    elif args.command == "evaluate":
        run_evaluate(args, console)
    elif args.command == "report":
        run_report(args, console)
    elif args.command == "from-metrics":
        run_from_metrics(args, console)
    elif args.command == "fit-prior":
        prior_cli.run_fit_prior(args, console)
    elif args.command == "validate-prior":
        prior_cli.run_validate_prior(args, console)
    else:
        run_train(args, console)
    return 0


# Errors that name bad input (a file, a field, a value) rather than a bug.
INPUT_ERRORS = (DatasetError, ProtocolError, BundleError, FitError, CampaignError)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    console = Console()

    def work() -> int:
        try:
            return dispatch(args, console)
        except INPUT_ERRORS as exc:
            raise UsageError(str(exc)) from None
        except OSError as exc:  # an unreadable input or unwritable output path
            where = f"{exc.filename}: " if exc.filename else ""
            raise UsageError(f"{where}{exc.strerror or exc}") from None
    return run_cli(f"{PROG} {args.command}", work)


if __name__ == "__main__":
    sys.exit(main())
