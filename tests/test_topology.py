"""pdflow.config.topology: the default file, defaults, model paths, and an error for every kind of bad file."""

from __future__ import annotations

import os
import pickle
import sys
import types
from pathlib import Path

import pytest

from pdflow.config.toml_lines import LineMap
from pdflow.config.topology import STAGE_NAMES, Limits, Pipeline, TopologyError, load_topology, parse_topology
from pdflow.speculative import speculation_for

REPO = Path(__file__).parents[1]


def parse(*lines: str, path: Path = Path("topo.toml")) -> Pipeline:
    return parse_topology("\n".join(lines) + "\n", path)


def test_default_file_loads() -> None:
    if (os.cpu_count() or 1) < 2:
        pytest.skip("the default topology pins decode to core 1, which this machine does not have")
    t = load_topology(REPO / "topology.toml")
    assert t.path == (REPO / "topology.toml").absolute()
    assert (t.model.source, t.model.served_name, t.model.is_path, t.model.path) == ("smollm2", "smollm2", False, None)
    assert list(t.stages) == list(STAGE_NAMES)
    assert t.stages["prefill"].cores == (0,) and t.stages["decode"].cores == (1,)
    assert t.stages["ingress"].cores == t.stages["kv_shuttle"].cores == ()
    assert t.stages["prefill"].outputs == t.stages["decode"].outputs == {}  # tokens go straight to ingress
    assert [(link.src, link.dst, link.transport) for link in t.links] == [
        ("prefill", "kv_shuttle", "tcp"), ("kv_shuttle", "decode", "tcp"), ("kv_shuttle", "prefill", "tcp"),
        ("decode", "kv_shuttle", "tcp"),
    ]
    # the file spells out every default: apart from the pinned cores it equals an empty file
    empty = parse_topology("", REPO / "topology.toml")
    assert (t.model, t.server, t.control, t.limits, t.links, t.kv) == (
        empty.model, empty.server, empty.control, empty.limits, empty.links, empty.kv,
    )
    for name in ("ingress", "kv_shuttle"):
        assert t.stages[name] == empty.stages[name]


def test_empty_file_gets_all_defaults() -> None:
    t = parse_topology("", Path("empty.toml"))
    assert t.model.dtype == "float32" and t.model.served_name == "smollm2"
    assert (t.server.host, t.server.port) == ("127.0.0.1", 8000)
    assert (t.control.pull_address, t.control.pub_address) == ("tcp://127.0.0.1:5500", "tcp://127.0.0.1:5501")
    assert t.limits == Limits()
    ports = {name: (s.port, s.data_port) for name, s in t.stages.items()}
    assert ports == {
        "ingress": (5510, None), "prefill": (5520, 5620), "kv_shuttle": (5530, 5630),
        "decode": (5540, 5640),
    }
    assert all(s.replicas == 1 and s.cores == () and s.device == "cpu" for s in t.stages.values())
    assert t.link("kv_shuttle", "decode").options == {}
    assert t.replicas() == [(name, 0) for name in STAGE_NAMES]
    assert t.stages["kv_shuttle"].display_name == "kv-shuttle" and t.stages["decode"].display_name == "decode"
    with pytest.raises(KeyError):
        t.link("prefill", "decode")


def test_replicas_addresses_and_links() -> None:
    t = parse(
        "[stages.decode]", "replicas = 3", 'host = "10.0.0.2"', "port = 6000", "data_port = 6100",
        "[[links]]", 'src = "kv_shuttle"', 'dst = "decode"', 'transport = "tcp"', "options = { latency_ms = 2 }",
    )
    decode = t.stages["decode"]
    assert [decode.control_address(i) for i in range(3)] == [f"tcp://10.0.0.2:{6000 + i}" for i in range(3)]
    assert [decode.data_port_of(i) for i in range(3)] == [6100, 6101, 6102]
    assert [r for r in t.replicas() if r[0] == "decode"] == [("decode", 0), ("decode", 1), ("decode", 2)]
    assert t.link("kv_shuttle", "decode").options == {"latency_ms": 2}
    assert t.link("prefill", "kv_shuttle").transport == "tcp"  # the missing link defaults to tcp
    with pytest.raises(ValueError):
        t.stages["ingress"].data_port_of(0)


