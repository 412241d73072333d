"""Meters: NVML, RAPL, an external power log, a CPU estimate, a simulator (tests only), behind
one interface (`common.Meter`)."""
