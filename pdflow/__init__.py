"""pdflow: disaggregated LLM inference. Prefill and decode run in separate processes and the KV
cache streams from one to the other layer by layer while prefill is still computing."""

__version__ = "0.1.0"
