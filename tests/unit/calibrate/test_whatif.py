"""`calibrate whatif` on the shipped campaign bundle: no physically impossible value, points
outside the measured grid marked and refused beyond the stated factor, units in the column
names, and a plot only where asked."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.support.paths import SHIPPED_BUNDLE
from vllm_piep.calibrate.__main__ import main
from vllm_piep.calibrate.campaign import CampaignPlan
from vllm_piep.calibrate.whatif import (
    EXTRAPOLATION_FACTOR,
    _batch_time_floor,
    measured_grid,
    plot_whatif,
    whatif_table,
)
from vllm_piep.cli_errors import UsageError
from vllm_piep.predict.bundle import TreeBundle


@pytest.fixture(scope="module")
def grid():  # type: ignore[no-untyped-def]
    return measured_grid(TreeBundle.load(SHIPPED_BUNDLE).manifest, "manifest.json")


def test_the_grid_is_the_campaign_that_made_the_bundle(grid) -> None:  # type: ignore[no-untyped-def]
    manifest = TreeBundle.load(SHIPPED_BUNDLE).manifest
    assert "--quick" in manifest["how_to_remake"]  # so the grid is the quick preset's
    quick = CampaignPlan.quick("m")
    assert list(grid.batch) == sorted(quick.batch)
    assert list(grid.tp) == sorted(quick.tp)
    assert grid.context == (quick.prompt_tokens, quick.prompt_tokens + max(quick.out_len))


def test_default_is_the_measured_grid_and_every_value_is_physical(grid) -> None:  # type: ignore[no-untyped-def]
    table = whatif_table(SHIPPED_BUNDLE)
    assert set(table.tp) == set(grid.tp) and set(table.batch) == set(grid.batch)
    assert not table.extrapolated.any()
    assert {"time_per_token_ms", "joules_per_token", "tokens_per_s"} <= set(table.columns)
    assert not any(c.endswith("_s") and "per_s" not in c for c in table.columns)


def test_beyond_the_measured_batches_time_and_energy_stay_bounded(grid) -> None:  # type: ignore[no-untyped-def]
    top = max(grid.batch)
    batches = [1, top, 2 * top, EXTRAPOLATION_FACTOR * top]
    table = whatif_table(SHIPPED_BUNDLE, [*grid.tp, 2 * max(grid.tp)], batches)
    for col in ("time_per_token_ms", "joules_per_token", "tokens_per_s"):
        assert (table[col] > 0).all() and table[col].map(math.isfinite).all(), col
    assert table.static_share.between(0, 1).all()
    expected = (table.batch > top) | ~table.tp.isin(grid.tp)
    assert (table.extrapolated == expected).all()
    for tp in grid.tp:
        rows = table[table.tp == tp].set_index("batch")
        # more requests per step are more work: never faster than the largest measured batch
        assert (rows.time_per_token_ms[rows.index > top] >= rows.time_per_token_ms[top]).all()
        step_j = rows.joules_per_token * rows.index
        assert (step_j[rows.index > top] >= step_j[top] - 1e-12).all()
    # the step-time model falls with batch on this bundle: the bound is what is shown
    assert table[table.batch > top].time_floored.any()


def test_the_time_floor_follows_a_per_step_plus_per_request_cost() -> None:
    measured = {1: 5e-3, 4: 4e-3}  # a model that (wrongly) gets faster with more requests
    assert _batch_time_floor(measured, 16) == 5e-3  # not below any smaller measured batch
    assert _batch_time_floor({4: 8e-3}, 2) == 4e-3  # time per request does not grow below
    assert _batch_time_floor({}, 3) == 0.0


def test_points_beyond_the_factor_are_refused(grid) -> None:  # type: ignore[no-untyped-def]
    top = max(grid.batch)
    whatif_table(SHIPPED_BUNDLE, [1], [EXTRAPOLATION_FACTOR * top])  # the limit itself is fine
    with pytest.raises(UsageError, match=rf"--batch {EXTRAPOLATION_FACTOR * top + 1}: outside"):
        whatif_table(SHIPPED_BUNDLE, [1], [EXTRAPOLATION_FACTOR * top + 1])
    with pytest.raises(UsageError, match="--tp"):
        whatif_table(SHIPPED_BUNDLE, [EXTRAPOLATION_FACTOR * max(grid.tp) + 1], [1])
    with pytest.raises(UsageError, match="--context"):
        whatif_table(SHIPPED_BUNDLE, [1], [1], context=EXTRAPOLATION_FACTOR * grid.context[1] + 1)


def test_the_cli_writes_a_plot_only_where_asked(tmp_path: Path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "200")  # the whole table on one line per row
    assert main(["whatif", "--bundle", str(SHIPPED_BUNDLE), "--batch", "1,8,16"]) == 0
    out = capsys.readouterr().out
    assert "time_per_token_ms" in out and "extrapolated" in out and "nan" not in out
    assert list(tmp_path.iterdir()) == []  # no ./whatif.png
    png = tmp_path / "plots" / "w.png"
    png.parent.mkdir()  # an output file's directory must exist
    assert main(["whatif", "--bundle", str(SHIPPED_BUNDLE), "--tp", "1,4", "--png",
                 str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_the_plot_draws_extrapolated_points_hollow(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import matplotlib.pyplot as plt

    table = whatif_table(SHIPPED_BUNDLE, [1], [1, 4, 16])
    seen = []
    monkeypatch.setattr(plt, "close", lambda fig: seen.append(fig))
    plot_whatif(table, tmp_path / "w.png")
    ax = seen[0].axes[0]
    faces = [c.get_facecolors() for c in ax.collections if len(c.get_offsets())]
    filled = [len(f) > 0 and f[0][3] > 0 for f in faces]
    n_points = [len(c.get_offsets()) for c in ax.collections if len(c.get_offsets())]
    # one filled collection of the measured points, one hollow of the extrapolated one
    assert sorted(zip(filled, n_points)) == [(False, 1), (True, 2)]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "extrapolated" in legend


def test_the_grid_of_a_full_run_command_is_read_with_runs_own_flags() -> None:
    from vllm_piep.calibrate.pipeline import remake_command

    plan = CampaignPlan(model="/m", tp=[1, 2], batch=[2, 8], out_len=[16, 40],
                        prompt_tokens=20)
    manifest = {"how_to_remake": remake_command(plan.model_dump()),  # ends in a # comment
                "serving": {"templates": {"tp1-pp1": [], "tp2-pp1": []}}}
    grid = measured_grid(manifest, "manifest.json")
    assert (grid.tp, grid.batch, grid.context) == ((1, 2), (2, 8), (20, 60))


def test_piped_the_table_keeps_every_header_whole_and_json_holds_the_rows(
        tmp_path: Path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    """Into a pipe or a file (no terminal, so no width to fit) the table prints at its natural
    width: every column name whole, with its unit, and one line per row; --json writes the same
    rows with the frame's fields, units in their keys."""
    import json

    monkeypatch.delenv("COLUMNS", raising=False)  # what a pipe gives rich: 80 columns
    rows = tmp_path / "rows.json"
    argv = ["whatif", "--bundle", str(SHIPPED_BUNDLE), "--tp", "1,2,4", "--batch", "1,4,8"]
    assert main([*argv, "--json", str(rows)]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "tp" in line and "batch" in line)
    for name in ("measured_config", "extrapolated", "time_per_token_ms", "joules_per_token",
                 "tokens_per_s", "static_share"):
        assert name in header, (name, header)
    assert "…" not in out
    table = whatif_table(SHIPPED_BUNDLE, [1, 2, 4], [1, 4, 8])
    body = [line for line in out.splitlines() if "-pp1" in line]
    assert len(body) == len(table)  # no row folded over two lines
    written = json.loads(rows.read_text())
    assert [(r["tp"], r["batch"]) for r in written] == list(zip(table.tp, table.batch))
    assert set(written[0]) == set(table.columns)
    assert {"time_per_token_ms", "joules_per_token", "tokens_per_s", "context_tokens"} \
        <= set(written[0])
    for row, (_, expected) in zip(written, table.iterrows(), strict=True):
        assert row["joules_per_token"] == pytest.approx(expected.joules_per_token, rel=1e-12)
        assert row["static_share"] == pytest.approx(expected.static_share, rel=1e-12)
        assert row["extrapolated"] is bool(expected.extrapolated)