def test_several_front_doors_each_on_a_port_of_its_own_or_sharing_one() -> None:
    t = parse("[stages.ingress]", "replicas = 3")
    assert [t.server.port_of(i) for i in range(3)] == [8000, 8001, 8002]
    shared = parse("[server]", "reuse_port = true", "[stages.ingress]", "replicas = 3")
    assert [shared.server.port_of(i) for i in range(3)] == [8000, 8000, 8000]  # SO_REUSEPORT: no clash


def test_front_doors_sharing_a_port_each_serve_on_it() -> None:
    """Two HTTP servers as two ingress replicas build them with server.reuse_port: each binds the
    port (a socket that does not share it cannot), and connections reach both."""
    import asyncio
    import socket

    import httpx

    from pdflow.serving.http_server import http_server, shared_port_socket

    def app(name: str):
        async def serve(scope, receive, send):
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": name.encode()})
        return serve

    async def run() -> set[str]:
        first = shared_port_socket("127.0.0.1", 0)
        port = first.getsockname()[1]
        sockets = [first, shared_port_socket("127.0.0.1", port)]
        servers = [http_server(app(f"door {i}"), "127.0.0.1", port, 5.0) for i in range(2)]
        tasks = [asyncio.create_task(server.serve([sock])) for server, sock in zip(servers, sockets)]
        try:
            while not all(server.started for server in servers):
                await asyncio.sleep(0.01)
            with socket.socket() as plain, pytest.raises(OSError):
                plain.bind(("127.0.0.1", port))
            answered = set()
            for _ in range(64):  # a fresh connection each time: the kernel picks a socket for each
                async with httpx.AsyncClient() as client:
                    answered.add((await client.get(f"http://127.0.0.1:{port}/")).text)
                if len(answered) == 2:
                    break
            return answered
        finally:
            for server in servers:
                server.should_exit = True
            await asyncio.gather(*tasks)

    assert asyncio.run(run()) == {"door 0", "door 1"}


def test_a_link_codec_and_the_return_links_that_inherit_it() -> None:
    t = parse("[[links]]", 'src = "prefill"', 'dst = "kv_shuttle"', 'codec = "int4"',
              "codec_options = { key_group = 32 }")
    assert [(link.src, link.dst, link.make_codec().spec) for link in t.links] == [
        ("prefill", "kv_shuttle", "int4:key_group=32"), ("kv_shuttle", "decode", "none"),
        ("kv_shuttle", "prefill", "int4:key_group=32"), ("decode", "kv_shuttle", "int4:key_group=32")]
    shm = parse("[kv]", "zero_copy = false", "[[links]]", 'src = "prefill"', 'dst = "kv_shuttle"',
                'transport = "shm"', 'codec = "int8"')  # copies, so there are bytes to encode
    assert shm.link("prefill", "kv_shuttle").codec == "int8"


def test_a_head_prune_calibration_is_relative_to_the_topology(tmp_path: Path) -> None:
    (tmp_path / "imp.json").write_text('{"importance": [[0.3, 0.1, 0.2], [0.5, 0.6, 0.4]]}')
    t = parse("[[links]]", 'src = "kv_shuttle"', 'dst = "decode"', 'codec = "head-prune"',
              'codec_options = { calibration = "imp.json", fraction = 0.34 }', path=tmp_path / "topo.toml")
    assert t.link("kv_shuttle", "decode").codec_options["calibration"] == str(tmp_path / "imp.json")
    assert t.link("kv_shuttle", "decode").make_codec().spec == "head-prune:pruned=0.1/0.2"
    window = parse("[[links]]", 'src = "kv_shuttle"', 'dst = "decode"', 'codec = "sink-window"',
                   "codec_options = { window = 2048 }")
    assert window.link("kv_shuttle", "decode").make_codec().spec == "sink-window:window=2048"


def test_speculative_decoding() -> None:
    assert not parse().speculative.enabled and speculation_for(parse().speculative, None) is None
    t = parse("[speculative]", 'method = "ngram"', "num_tokens = 3", "adaptive = false", "options = { max_n = 2 }")
    spec = speculation_for(t.speculative, None)
    assert (spec.num_tokens, spec.adaptive, spec.proposer.params) == (3, False, {"min_n": 1, "max_n": 2})
    inline = parse('speculative = { method = "ngram", num_tokens = 5 }')  # the same, as one line
    assert inline.speculative.method == "ngram" and inline.speculative.num_tokens == 5


