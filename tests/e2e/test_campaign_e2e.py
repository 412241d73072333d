"""The whole campaign on a real vLLM, as CI runs it: `python -m vllm_piep.calibrate run --quick`
on the tiny model (TP 1 and 2, CPU estimate meter), its dataset, evaluation, bundle and report;
then `vllm serve` with the new bundle, whose response energies must equal the bundle's offline
prediction for the same steps (read back from the server's step spans) within 1 %.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from tests.support.servers import serve
from vllm_piep.calibrate.campaign_data import CampaignData
from vllm_piep.model.flops import ModelShape, StepTotals
from vllm_piep.predict.bundle import TreeBundle
from vllm_piep.predict.served import SERVE_FEATURES, reference_step_joules
from vllm_piep.spans.reader import SpanSet, span_files
from vllm_piep.tools.server import ServerOptions

# The campaign measures idle and replay energy: a neighbour's load would be counted in it.
pytestmark = [pytest.mark.timeout(1800), pytest.mark.server, pytest.mark.alone]


@pytest.fixture(scope="module")
def campaign(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("campaign") / "quick"
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_piep.calibrate", "run", "--quick", "--model",
         str(tiny_model), "--out", str(out), "--no-progress"],
        capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (out / "run.log").write_text(proc.stdout + proc.stderr)
    return out


@pytest.fixture(scope="module")
def data(campaign: Path) -> CampaignData:
    return CampaignData.load(campaign / "dataset")


def test_every_configuration_and_cell_is_in_the_dataset(campaign: Path,
                                                        data: CampaignData) -> None:
    state = json.loads((campaign / "campaign.json").read_text())
    assert state["finished"]
    expected = {f"{config}/{cell}" for config, entry in state["configs"].items()
                for cell in entry["cells"]}
    assert len(expected) == 2 * 4  # tp 1, 2 x batch 1, 4 x two lengths
    assert set(data.dataset.trees.group) == expected
    assert data.dataset.issues == []  # every span mapped onto the tree
    trees = data.dataset.trees
    assert set(trees.tp) == {1.0, 2.0}
    # each cell's steps computed exactly its requests' tokens: no step lost or doubled
    roots = data.dataset.nodes[data.dataset.nodes.parent_id == ""].merge(
        trees[["tree_id", "group"]], on="tree_id")
    for group, g in roots.groupby("group"):
        config, cell = group.split("/")
        c = state["configs"][config]["cells"][cell]
        assert g.prefill_tokens.sum() == c["prompt_tokens"]
        # vLLM computes every output token but the last, which is sampled and not fed back
        assert g.decode_tokens.sum() == c["completion_tokens"] - c["requests"]


def test_leaves_are_measured_by_repeated_sampling(data: CampaignData) -> None:
    n = data.dataset.nodes
    replayed = n[n.energy_source == "replay"]
    tp2 = n[n.tree_id.isin(data.dataset.trees.tree_id[data.dataset.trees.tp == 2])]
    for kind in ("embedding", "attention", "mlp", "attention_norm", "mlp_norm", "final_norm",
                 "logits"):
        assert (replayed.type == kind).sum() >= 3, kind
    assert (tp2.energy_source == "replay").any() and (tp2[tp2.type == "transfer"]
                                                       .energy_j.notna().sum() >= 3)
    # each sample window held many calls and lasted several meter resolutions
    s = data.samples
    assert (s.calls >= 2).all()
    resolution = data.static.resolution_s.max()
    assert s.seconds.median() >= 2 * resolution
    assert (n[n.energy_source == "window"].parent_id == "").all()
    assert (n.node_id == "overhead").sum() == len(data.dataset.trees)
    assert n[n.energy_source == "remainder"].energy_j.gt(0).all()
    assert (n[n.energy_source == "remainder"].node_id == "overhead").all()


def test_wait_quantiles_for_all_reduce(data: CampaignData) -> None:
    sync = data.sync.set_index(["config", "op"])
    row = sync.loc[("tp2-pp1", "all_reduce")]
    assert row.n >= 50
    q = [row[c] for c in ("q05_s", "q25_s", "q50_s", "q75_s", "q95_s")]
    assert q == sorted(q) and q[-1] > 0
    assert ("tp1-pp1", "all_reduce") not in sync.index
    n = data.dataset.nodes
    waits = n[n.node_id.str.endswith("@all_reduce/wait")]
    assert len(waits) and (waits.wait_s == row.mean_s).all()  # the serve path's feature
    assert waits.energy_source.eq("sync-sampling").all()
    # what each step's own waits drew is kept beside the estimate, and averages near it
    observed = waits.observed_wait_j.dropna()
    assert len(observed) > 100
    assert observed.mean() == pytest.approx(waits.energy_j.mean(), rel=0.5)


def test_evaluation_report_and_bundle(campaign: Path) -> None:
    ev = campaign / "evaluation"
    kfold = json.loads((ev / "kfold.json").read_text())
    assert {"module", "communication", "model"} <= set(kfold["levels"])
    assert {"tokens", "per_level"} <= set(kfold["baselines"])
    assert "cpu-estimate" in kfold["ground_truth"]
    batch_out = json.loads((ev / "leave-one-batch-out.json").read_text())
    assert set(batch_out["per_fold"]) == {"batch 1", "batch 4"}
    tp_out = json.loads((ev / "leave-one-tp-out.json").read_text())
    # held-out TP 2 has collectives no TP 1 tree has: reported missing, not guessed
    assert tp_out["levels"]["communication"]["n_missing"] > 0
    page = (campaign / "report" / "index.html").read_text()
    for png in ("sync_waits.png", "sampling_spread.png", "whatif.png"):
        assert png in page and (campaign / "report" / png).stat().st_size > 1000
    for protocol in ("kfold", "leave-one-batch-out", "leave-one-tp-out"):  # each its own page
        assert f"href='{protocol}/index.html'" in page
        assert (campaign / "report" / protocol / "residuals.png").is_file()
    manifest = json.loads((campaign / "bundle" / "manifest.json").read_text())
    assert manifest["serving"]["features_supplied_by_serve_path"] == list(SERVE_FEATURES)
    assert manifest["serving"]["meter"].startswith("cpu-estimate (estimated)")
    log = (campaign / "run.log").read_text()  # one line said the bundle is an estimate
    assert sum(line.startswith("warning: the bundle is fitted to cpu-estimate")
               for line in log.splitlines()) == 1, log[-4000:]
    assert "vllm_piep.calibrate run" in manifest["how_to_remake"]
    assert set(manifest["serving"]["templates"]) == {"tp1-pp1", "tp2-pp1"}
    TreeBundle.load(campaign / "bundle")


def test_whatif_command(campaign: Path, tmp_path: Path) -> None:
    png = tmp_path / "w.png"
    proc = subprocess.run([sys.executable, "-m", "vllm_piep.calibrate", "whatif", "--bundle",
                           str(campaign / "bundle"), "--tp", "1,2,4", "--batch", "1,4",
                           "--png", str(png)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert "tp2-pp1" in proc.stdout  # TP 4 predicted from the nearest measured config


# ------------------------------------------------------------------ serving the new bundle
@pytest.fixture(scope="module")
def served(campaign: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> tuple[list[dict[str, Any]], Path]:
    work = tmp_path_factory.mktemp("served")
    config = {"piep": {"bundle": str(campaign / "bundle"), "spans_dir": str(work / "spans")}}
    options = ServerOptions(model=str(tiny_model),
                            extra_args=["--additional-config", json.dumps(config)])
    responses = []
    for server in serve(options, work):
        # one request at a time: each step belongs to one request
        for n, prompt in ((4, [60] * 9), (11, [61] * 30), (7, [62] * 5)):
            start = time.monotonic_ns()
            body = server.post("/v1/completions", {"model": "model", "prompt": prompt,
                                                   "max_tokens": n, "ignore_eos": True})
            responses.append({"start_ns": start, "end_ns": time.monotonic_ns(),
                              "usage": body["usage"]})
    return responses, work / "spans"


def test_served_energy_is_the_bundles_offline_prediction(campaign: Path, served) -> None:
    responses, spans_dir = served
    bundle = TreeBundle.load(campaign / "bundle")
    spans = SpanSet.read(span_files(spans_dir))
    shape = ModelShape(**spans.files[0].header.shape)
    steps = spans.steps[spans.steps.num_reqs > 0]
    for r in responses:
        energy = r["usage"]["energy"]
        # fitted to the CPU estimate: an estimate, and the bundle id names the meter
        assert energy["source"] == "estimated"
        assert energy["bundle"] == f"{bundle.bundle_id} (fit to cpu-estimate)"
        mine = steps[(steps.start_ns >= r["start_ns"]) & (steps.end_ns <= r["end_ns"])]
        assert len(mine) == r["usage"]["completion_tokens"]  # one step per output token
        offline = sum(reference_step_joules(
            bundle, shape, StepTotals(float(s.prefill_tokens + s.decode_tokens),
                                      float(s.attended_pairs), float(s.context_tokens),
                                      float(s.sampled_rows)), float(s.num_reqs),
            s.worker_ns / 1e9) for s in mine.itertuples())
        assert energy["joules"] == pytest.approx(offline, rel=0.01)
        breakdown = energy["breakdown"]
        assert sum(breakdown.values()) == pytest.approx(energy["joules"], rel=1e-9)
        assert breakdown["allreduce"] == 0 and breakdown["attention"] > 0


def test_dataset_features_are_what_the_serve_path_computes(campaign: Path,
                                                           data: CampaignData) -> None:
    """Training rows carry exactly the features `step_nodes` gives the serve path."""
    from vllm_piep.predict.served import StepTemplate, step_nodes, template_of

    ds = data.dataset
    trees = ds.trees.set_index("tree_id")
    shape0 = ModelShape(**json.loads((campaign / "bundle" / "manifest.json").read_text())[
        "serving"]["shape"])
    for tree_id in ds.trees.tree_id.iloc[::25]:
        g = ds.nodes[ds.nodes.tree_id == tree_id].reset_index(drop=True)
        root = g[g.parent_id == ""].iloc[0]
        shape = ModelShape(**{**shape0.__dict__, "tp": int(trees.tp[tree_id])})
        f = step_nodes(StepTemplate.build(template_of(g)), shape, StepTotals(
            float(root.prefill_tokens + root.decode_tokens), float(root.attended_pairs),
            float(root.context_tokens), float(root.sampled_rows)), float(root.batch_size), {})
        np.testing.assert_allclose(f.gflop, g.gflop, rtol=1e-12)
        np.testing.assert_allclose(f.mem_mib, g.mem_mib, rtol=1e-12)
        pd.testing.assert_series_equal(f.calls, g.calls, check_names=False)
