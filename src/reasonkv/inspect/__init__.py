"""See what a policy kept: the eviction trace (trace.py) and the page that shows it (``reasonkv inspect``)."""

from reasonkv.inspect.trace import Eviction, Trace, TraceRecorder, load_trace, save_trace

__all__ = ["Eviction", "Trace", "TraceRecorder", "load_trace", "save_trace"]
