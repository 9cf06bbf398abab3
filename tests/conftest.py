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

# Where the suite runs in workers (scripts/test.sh: ``--dist loadfile``), a worker takes one unit at a
# time: a module, or one of these groups of modules, run one after another in one worker. A group's
# modules share a session server that few other modules use (the colocated and the shm one): each
# worker that ran one of them would start its own (a start took 7-10 s of CPU on an idle machine
# before logging stopped importing transformers, 4.2 s after; an idle server 0.43-0.46 s of CPU in
# 20 s while the worker lives).
SHARED_SERVER_GROUPS = {
    "colocated-and-shm-servers": ("test_prefix_reuse", "test_e2e_transports", "test_e2e", "test_e2e_sampling_api",
                                  "test_simulate"),
}
UNIT_OF_MODULE = {module: group for group, modules in SHARED_SERVER_GROUPS.items() for module in modules}

# The units that take longest start first (measured with --durations=0 in 3 workers), so that no long
# one starts last, alone; the rest keep pytest's order.
LONGEST_FIRST = (*SHARED_SERVER_GROUPS["colocated-and-shm-servers"], "test_e2e_ray", "test_engine", "test_e2e_disk_tier",
                 "test_hostile_http", "test_e2e_failures", "test_e2e_hosts", "test_cache_aware",
                 "test_e2e_kv_structural", "test_cli", "test_speculative", "test_e2e_kv_codecs", "test_bench_speculative",
                 "test_e2e_models_by_path", "test_kernels", "test_examples", "test_transports", "test_e2e_scaler",
                 "test_bench_serve")


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


@pytest.fixture(scope="session")
def default_server(tmp_path_factory, model_dir):
    """One `pdflow run` of the default topology (disaggregated, tcp data plane, prefix cache on)
    for the whole session: every module that needs no other shape shares it (each start costs
    about 20 s). Tests leave it as they found it: no request in flight, no lease held. Its secret
    is known (``default_server.keys()``), so a test can speak on its control plane as any replica.
    One setting differs from the default: ``kv.direct``, so that every module on it runs the direct
    path (prefill into decode's pool) for prompts with no stored prefix and the store's path for
    the rest; the store's forwarding of every chunk is what every other server runs."""
    with PdflowServer(tmp_path_factory.mktemp("pdflow"), server=DEFAULT_SERVER, kv={"direct": True}) as running:
        yield running


@pytest.fixture(scope="session")
def colocated_server(tmp_path_factory, model_dir):
    """One `pdflow run` of the colocated baseline (one worker, chunked prefill of 64 tokens) for
    the whole session, on the same terms as ``default_server``."""
    with PdflowServer(tmp_path_factory.mktemp("pdflow-colocated"), **COLOCATED) as running:
        yield running


@pytest.fixture(scope="session")
def shm_server(tmp_path_factory, model_dir):
    """One `pdflow run` of the default topology over shm links, where prefill computes the KV in
    the store's blocks and decode attends from them (zero copies), for the whole session, on the
    same terms as ``default_server`` (tests/test_e2e_transports.py restarts its kv-shuttle once)."""
    with PdflowServer(tmp_path_factory.mktemp("pdflow-shm"), transport="shm") as running:
        yield running


def shared_server(request, deployment: str) -> PdflowServer:
    """The session's server of ``deployment`` ("disaggregated", "colocated" or "zero-copy")."""
    names = {"disaggregated": "default_server", "colocated": "colocated_server", "zero-copy": "shm_server"}
    return request.getfixturevalue(names[deployment])


@pytest.fixture(scope="module")
def server(default_server):
    return default_server
