"""See what a policy kept: the eviction trace's file (trace.py; the records are
:mod:`reasonkv.cache.decisions`), the runs of ``reasonkv inspect`` and the page that shows them."""

from reasonkv.inspect.trace import Eviction, Trace, load_trace, save_trace

__all__ = ["Eviction", "Trace", "load_trace", "save_trace"]
