"""The one clock every timestamp of the plugin is read on."""

from __future__ import annotations

import time

now_ns = time.perf_counter_ns  # CLOCK_MONOTONIC on Linux, shared by all processes of a host
