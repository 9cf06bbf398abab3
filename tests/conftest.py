"""Fixtures shared by the suite: the default model, and pdflow servers started by `pdflow run`."""

from __future__ import annotations

import os

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Workers share the cores (scripts/test.sh runs one more than there are): an OpenMP thread that
    # spins for ~300k iterations when its work ends (libgomp's default, and the launcher's for the
    # stages) takes them from the other workers. Set before torch loads; stages inherit it.
    os.environ.setdefault("GOMP_SPINCOUNT", "1000")
    # And each worker computes on one thread: with the cores shared three ways (and with the
    # servers' stages), a second thread mostly waits at OpenMP's barriers. test_engine and
    # test_speculative beside two CPU hogs: 107 s of CPU on two threads, 85 s on one, in the same
    # wall time. Servers the tests start size their own stages' threads (their cores).
    import torch

    torch.set_num_threads(1)

# The session's servers (below), each started on first use in a process and stopped once no test
# ahead of it uses it, and the modules that use each, in the order they run (the group below).
SESSION_SERVER_USERS = {
    "shm_server": ("test_e2e_transports", "test_prefix_reuse"),
    "colocated_server": ("test_prefix_reuse", "test_e2e", "test_e2e_sampling_api", "test_simulate"),
    "default_server": ("test_prefix_reuse", "test_e2e", "test_e2e_sampling_api", "test_simulate", "test_metrics",
                       "test_hostile_http", "test_hostile_control", "test_soak", "test_bench_serve"),
}

# Where the suite runs in workers (scripts/test.sh: ``--dist loadfile``), a worker takes one unit at a
# time: a module, or one of these groups of modules, run one after another in one worker. The group
# is every module that uses a session server, in an order where each server's users follow one
# another (shm's first, then the colocated one's, then the default one's: checked), so that one worker starts
# each server once and stops it once its last user is done. Before, each worker that ran one of them
# started its own and kept it until the session ended (5 starts a run, now 3; a start takes about
# 4.6 s of CPU in its processes, an idle server 0.47 s every 20 s).
SHARED_SERVER_GROUPS = {"session-servers": tuple(dict.fromkeys(sum(SESSION_SERVER_USERS.values(), ())))}
for _server, _users in SESSION_SERVER_USERS.items():  # (else a server stops between two of its users)
    _places = sorted(SHARED_SERVER_GROUPS["session-servers"].index(module) for module in _users)
    assert _places == list(range(_places[0], _places[-1] + 1)), f"{_server}'s users do not follow one another"
UNIT_OF_MODULE = {module: group for group, modules in SHARED_SERVER_GROUPS.items() for module in modules}

# The units that take longest start first (measured with --durations=0 in 3 workers), so that no long
# one starts last, alone; the rest keep pytest's order.
LONGEST_FIRST = (*SHARED_SERVER_GROUPS["session-servers"], "test_e2e_ray", "test_engine", "test_e2e_disk_tier",
                 "test_e2e_failures", "test_e2e_hosts", "test_cache_aware", "test_e2e_kv_structural", "test_cli",
                 "test_speculative", "test_e2e_kv_codecs", "test_bench_speculative", "test_e2e_models_by_path",
                 "test_kernels", "test_examples", "test_transports", "test_e2e_scaler")


def pytest_collection_modifyitems(items):
    def rank(item) -> int:
        name = item.path.stem
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: each module's tests keep their order


@pytest.hookimpl(optionalhook=True)  # (a hook of pytest-xdist: none where it is not installed)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` with :data:`SHARED_SERVER_GROUPS` as units, handed out in the collection's
    order (xdist's default reorders the units by their number of tests, which put a long module
    of four tests, test_e2e_ray, near the end)."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedServerScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = super()._split_scope(nodeid)
            return UNIT_OF_MODULE.get(os.path.splitext(os.path.basename(module))[0], module)

    config.option.loadscopereorder = False
    return SharedServerScheduling(config, log)


from pdflow.testing.server import PdflowServer

COLOCATED = {"mode": "colocated", "chunked_prefill_tokens": 64}
DEFAULT_SERVER = {"header_timeout_s": 2, "max_body_bytes": "1MiB", "max_messages": 25_000}  # small, so that testing them is quick


@pytest.fixture(scope="session")
def model_dir():
    from pdflow.models import resolve

    return resolve("smollm2", progress=False)