def test_a_store_codec() -> None:
    t = parse("[kv]", 'codec = "int4"', "codec_options = { value_group = 32 }")
    assert t.kv.store_codec().spec == "int4:value_group=32"
    assert parse().kv.store_codec() is None and parse("[kv]", 'codec = "none"').kv.store_codec() is None
    shm = parse("[kv]", 'codec = "int8"', "zero_copy = false", "[[links]]", 'src = "prefill"', 'dst = "kv_shuttle"',
                'transport = "shm"')  # copies, so the store can keep encodings
    assert shm.kv.store_codec().spec == "int8"


def test_local_model_directory(tmp_path: Path) -> None:
    model = tmp_path / "models" / "tiny-llama"
    model.mkdir(parents=True)
    (model / "config.json").write_text('{"model_type": "llama"}')
    file = tmp_path / "topology.toml"
    file.write_text('[model]\nsource = "./models/tiny-llama/"\ndtype = "bfloat16"\n')
    with pytest.raises(TopologyError, match="model.source: .*tiny-llama has no tokenizer"):
        load_topology(file)
    (model / "tokenizer.json").write_text("{}")
    t = load_topology(file)
    assert (t.model.is_path, t.model.path, t.model.served_name) == (True, model.resolve(), "tiny-llama")
    file.write_text(f'[model]\nsource = "{model}"\nserved_name = "tiny"\n')
    assert load_topology(file).model.served_name == "tiny"
    (model / "config.json").write_text('{"model_type": "gemma", "max_position_embeddings": 64}')
    file.write_text(f'[model]\nsource = "{model}"\nweights = "int8"\n')
    with pytest.raises(TopologyError, match="model.weights: .*model type 'gemma'.*fp32"):
        load_topology(file)
    (model / "config.json").write_text('{"model_type": "mistral", "sliding_window": 16, "max_position_embeddings": 64}')
    file.write_text(f'[model]\nsource = "{model}"\n')
    with pytest.raises(TopologyError, match="model.source: sliding-window attention: neither"):
        load_topology(file)


