"""Test helpers that ship with pdflow, for its own tests and for third-party plugins.

- :mod:`pdflow.testing.transport_conformance`: the checks every KV transport must pass.
- :mod:`pdflow.testing.server`: ``PdflowServer``, a `pdflow run` on free ports in a subprocess.
"""