@pytest.fixture(scope="session")
def loaded_model(model_dir):
    """The engine's model with fp32 weights (exact) and the tokenizer, loaded once for every module
    that runs the engine in this process (tests must not change them)."""
    from pdflow.engine import load_model, load_tokenizer

    return load_model(model_dir, weights="fp32"), load_tokenizer(model_dir)


@pytest.fixture(scope="session")
def served_model(model_dir):
    """The engine's model with the default weights, as the default topology serves it, and the
    tokenizer: the in-process reference for what a server answers."""
    from pdflow.engine import load_model, load_tokenizer

    return load_model(model_dir), load_tokenizer(model_dir)


@pytest.fixture(scope="session")
def transformers_model(model_dir):
    """transformers' own model of the default model, fp32: the reference for exactness tests."""
    from pdflow.engine.loader import load_transformers_model

    return load_transformers_model(model_dir)


class SessionServers:
    """The servers this process shares among modules (:data:`SESSION_SERVER_USERS`): each started
    when a module first asks for it, and stopped after a test once the next test's module is not one
    of its users (:func:`pytest_runtest_teardown`; again started should a later one ask)."""

    SETTINGS = {
        # the default topology (disaggregated, tcp data plane, prefix cache on) with one setting
        # changed: ``kv.direct``, so that every module on it runs the direct path (prefill into
        # decode's pool) for prompts with no stored prefix and the store's path for the rest; the
        # store's forwarding of every chunk is what every other server runs
        "default_server": {"server": DEFAULT_SERVER, "kv": {"direct": True}},
        # the colocated baseline (one worker, chunked prefill of 64 tokens)
        "colocated_server": COLOCATED,
        # the default topology over shm links, where prefill computes the KV in the store's blocks
        # and decode attends from them (zero copies)
        "shm_server": {"transport": "shm"},
    }

    def __init__(self, tmp_path_factory):
        self.tmp_path_factory = tmp_path_factory
        self.running: dict[str, PdflowServer] = {}

    def get(self, name: str) -> PdflowServer:
        if name not in self.running:
            server = PdflowServer(self.tmp_path_factory.mktemp(name), **self.SETTINGS[name])
            self.running[name] = server.__enter__()
        return self.running[name]

    def stop_unused(self, next_module: str | None) -> None:
        for name in [name for name in self.running if next_module not in SESSION_SERVER_USERS[name]]:
            self.running.pop(name).stop()

    def stop(self) -> None:
        self.stop_unused(None)


_SESSION_SERVERS = pytest.StashKey[SessionServers]()


@pytest.fixture(scope="session")
def session_servers(request, tmp_path_factory, model_dir):
    servers = request.session.stash[_SESSION_SERVERS] = SessionServers(tmp_path_factory)
    yield servers
    servers.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield  # (the item's own fixtures torn down first)
    if (servers := item.session.stash.get(_SESSION_SERVERS, None)) is not None:
        servers.stop_unused(nextitem.path.stem if nextitem is not None else None)


@pytest.fixture(scope="module")
def default_server(session_servers):
    """The default topology's `pdflow run` (disaggregated, tcp data plane, prefix cache on, and
    ``kv.direct``), shared by every module that needs no other shape (:class:`SessionServers`).
    Tests leave it as they found it: no request in flight, no lease held. Its secret is known
    (``default_server.keys()``), so a test can speak on its control plane as any replica."""
    return session_servers.get("default_server")


@pytest.fixture(scope="module")
def colocated_server(session_servers):
    """The colocated baseline's `pdflow run`, on the same terms as ``default_server``."""
    return session_servers.get("colocated_server")


@pytest.fixture(scope="module")
def shm_server(session_servers):
    """The default topology over shm links (zero copies), on the same terms as ``default_server``
    (tests/test_e2e_transports.py restarts its kv-shuttle once)."""
    return session_servers.get("shm_server")


def shared_server(request, deployment: str) -> PdflowServer:
    """The session's server of ``deployment`` ("disaggregated", "colocated" or "zero-copy")."""
    names = {"disaggregated": "default_server", "colocated": "colocated_server", "zero-copy": "shm_server"}
    return request.getfixturevalue(names[deployment])


@pytest.fixture(scope="module")
def server(default_server):
    return default_server
