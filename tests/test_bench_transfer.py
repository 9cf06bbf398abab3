"""``pdflow bench transfer``: a smoke run with tiny sizes through tcp, shaped and not."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from pdflow import transports
from pdflow.bench.transfer import _count, rotated
from pdflow.bench.transfer_cells import Budget, workloads
from pdflow.cli import main

TINY = ["--transports", "tcp", "--kv-tokens", "8,32", "--raw-sizes", "4KiB,64KiB", "--round-bytes", "256KiB",
        "--repeat", "1", "--seconds", "0.5", "--passes", "2"]  # fmt: skip


def test_smoke_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json, out_png = tmp_path / "transfer.json", tmp_path / "img" / "transfer.png"
    assert main(["bench", "transfer", *TINY, "--json", str(out_json), "--plot", str(out_png)]) == 0
    doc = json.loads(out_json.read_text())
    names = ["kv 8 tok", "kv 32 tok", "raw 4 KiB", "raw 64 KiB"]
    assert [w["name"] for w in doc["workloads"]] == names
    assert doc["workloads"][0]["chunks"] == 60 and doc["workloads"][0]["chunk_bytes"] == 8 * 3 * 64 * 4
    cells = {(c["path"], c["workload"]): c for c in doc["cells"]}
    assert set(cells) == {(p, w) for p in ("memcpy", "socket", "tcp") for w in names}
    for cell in cells.values():
        assert cell["gbps"] > 0 and cell["rounds"] == 2 and not cell["errors"], cell  # one per pass
        assert cell["latency_s"]["p99"] >= cell["latency_s"]["median"] > 0
        assert cell["ratio"]["memcpy"] > 0 and cell["ratio"]["socket"] > 0
    assert cells[("socket", "raw 4 KiB")]["ratio"]["socket"] == 1.0
    targets = {t["name"].split()[0]: t["status"] for t in doc["targets"]}
    assert targets["tcp"] in ("PASS", "MISS") and targets["shm"] == targets["ucx"] == "n/a"
    ahead = doc["ahead_of_mooncake"]["tcp"]  # only 64 KiB of the reference sizes was run
    assert isinstance(ahead[0], bool) and ahead[1:] == [None, None]
    printed = capsys.readouterr().out
    assert doc["settings"]["passes"] == 2 and "--passes 2" in doc["command"]
    for fragment in ("x memcpy", "x socket", "Orientation (measured beforehand", "Mooncake transfer engine",
                     "pdflow tcp (this run)", "Targets:", "ucx >= 0.9x", "repeat with: pdflow bench transfer"):
        assert fragment in printed, fragment
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_shaped_link_holds_the_transport_back(tmp_path: Path) -> None:
    out_json = tmp_path / "shaped.json"
    args = ["--transports", "tcp", "--kv-tokens", "", "--raw-sizes", "64KiB", "--round-bytes", "2MiB",
            "--repeat", "1", "--passes", "1", "--link-bandwidth", "400Mbit", "--link-latency", "2ms", "--json", str(out_json)]
    assert main(["bench", "transfer", *args]) == 0
    doc = json.loads(out_json.read_text())
    tcp = next(c for c in doc["cells"] if c["path"] == "tcp")
    assert tcp["gbps"] <= 0.05 * 1.25, "400Mbit is 0.05 GB/s (plus one 64 KiB burst per 2 MiB round)"
    assert tcp["latency_s"]["median"] >= 0.002
    assert doc["settings"]["link"] == {"bandwidth": "400Mbit", "latency": "2ms"}
    assert all(t["status"] == "n/a" for t in doc["targets"])


def test_ucx_beside_its_raw_floor(tmp_path: Path) -> None:
    if (reason := transports.availability("ucx")) is not None:
        pytest.skip(reason)
    out_json = tmp_path / "ucx.json"
    args = ["--transports", "ucx", "--kv-tokens", "8", "--raw-sizes", "", "--repeat", "1", "--passes", "1",
            "--json", str(out_json)]
    assert main(["bench", "transfer", *args]) == 0
    doc = json.loads(out_json.read_text())
    assert [c["path"] for c in doc["cells"]] == ["memcpy", "socket", "ucx-raw", "ucx"]
    ucx = doc["cells"][-1]
    assert ucx["gbps"] > 0 and ucx["ratio"]["ucx-raw"] > 0
    assert next(t for t in doc["targets"] if t["name"].startswith("ucx"))["status"] in ("PASS", "MISS")


def test_options() -> None:
    assert [_count(t) for t in ("64KiB", "1MiB", "2K", "512", "16M")] == [65536, 1 << 20, 2048, 512, 16 << 20]
    for bad in ("0", "1.5MiB", "64kb", "fast"):
        with pytest.raises(argparse.ArgumentTypeError):
            _count(bad)
    with pytest.raises(SystemExit):
        main(["bench", "transfer", "--link-bandwidth", "10Gbps"])
    with pytest.raises(SystemExit, match="inproc"):
        main(["bench", "transfer", "--transports", "inproc"])
    kv = workloads((512,), (), 0)[0]
    assert (kv.name, kv.chunk_bytes, len(kv.spans)) == ("kv 512 tok", 512 * 3 * 64 * 4, 60)
    assert kv.round_bytes == kv.region_bytes == 60 * 512 * 3 * 64 * 4
    assert [measured for measured in Budget(repeat=3, seconds=60).rounds()] == [False, True, True, True]
    assert Budget(repeat=5, seconds=3).split(3) == Budget(repeat=2, seconds=1)
    assert [rotated(("a", "b", "c"), turn) for turn in range(4)] == [
        ("a", "b", "c"), ("b", "c", "a"), ("c", "a", "b"), ("a", "b", "c")]
