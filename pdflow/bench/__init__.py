"""Benchmarks behind ``pdflow bench``: each prints its baselines beside it, as ratios from the same
run, and the command that repeats it.

- :mod:`pdflow.bench.transfer`: ``pdflow bench transfer``, KV chunks through each transport
  between two processes, against memcpy and a plain socket.
"""
