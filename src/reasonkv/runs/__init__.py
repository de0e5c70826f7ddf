"""What a run leaves on disk, shared by every command (``eval``, ``report``, ``bench``, ``calibrate``).

- :mod:`~reasonkv.runs.store`: the append-only JSON Lines store of records: resumable, locked, flushed
  record by record;
- :mod:`~reasonkv.runs.outputs`: which outputs a command may write (its own only), the locks that keep
  one writer per output, files written whole;
- :mod:`~reasonkv.runs.machine`: the machine a run is on;
- :mod:`~reasonkv.runs.digest`: a file's SHA-256.

Nothing here imports torch: ``reasonkv report`` reads results without it.
"""