BAD_FILES = [
    # (id, lines, key, line, fragment of the message)
    ("top-level unknown", ["[server]", "port = 8001", "[modle]", 'source = "smollm2"'],
     "modle", 3, "unknown key 'modle'; did you mean 'model'?"),
    ("top-level unknown key", ["colour = 1"], "colour", 1, "expected one of: model, server"),
    ("stage unknown key", ["[stages.decode]", "replica = 2"],
     "stages.decode.replica", 2, "unknown key 'replica'; did you mean 'replicas'?"),
    ("unknown stage", ["[stages.prefil]", "replicas = 1"], "stages.prefil", 1, "did you mean 'prefill'?"),
    ("links unknown key", ["[[links]]", 'src = "prefill"', 'dst = "kv_shuttle"', 'transprt = "tcp"'],
     "links[0].transprt", 4, "did you mean 'transport'?"),
    ("string for int", ["[limits]", 'max_batch = "2"'], "limits.max_batch", 2, 'expected an integer, got string "2"'),
    ("bool for int", ["[stages.prefill]", "replicas = true"],
     "stages.prefill.replicas", 2, "expected an integer, got boolean true"),
    ("float for int", ["", "[server]", "port = 8000.0"], "server.port", 3, "expected an integer, got float 8000.0"),
    ("strings for cores", ["[stages.decode]", "device = 'cpu'", 'cores = ["0", "1"]'],
     "stages.decode.cores[0]", 3, 'expected a core number, got string "0"'),
    ("negative core", ["[stages.decode]", "cores = [-1]"], "stages.decode.cores[0]", 2, ">= 0, got -1"),
    ("core out of range", ["[stages.decode]", "cores = [0, 100000]"],
     "stages.decode.cores[1]", 2, "core 100000 does not exist: os.cpu_count() is"),
    ("duplicate core", ["[stages.decode]", "cores = [0, 0]"], "stages.decode.cores[1]", 2, "core 0 is listed twice"),
    ("negative replicas", ["[stages.decode]", "replicas = -1"],
     "stages.decode.replicas", 2, "expected an integer >= 1, got -1"),
    ("second front door's port taken", ["[server]", "port = 5509", "[stages.ingress]", "replicas = 2"],
     "stages.ingress.port", 3, "port 5510 is also used by server.port + 1 (ingress replica 1)"),
    ("direct without a store", ["[engine]", 'mode = "colocated"', "[kv]", "direct = true"],
     "kv.direct", 4, "the colocated worker keeps its KV itself"),
    ("direct into a link that drops KV", ["[kv]", "direct = true", "[[links]]", 'src = "kv_shuttle"',
                                         'dst = "decode"', 'codec = "sink-window"', "codec_options = { window = 2048 }"],
     "kv.direct", 2, "the link into decode drops KV (sink-window)"),
    ("port clash between stages", ["[stages.prefill]", "port = 5510"],
     "stages.prefill.port", 2, "port 5510 is also used by stages.ingress.port"),
    ("port clash via replicas", ["[stages.prefill]", "replicas = 2", "", "[stages.kv_shuttle]", "port = 5521"],
     "stages.kv_shuttle.port", 5, "port 5521 is also used by stages.prefill.port + 1 (replica 1)"),
    ("port clash with control PUB", ["[server]", "port = 5501"],
     "server.port", 2, "port 5501 is also used by control.port + 1 (the PUB socket)"),
    ("port clash on 0.0.0.0", ["[server]", 'host = "0.0.0.0"', "port = 5640"],
     "server.port", 3, "port 5640 is also used by stages.decode.data_port (0.0.0.0 and 127.0.0.1 overlap)"),
    ("port out of range", ["[control]", "port = 70000"], "control.port", 2, "expected an integer >= 1 and <= 65534"),
    ("replica port past 65535", ["[stages.egress]", "port = 65535", "replicas = 2"],
     "stages.egress.port", 2, "stages.egress.port + 1 (replica 1) would be port 65536"),
    ("bad transport", ["[[links]]", 'src = "prefill"', 'dst = "kv_shuttle"', 'transport = "carrier-pigeon"'],
     "links[0].transport", 4, "transport 'carrier-pigeon' is not available"),
    ("bad link pair", ["[[links]]", 'src = "prefill"', 'dst = "decode"'],
     "links[0]", 1, "no data-plane link prefill -> decode; expected prefill -> kv_shuttle or kv_shuttle -> decode"),
    ("duplicate link", ["[[links]]", 'src = "prefill"', 'dst = "kv_shuttle"',
                        "[[links]]", 'src = "prefill"', 'dst = "kv_shuttle"'],
     "links[1]", 4, "already defined by links[0]"),
    ("link without dst", ["[[links]]", 'src = "prefill"'], "links[0].dst", 1, "missing key 'dst'"),
    ("link options not a table", ["[[links]]", 'src = "prefill"', 'dst = "kv_shuttle"', "options = 3"],
     "links[0].options", 4, "expected a table, got integer 3"),
    ("syntax error", ["[limits]", "max_batch = = 3"], "limits.max_batch", 2, "invalid TOML"),
    ("syntax error in header", ["[model]", "", "[stages.decode", "replicas = 1"], "stages.decode", 3, "invalid TOML"),
    ("bad dtype", ["[model]", 'dtype = "int8"'],
     "model.dtype", 2, 'expected one of float32, bfloat16, float16, got string "int8"'),
    ("unknown weight format", ["[model]", 'weights = "int3"'],
     "model.weights", 2, "unknown weight format 'int3'; known: fp32, bf16, int8, int4"),
    ("bad device", ["[stages.decode]", 'device = "gpu"'],
     "stages.decode.device", 2, 'expected "cpu", "cuda" or "cuda:N", got string "gpu"'),
    ("device on a stage without the model", ["[stages.kv_shuttle]", 'device = "cuda"'], "stages.kv_shuttle.device",
     2, "only prefill, decode, worker run the model; kv_shuttle keeps what it holds in host memory: remove device"),
    ("missing model path", ["[model]", "dtype = 'float32'", 'source = "./no-such-model"'],
     "model.source", 3, "no-such-model does not exist"),
    ("unknown model name", ["[model]", 'source = "zzz"'], "model.source", 2, "unknown model 'zzz'"),
    ("model name typo", ["[model]", 'source = "smollm"'], "model.source", 2, "did you mean 'smollm2'?"),
    ("data_port on egress", ["[stages.egress]", "data_port = 5650"],
     "stages.egress.data_port", 2, "only prefill, kv_shuttle, decode receive KV data"),
    ("store size without a unit", ["[kv]", 'store_bytes = "4G"'], "kv.store_bytes", 2, "unknown unit 'G'"),
    ("block size zero", ["[kv]", "block_tokens = 0"], "kv.block_tokens", 2, ">= 1 and <= 8192, got 0"),
    ("prefix cache not a bool", ["[kv]", 'prefix_cache = "yes"'], "kv.prefix_cache", 2,
     "expected true or false"),
    ("low above high watermark", ["[kv]", "high_watermark = 0.5", "low_watermark = 0.7"], "kv.low_watermark", 3,
     "<= kv.high_watermark"),
    ("disk size without a directory", ["[kv]", 'disk_capacity = "1GiB"'], "kv.disk_capacity", 2,
     "without kv.disk_path"),
    ("disk smaller than two segments", ["[kv]", 'disk_path = "kv"', 'disk_capacity = "300MiB"'], "kv.disk_capacity",
     3, "at least two segments"),
    ("block ttl not a number", ["[kv]", "block_ttl_s = nan"], "kv.block_ttl_s", 2, "expected a number, got"),
    ("block ttl zero", ["[kv]", "block_ttl_s = 0"], "kv.block_ttl_s", 2, "> 0"),
    ("two transports into kv_shuttle", ["[[links]]", 'src = "prefill"', 'dst = "kv_shuttle"', 'transport = "tcp"',
                                         "[[links]]", 'src = "decode"', 'dst = "kv_shuttle"', 'transport = "inproc"'],
     "links[1].transport", 8, "kv_shuttle receives KV on one data port"),
    ("unknown codec", ["[[links]]", 'src = "prefill"', 'dst = "kv_shuttle"', 'codec = "zstd"'],
     "links[0].codec", 4, "unknown KV codec 'zstd'; known: none, int8, int4, head-prune, sink-window"),
    ("unknown proposer", ["[speculative]", 'method = "medusa"'], "speculative.method", 2, "unknown proposer 'medusa'"),
    ("bad proposer option", ["[speculative]", 'method = "ngram"', "options = { max_n = 0 }"], "speculative.options", 3,
     "max_n must be an integer >= 1"),
    ("unknown proposer option", ["[speculative]", 'method = "ngram"', "options = { n = 3 }"], "speculative.options",
     3, "unknown ngram proposer parameters ['n']"),
    ("draft too long", ["[speculative]", 'method = "ngram"', "num_tokens = 0"], "speculative.num_tokens", 3, ">= 1"),
    ("head pruning into the store", ["[[links]]", 'src = "prefill"', 'dst = "kv_shuttle"', 'codec = "head-prune"',
                                     'codec_options = { pruned = "1.1" }'],
     "links[0].codec", 4, "Use it on the link kv_shuttle -> decode"),
    ("sink + window in the store", ["[kv]", 'codec = "sink-window"'], "kv.codec", 2, "prefill computes on"),
    ("sink + window without decode's pool", ["[model]", 'dtype = "bfloat16"', "[[links]]", 'src = "kv_shuttle"',
                                             'dst = "decode"', 'codec = "sink-window"'],
     "links[0].codec", 6, "model.dtype = \"float32\" and decode on the cpu"),
    ("sink + window on a zero-copy shm link", ["[[links]]", 'src = "kv_shuttle"', 'dst = "decode"',
                                               'transport = "shm"', 'codec = "sink-window"'],
     "links[0].codec", 5, "set zero_copy = false"),
    ("head pruning without its importance file", ["[[links]]", 'src = "kv_shuttle"', 'dst = "decode"',
                                                  'codec = "head-prune"',
                                                  'codec_options = { calibration = "imp.json", fraction = 0.1 }'],
     "links[0].codec_options", 5, "no importance file"),
    ("bad codec option", ["[[links]]", 'src = "prefill"', 'dst = "kv_shuttle"', 'codec = "int4"',
                          "codec_options = { value_group = -1 }"],
     "links[0].codec_options", 5, "value_group must be an integer >= 0"),
    ("unknown codec option", ["[[links]]", 'src = "prefill"', 'dst = "kv_shuttle"', 'codec = "int8"',
                              "codec_options = { bits = 3 }"],
     "links[0].codec_options", 5, "unknown int8 codec parameters ['bits']"),
    ("codec on a zero-copy shm link", ["[[links]]", 'src = "kv_shuttle"', 'dst = "decode"', 'transport = "shm"',
                                       'codec = "int8"'],
     "links[0].codec", 5, "set zero_copy = false"),
    ("unknown store codec", ["[kv]", 'codec = "int3"'], "kv.codec", 2, "unknown KV codec 'int3'"),
    ("bad store codec option", ["[kv]", 'codec = "int8"', "codec_options = { key_group = 0 }"],
     "kv.codec_options", 3, "key_group must be"),
    ("encoded store with zero-copy shm", ["[kv]", 'codec = "int8"', "[[links]]", 'src = "prefill"',
                                          'dst = "kv_shuttle"', 'transport = "shm"'],
     "kv.codec", 2, "set zero_copy = false"),
    ("heartbeat timeout <= interval", ["[limits]", "heartbeat_interval_s = 1.0", "heartbeat_timeout_s = 1"],
     "limits.heartbeat_timeout_s", 3, "expected a number > limits.heartbeat_interval_s (1.0)"),
    ("shutdown grace too long", ["[limits]", "shutdown_grace_s = 10"],
     "limits.shutdown_grace_s", 2, "expected a number >= 0 and < 10, got 10"),
    ("stage not a table", ["[stages]", "decode = 3"], "stages.decode", 2, "expected a table, got integer 3"),
    ("inline stage table", ["[stages]", "decode = { replicas = 0 }"], "stages.decode.replicas", 2, ">= 1, got 0"),
    ("body limit without a unit", ["[server]", 'max_body_bytes = "4M"'], "server.max_body_bytes", 2,
     "unknown unit 'M'"),
    ("header timeout zero", ["[server]", "header_timeout_s = 0"], "server.header_timeout_s", 2, "> 0, got 0"),
    ("unknown server key", ["[server]", "api_key = 'x'"], "server.api_key", 2, "unknown key"),
    ("secret file and env", ["[security]", 'secret_file = "k"', 'secret_env = "K"'], "security.secret_env", 3,
     "not both"),
    ("authenticate not a bool", ["[security]", 'authenticate = "no"'], "security.authenticate", 2,
     "expected true or false"),
]


