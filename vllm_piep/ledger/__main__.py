"""`python -m vllm_piep.ledger`: read billing ledgers (the `ledger` option's files).

  summary  energy by tenant, model, day... over one or many ledgers
  export   every row, to Parquet or CSV, for a warehouse or a notebook
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence

from vllm_piep.cli_errors import HelpFormatter, OneLineParser, output_file, run_cli
from vllm_piep.ledger import summary

PROG = "python -m vllm_piep.ledger"


def parser() -> OneLineParser:
    top = OneLineParser(prog=PROG, description=__doc__, formatter_class=HelpFormatter)
    commands = top.add_subparsers(dest="command", required=True)
    for name, text in (("summary", "energy summed by the --by keys"),
                       ("export", "every row to a Parquet or CSV file")):
        sub = commands.add_parser(name, help=text, description=text,
                                  formatter_class=HelpFormatter)
        sub.add_argument("paths", nargs="+", metavar="PATH", help="ledger files")
        sub.add_argument("--since", help="rows recorded at or after this UTC date, date-time "
                         "or Unix second")
        sub.add_argument("--until", help="rows recorded before this")
        if name == "summary":
            sub.add_argument("--by", default="tenant,model,day",
                             help=f"grouping keys, comma-separated: {', '.join(summary.KEYS)}")
            sub.add_argument("--format", choices=("table", "csv", "json"), default="table")
        else:
            sub.add_argument("--out", required=True, help="the file to write")
            sub.add_argument("--format", choices=("parquet", "csv"), default="parquet")
    return top


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return run_cli(PROG, lambda: _run(args))


def _run(args) -> int:  # type: ignore[no-untyped-def]
    since = None if args.since is None else summary.parse_time(args.since, "--since")
    until = None if args.until is None else summary.parse_time(args.until, "--until")
    if args.command == "export":
        out = output_file(args.out, "--out")
        frame = summary.export_frame(summary.read(args.paths, since, until))
        if args.format == "parquet":
            import pyarrow  # noqa: F401  (the calibrate extra; named if missing)

            frame.to_parquet(out, index=False)
        else:
            frame.to_csv(out, index=False)
        print(f"{len(frame)} rows -> {out}")
        return 0
    keys = summary.parse_keys(args.by)
    table = summary.summarize(summary.read(args.paths, since, until), keys)
    if args.format == "csv":
        sys.stdout.write(summary.to_csv(table, keys))
    elif args.format == "json":
        print(summary.to_json(table))
    else:
        _print_table(table, keys)
    return 0


def _print_table(table: list[dict], keys: Sequence[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    view = Table(*keys, title="Energy by " + ", ".join(keys) if keys else "Energy")
    for name in ("requests", "joules", "kWh", "gCO2e", "prompt tok", "output tok"):
        view.add_column(name, justify="right")
    figure = summary.significant  # 4 significant digits: a request's joules are small
    for row in table:
        view.add_row(*("-" if row[k] is None else str(row[k]) for k in keys),
                     str(row["requests"]), figure(row["joules"]),
                     figure(row["joules"] / 3.6e6),
                     "-" if row["gco2e"] is None else figure(row["gco2e"]),
                     str(row["prompt_tokens"]), str(row["output_tokens"]))
    total = math.fsum(r["joules"] for r in table)
    view.add_section()
    view.add_row(*(["total"] + [""] * (len(keys) - 1) if keys else []),
                 str(sum(r["requests"] for r in table)), figure(total), figure(total / 3.6e6),
                 "", "", "")
    Console().print(view)


if __name__ == "__main__":
    sys.exit(main())
