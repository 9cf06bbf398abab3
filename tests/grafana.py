"""The shipped Grafana dashboard (deploy/grafana/pdflow.json), as the tests read it."""

from __future__ import annotations

import json
import re
from pathlib import Path


DASHBOARD = Path(__file__).parent.parent / "deploy" / "grafana" / "pdflow.json"
# series that exist only where a feature is on: speculative decoding (tests/test_e2e_speculative.py
# scrapes them from a server that drafts)
ONLY_WITH_SPECULATION = {"vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_draft_tokens_total"}


def dashboard_metrics() -> set[str]:
    """Every metric name the shipped Grafana dashboard's queries read."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    exprs = [target["expr"] for panel in panels for target in panel["targets"]]
    assert exprs
    return {name for expr in exprs for name in re.findall(r"\b(?:vllm:|pdflow_)[a-z0-9_:]+", expr)}


def scraped_series(text: str) -> set[str]:
    """The sample names in a scrape, parsed by prometheus_client's own parser (the exposition
    format as Prometheus reads it)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}