@pytest.mark.parametrize(
    ("lines", "key", "line", "fragment"), [c[1:] for c in BAD_FILES], ids=[c[0] for c in BAD_FILES]
)
def test_bad_file(tmp_path: Path, lines: list[str], key: str, line: int, fragment: str) -> None:
    file = tmp_path / "topology.toml"
    file.write_text("\n".join(lines) + "\n")
    with pytest.raises(TopologyError) as caught:
        load_topology(file)
    e = caught.value
    assert (e.path, e.key, e.line) == (file, key, line), str(e)
    assert fragment in e.message, str(e)
    assert str(e) == f"{file}:{line}: {key}: {e.message}"
    assert e.exit_code == 2


def test_error_without_line_and_pickling() -> None:
    e = TopologyError(Path("t.toml"), None, "server.port", "bad")
    assert str(e) == "t.toml: server.port: bad"
    again = pickle.loads(pickle.dumps(e))
    assert (again.path, again.line, again.key, again.message) == (e.path, None, "server.port", "bad")


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(TopologyError, match="cannot read the topology file"):
        load_topology(tmp_path / "nope.toml")


def test_line_map() -> None:
    lines = LineMap(
        "# comment\n"                                   # 1
        "[stages.decode]\n"                             # 2
        "cores = [\n"                                   # 3
        "  0,  # x = 1 is not a key\n"                  # 4
        "]\n"                                           # 5
        'note = """\n'                                  # 6
        "fake = 1\n"                                    # 7
        '"""\n'                                         # 8
        "[[links]]\n"                                   # 9
        "options.bandwidth = 3\n"                       # 10
        "[[links]]\n"                                   # 11
        "[links.options]\n"                             # 12
        "latency = { ms = 1 }\n"                        # 13
        "[stages]\n"                                    # 14
        '"egress".port = 1\n'                           # 15
    )
    assert lines.line_of("stages.decode") == 2
    assert lines.line_of("stages.decode.cores") == 3
    assert lines.line_of("stages.decode.fake") == 2  # inside a string: not a key
    assert lines.line_of("stages.decode.x") == 2
    assert lines.line_of("links[0].options.bandwidth") == 10
    assert lines.line_of("links[1]") == 11
    assert lines.line_of("links[1].options") == 12
    assert lines.line_of("links[1].options.latency.ms") == 13
    assert lines.line_of("stages.egress.port") == 15
    assert lines.line_of("server.port") is None
    assert lines.key_at(10) == "links[0].options.bandwidth"
    assert lines.key_at(5) == "stages.decode"


