"""Loaded by every Python process started with this folder on PYTHONPATH: traces its GC pauses
and loop lateness when $STALL_TRACE_DIR is set (stall_tracer.py)."""

import stall_tracer

stall_tracer.install_from_env()
