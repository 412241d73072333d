"""The profiling campaign of `python -m vllm_piep.calibrate run`: real vLLM servers in detail
mode over a grid of parallel layouts and workloads, with a meter logging all along.

Configs are the parallel layouts `tp{t}-pp{p}`; cells are the workloads `b{batch}-o{out_len}`
(`batch` concurrent requests of `prompt_tokens` prompt tokens each, `out_len` output tokens each,
`ignore_eos`). Each config runs on one vLLM server start, an *attempt*:

    OUT/campaign.json                     the state, rewritten atomically after every cell
    OUT/runs/<config>/attempt-<k>/spans/  every rank's span file (detail mode)
                                  meter.jsonl  the meter's readings over the whole attempt
                                  idle.json    the idle window measured after the server is ready
                                  server.log   vLLM's output

Timestamps (cell windows, the idle window) are CLOCK_MONOTONIC nanoseconds, the clock of the
meter log and the span files, so energies are computed afterwards by aligning the three.

The campaign can be interrupted (Ctrl-C, SIGTERM) or crash at any point: a cell counts as done
only once it is in the saved state, the server of the attempt is always stopped (its process
group and shared-memory files), and `resume=True` goes on with a new attempt for every config
that is not done, skipping the cells that are.

One module per job, each importing only those above it:

- `plan`: `CampaignPlan` (the grid, the meter, the vLLM options; checked against this machine's
  cores) and `CampaignError`, which stops a campaign;
- `servers`: the vLLM options of an attempt (`server_options`, with `omp_bind`'s disjoint cores
  per CPU rank) and `stop_stale_server` for the servers of killed drivers;
- `state`: `OUT/campaign.json` (`CampaignState` and its records), saved by `write_atomic`,
  opened or resumed by `open_state`;
- `prompts`: `vocab_size` and `prompt_ids`, the same token ids in every attempt;
- `recording`: `MeterRecording` (the meter's log over an attempt) and `measure_idle`;
- `load`: `run_cell`, a cell's concurrent requests, timed and checked;
- `driver`: `run_campaign`, the loop over configs and attempts;
- `cli`: the `run` command's flags, plan and exit status.
"""

from vllm_piep.calibrate.campaign.cli import (
    add_run_arguments,
    int_list,
    plan_from_args,
    run_command,
)
from vllm_piep.calibrate.campaign.driver import run_campaign
from vllm_piep.calibrate.campaign.plan import CampaignError, CampaignPlan
from vllm_piep.calibrate.campaign.prompts import prompt_ids
from vllm_piep.calibrate.campaign.state import STATE_FILE, CampaignState

__all__ = [
    "STATE_FILE",
    "CampaignError",
    "CampaignPlan",
    "CampaignState",
    "add_run_arguments",
    "int_list",
    "plan_from_args",
    "prompt_ids",
    "run_campaign",
    "run_command",
]