def test_transports_come_from_the_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    link = ["[[links]]", 'src = "kv_shuttle"', 'dst = "decode"']
    assert parse(*link, 'transport = "tcp"').link("kv_shuttle", "decode").transport == "tcp"
    with pytest.raises(TopologyError, match="inside one process only") as inproc:
        parse(*link, 'transport = "inproc"')
    assert inproc.value.key == "links[0].transport" and inproc.value.line == 4
    with pytest.raises(TopologyError, match=r"transport 'verbs' is not available: .*pyverbs"):
        parse(*link, 'transport = "verbs"')


def test_uses_the_model_list(monkeypatch: pytest.MonkeyPatch) -> None:
    """When pdflow.models is importable, its answers are the ones used."""
    models = types.ModuleType("pdflow.models")
    models.KNOWN_MODELS = {"smollm2": object(), "qwen3": object()}  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pdflow.models", models)
    assert parse("[model]", 'source = "qwen3"').model.served_name == "qwen3"
    with pytest.raises(TopologyError, match="expected one of qwen3, smollm2"):
        parse("[model]", 'source = "zzz"')


def test_link_emulation_options_are_checked() -> None:
    link = ["[[links]]", 'src = "prefill"', 'dst = "kv_shuttle"']
    ok = parse(*link, 'options = { bandwidth = "25Gbit", latency = "250us" }')
    assert ok.link("prefill", "kv_shuttle").options == {"bandwidth": "25Gbit", "latency": "250us"}
    with pytest.raises(TopologyError, match="bandwidth") as bad:
        parse(*link, 'options = { bandwidth = "fast" }')
    assert bad.value.key == "links[0].options" and bad.value.line == 4


