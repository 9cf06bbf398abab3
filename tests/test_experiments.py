"""The experiments directory and what its scripts share: every script in the index and every
documented command pointing at a file that exists; the traces' source named where a trace is
missing; the preamble's parser, trace flag and reproduce command. No server is started."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from pdflow.bench import experiments, traces
from pdflow.bench.workloads import WorkloadSpec, trace_rows
from pdflow.plan.capacity import read_trace

REPO = Path(__file__).parents[1]
EXPERIMENTS = REPO / "experiments"
DOCS = [REPO / "README.md", EXPERIMENTS / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_every_experiment_is_in_the_index_and_every_indexed_script_exists() -> None:
    index = (EXPERIMENTS / "README.md").read_text()
    listed = set(re.findall(r"^\| `([\w./]+\.py)` \|", index, re.MULTILINE))
    on_disk = {path.name for path in EXPERIMENTS.glob("*.py")}
    assert on_disk - listed == set(), "experiments missing from experiments/README.md"
    assert {name for name in listed if not (EXPERIMENTS / name).resolve().is_file()} == set()


def test_every_script_the_docs_name_exists() -> None:
    named = {(doc.name, path) for doc in DOCS
             for path in re.findall(r"\b((?:experiments|scripts)/[\w.-]+\.(?:py|sh))", doc.read_text())}
    missing = sorted((doc, path) for doc, path in named if not (REPO / path).is_file())
    assert named and missing == []


def test_a_missing_trace_says_where_to_get_one(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as caught:
        traces.existing(tmp_path / "conversation_trace.jsonl")
    message = str(caught.value)
    assert str(tmp_path / "conversation_trace.jsonl") in message
    assert "kvcache-ai/Mooncake" in message and "Apache License 2.0" in message
    assert ("curl -LO https://raw.githubusercontent.com/kvcache-ai/Mooncake/main/FAST25-release/traces/"
            "conversation_trace.jsonl") in message


def test_a_trace_that_is_there_is_read_by_every_reader(tmp_path: Path) -> None:
    trace = tmp_path / "mine.jsonl"
    trace.write_text('{"timestamp": 5, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}\n'
                     '{"timestamp": 1, "input_length": 10, "output_length": 2, "hash_ids": [1]}\n')
    assert traces.existing(trace) == trace
    assert [row["timestamp"] for row in read_trace(trace)] == [1, 5]
    assert [row["timestamp"] for row in trace_rows(WorkloadSpec("trace", path=str(trace)))] == [1, 5]
    with pytest.raises(FileNotFoundError, match="Mooncake"):
        read_trace(tmp_path / "absent.jsonl")
    with pytest.raises(FileNotFoundError, match="Mooncake"):
        trace_rows(WorkloadSpec("trace", path=str(tmp_path / "absent.jsonl")))


def test_the_parser_has_out_trace_and_slo_flags_with_the_source_in_the_help() -> None:
    parser = experiments.experiment_parser("Doc.\n\n    the command, as written", "thing")
    experiments.add_trace_argument(parser)
    experiments.add_slo_arguments(parser, ttft_ms=2000.0, tbt_ms=100.0)
    opts = parser.parse_args([])
    assert opts.out == experiments.ROOT / "bench-results" / "thing"
    assert opts.trace == experiments.ROOT.parent / "shared" / "traces" / "conversation_trace.jsonl"
    assert (opts.slo_ttft, opts.slo_tbt) == (2000.0, 100.0)
    help_text = " ".join(parser.format_help().split())
    assert "    the command, as written" in parser.format_help()  # the docstring's layout kept
    assert "kvcache-ai/Mooncake" in help_text and "Apache License 2.0" in help_text and "curl -LO" in help_text


def test_the_reproduce_command_is_relative_to_the_checkout() -> None:
    script = str(EXPERIMENTS / "experiment_routing.py")
    assert experiments.command([script, "--parts", "fetch", "--out", "a b"]) == (
        ".venv/bin/python experiments/experiment_routing.py --parts fetch --out 'a b'")
    assert experiments.command(["/elsewhere/x.py"]) == ".venv/bin/python /elsewhere/x.py"


def test_an_experiment_stops_before_any_server_when_its_trace_is_missing(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(EXPERIMENTS / "experiment_routing.py"), "--trace",
                           str(tmp_path / "conversation_trace.jsonl"), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 1
    assert "no such trace file" in done.stderr and "FAST25-release/traces/" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "out").exists()


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_within_benchmarks_md_names_one_of_its_headings() -> None:
    text = (REPO / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    anchors = {_slug(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}
    links = re.findall(r"\]\(#([^)]+)\)", text)
    assert len(links) >= 20
    assert sorted(set(links) - anchors) == []
