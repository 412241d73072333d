"""Offline kernel-level traces (torch.profiler/Kineto JSON, Nsight Systems exports) turned into
the plugin's span records.

Not implemented yet: it arrives with detail mode (issue #3), which defines the span records
this package will produce. Importing it works; it offers nothing else so far.
"""