def test_kv_table_and_the_return_links_follow_the_prompt_link() -> None:
    t = parse("[kv]", "prefix_cache = false", "block_tokens = 16", 'store_bytes = "512MiB"',
              "[[links]]", 'src = "prefill"', 'dst = "kv_shuttle"', 'transport = "shm"')
    assert (t.kv.prefix_cache, t.kv.block_tokens, t.kv.store_bytes) == (False, 16, 512 << 20)
    assert (t.kv.high_watermark, t.kv.low_watermark) == (0.95, 0.85)
    # decode's answers come back over the link that reaches decode (tcp), the prefixes over shm:
    # kv_shuttle receives over shm beside tcp
    assert t.link("decode", "kv_shuttle").transport == "tcp"
    assert t.link("kv_shuttle", "prefill").transport == "shm"
    assert t.link("kv_shuttle", "decode").transport == "tcp"
    assert parse("[kv]", "store_bytes = 1048576").kv.store_bytes == 1 << 20


def test_the_disk_tier_keys(tmp_path) -> None:
    t = parse("[kv]", 'disk_path = "cache/kv"', 'disk_capacity = "2GiB"', 'disk_segment_bytes = "64MiB"',
              "block_ttl_s = 3600", "prefetch = false", path=tmp_path / "topo.toml")
    assert t.kv.disk_path == tmp_path / "cache" / "kv"  # relative to the topology file
    assert (t.kv.disk_capacity, t.kv.disk_segment_bytes, t.kv.block_ttl_s, t.kv.prefetch) == (2 << 30, 64 << 20,
                                                                                             3600.0, False)
    plain = parse("[kv]", "block_ttl_s = inf")
    assert plain.kv.disk_path is None and plain.kv.block_ttl_s == float("inf") and plain.kv.prefetch
    (tmp_path / "file").write_text("")
    with pytest.raises(TopologyError, match="is not a directory") as bad:
        parse("[kv]", 'disk_path = "file"', path=tmp_path / "topo.toml")
    assert bad.value.key == "kv.disk_path" and bad.value.line == 2
