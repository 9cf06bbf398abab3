"""Every control-plane message, and the header that travels with each KV chunk.

All messages are frozen msgspec Structs encoded as msgpack arrays (``array_like``): the field
order is the wire format, so new fields are appended at the end, with defaults. The class name is
the tag, so one typed decoder per socket turns bytes back into the right class.

KV bytes never travel in these messages: they go over the data plane (``pdflow.transports``),
described by a :class:`KvChunkHeader`.
"""

from __future__ import annotations

from typing import Union

import msgspec

PROTOCOL_VERSION = 13  # 2: generic routes, plug-in message types, the version on every frame; 3: the KV store;
# 4: authenticated planes (the data-plane handshake proves the pipeline key; request messages are sender-checked);
# 5: tokens straight to ingress, decode's KV destinations in pool slots; 6: KV computed and attended in the
# store's own blocks (KvPlan.prefix_slots, KvInPlace, KvInStore); 7: the disk tier (KvExpected.keep_s, PlanWanted,
# KvForget, heartbeat notes); 8: KV codecs (KvChunkHeader.codec, codec_block: an older receiver would take encoded
# bytes for KV); 9: KvDestination slots of -1 (blocks a structural codec drops), DecodeRequest.prompt_ids
# (speculative decoding); 10: several hosts (ReplicaExited, from a host's launcher), KvHoldings; 11: a prefix
# fetched from another store (Route.fetch_from, KvFetch, KvFetched); 12: the sampling API (SamplingParams' penalties,
# bias, min_p, min_tokens, logprobs and guide; Tokens/TextDelta logprobs; KvExpected.reuse_prefix); 13: the direct
# path (KvPlan.direct: prefill writes into decode's pool itself)


# (omit_defaults would do nothing here: msgspec sends every field of an array_like struct)
class Message(msgspec.Struct, frozen=True, array_like=True, gc=False, tag=True):
    """The base of every control-plane message, built-in or a plug-in stage's own.

    A plug-in stage declares its message types in ``Stage.messages``; the bus's typed decoders are
    built from the built-in types plus those, so the class name (the tag) must be unique.
    """


class SamplingParams(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """How to pick each next token. ``temperature == 0`` means greedy."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()  # besides the model's own end-of-sequence ids
    ignore_eos: bool = False
    # the logits processors (pdflow.engine.logits), as vLLM and OpenAI define them; prefill applies them
    # to the first token and decode to the rest, decode counting the first as already generated
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # over the prompt's and the output's tokens (1: off)
    min_p: float = 0.0
    min_tokens: int = 0  # no end-of-sequence or stop token before this many output tokens
    logit_bias: dict[int, float] = {}
    logprobs: int | None = None  # each output token's log-probability and this many alternatives (None: none)
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (prefill, from its second token)
    guide: str = ""  # a grammar the output follows (pdflow.engine.guided.GuideSpec's text; "": none)

    @property
    def reads_prompt(self) -> bool:
        """Does sampling need the prompt's tokens (a repetition penalty counts them)?"""
        return self.repetition_penalty != 1.0


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One token's log-probability under the model (before penalties, bias and temperature, as
    vLLM's default ``raw_logprobs``), with the ``top_ids`` most likely tokens' ``top_logprobs``."""

    logprob: float
    top_ids: list[int] = []
    top_logprobs: list[float] = []


class Route(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Which replica of each stage serves one request (chosen by ingress's router), by stage name."""

    replicas: dict[str, int] = {}
    # a replica of a KV-keeping stage (by stage name) that holds more of the prompt's prefix than
    # the one on the route: the one on the route fetches it from there rather than recomputing it
    fetch_from: dict[str, int] = {}

    def of(self, stage: str) -> int:
        """The replica of ``stage`` on this route (0 for a stage the route does not name)."""
        return self.replicas.get(stage, 0)


# --- the life of one request ---------------------------------------------------------------


class PrefillRequest(Message):
    """ingress -> prefill: compute the prompt's KV and the first token."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    route: Route
    keep_s: float | None = None  # the colocated worker's store: keep this request's KV at most this long


class KvExpected(Message):
    """ingress -> kv-shuttle: a request's KV is coming: find its cached prefix, lease its blocks."""

    request_id: str
    prompt_ids: list[int]
    route: Route
    keep_s: float | None = None  # keep the request's KV at most this long (0: not at all; None: the store's default)
    reuse_prefix: bool = True  # False: compute the whole prompt (its prompt logprobs are wanted), reuse nothing


class PlanWanted(Message):
    """prefill -> kv-shuttle: prefill has got to this request and waits for its plan (sent for
    every request where the store reads disk hits only then, ``kv.prefetch = false``; otherwise
    only when the plan is not in yet: a plan waiting for an earlier request's blocks is then
    made without them, since that request may be queued behind this one)."""

    request_id: str


class KvPlan(Message):
    """kv-shuttle -> prefill: the first ``cached_tokens`` of the prompt are in the store, in
    ``prefix_slots`` (their KV comes to the region prefill names in a :class:`PrefixDestination`,
    or prefill reads it there, where it maps the arena); write the KV of the rest into ``slots``
    of the store's arena (``num_slots`` slots) in ``region`` at ``address``. With ``direct``
    (``kv.direct``, no prefix stored): decode's pool destination, where prefill writes the KV
    first; the store forwards none of it."""

    request_id: str
    address: str
    region: int
    num_slots: int
    cached_tokens: int
    slots: list[int]
    prefix_slots: list[int] = []
    direct: KvDestination | None = None


class KvForget(Message):
    """ingress -> kv-shuttle (every replica), from the admin endpoint: drop the KV of a prefix
    (its blocks and every block built on them) or, with ``everything``, all of it, in memory and
    on disk. Only ingress may send it."""

    forget_id: str
    prompt_ids: list[int]
    everything: bool = False


class KvForgotten(Message):
    """kv-shuttle -> ingress: what a :class:`KvForget` dropped."""

    forget_id: str
    stage: str
    replica: int
    memory_blocks: int
    disk_blocks: int


class PrefixDestination(Message):
    """prefill -> kv-shuttle: write the cached prefix's KV into ``region`` at ``address`` (a
    request buffer of the prefix's tokens)."""

    request_id: str
    address: str
    region: int


class DecodeRequest(Message):
    """ingress -> decode: register memory for this request's KV, then decode once it lands."""

    request_id: str
    prompt_len: int
    sampling: SamplingParams
    route: Route
    prompt_ids: list[int] = []  # when decode speculates (prompt lookup drafts from them)


class EgressRequest(Message):
    """ingress -> egress (a pipeline with one): how to turn this request's tokens into text for the client."""

    request_id: str
    prompt_len: int
    max_tokens: int
    stop: tuple[str, ...] = ()
    skip_special_tokens: bool = True
    route: Route = Route()
    # a request migrated after a failure: the tokens generated before it (their text is
    # rebuilt, and its first ``resume_chars`` characters, which the client has, are not sent)
    resume_ids: list[int] = []
    resume_chars: int = 0


class KvDestination(Message):
    """Receiver -> sender: write this request's KV into ``region`` at ``address``.

    Decode sends it to kv-shuttle: with ``slots``, ``region`` is decode's pool of ``num_slots``
    slots in the store's block layout and block *i* of the request goes into ``slots[i]``
    (:mod:`pdflow.kv.arena`; -1: decode does not want that block, as a sink + window codec on
    the link drops it); without, ``region`` is a buffer of the request's own
    (:class:`~pdflow.kv.layout.KvLayout`, ``nbytes`` long).
    """

    request_id: str
    address: str
    region: int
    nbytes: int
    slots: list[int] = []
    num_slots: int = 0


class KvInPlace(Message):
    """decode -> kv-shuttle: instead of a :class:`KvDestination`: decode maps the store's arena and
    attends from the request's own blocks there; hold blocks for ``tokens`` tokens (its prompt
    and every token it may generate) and say which, once the prompt's KV is all in."""

    request_id: str
    tokens: int


class KvInStore(Message):
    """kv-shuttle -> decode (which sent :class:`KvInPlace`): the prompt's KV is all in the arena
    (``num_slots`` slots, ``region`` at ``address``); block *i* of the request is in ``slots[i]``,
    up to the blocks for the tokens decode asked for, which decode writes into as it generates.
    ``layer_in``: when each layer's KV was all in."""

    request_id: str
    address: str
    region: int
    num_slots: int
    slots: list[int]
    layer_in: list[float] = []


class PrefillDone(Message):
    """prefill -> decode: every layer is sent; ``first_token`` is the token to feed next."""

    request_id: str
    first_token: int
    finished: bool = False  # the first token already ended the request
    timeline: dict[str, list[float]] = {}


class KvReleased(Message):
    """decode -> kv-shuttle: the request ended at decode; ``output_ids`` are the generated tokens
    whose KV decode still holds: when they complete blocks the store lacks, the shuttle answers
    with :class:`KvReturnSlots`, else it drops the request's lease at once."""

    request_id: str
    output_ids: list[int] = []


class KvReturnSlots(Message):
    """kv-shuttle -> decode: write the sequence's KV of tokens ``first_token ..`` into ``slots``
    (block by block) of the store's arena in ``region`` at ``address``; no slots: nothing wanted."""

    request_id: str
    address: str
    region: int
    num_slots: int
    first_token: int
    slots: list[int]


class Tokens(Message):
    """prefill/decode/worker -> ingress (or an egress stage): new tokens of one request, ``index``
    of the first in the output."""

    request_id: str
    index: int
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | None
    timeline: dict[str, list[float]] = {}
    cached_tokens: int = 0  # on the first: prompt tokens whose KV came from the store
    draft_proposed: int = 0  # speculative decoding: draft tokens verified for the request so far ...
    draft_accepted: int = 0  # ... and kept
    logprobs: list[TokenLogprob] = []  # one per token of ``token_ids`` (when the request asks for them)
    prompt_logprobs: list[TokenLogprob] = []  # on the first: the prompt's tokens from the second on


class TextDelta(Message):
    """egress -> ingress (a pipeline with an egress stage; else ingress makes them itself): new text
    for the client; ``token_ids``: the tokens generated since the previous delta (what ingress
    re-prefills if the request must migrate)."""

    request_id: str
    text: str
    completion_tokens: int
    finish_reason: str | None = None
    timeline: dict[str, list[float]] = {}
    cached_tokens: int = 0
    token_ids: list[int] = []
    draft_proposed: int = 0  # as in Tokens
    draft_accepted: int = 0
    logprobs: list[TokenLogprob] = []  # one per token of ``token_ids`` (when asked for)
    prompt_logprobs: list[TokenLogprob] = []  # as in Tokens


class RequestFailed(Message):
    """any stage -> ingress: this request cannot finish here; answer the client with an error, or
    (``transient``: KV lost or damaged on the data plane) run it again (see ingress's migration)."""

    request_id: str
    stage: str
    message: str
    transient: bool = False


class Cancel(Message):
    """ingress -> every stage: forget this request and free what it holds."""

    request_id: str
    reason: str = "cancelled"


class StopRequest(Message):
    """ingress (or egress) -> decode/worker: a stop string matched; stop generating (the text is finished)."""

    request_id: str


# --- the life of a stage ------------------------------------------------------------------


class Hello(Message):
    """First message on every connection between peers: the protocol version is checked."""

    protocol_version: int
    stage: str
    replica: int
    pid: int


class Ready(Message):
    """stage -> launcher: started, sockets bound, model loaded."""

    stage: str
    replica: int
    pid: int
    protocol_version: int


class Heartbeat(Message):
    """stage -> launcher, every ``heartbeat_interval_s``."""

    stage: str
    replica: int
    seq: int
    in_flight: int = 0
    stats: dict[str, int] = {}  # the stage's own counters (kv-shuttle: its store's)
    notes: dict[str, str] = {}  # its conditions in words (kv-shuttle: "disk", why its disk tier is off)


class StageFailed(Message):
    """stage -> launcher: an unrecoverable error, with its traceback; the stage exits next."""

    stage: str
    replica: int
    error: str


class KvHoldings(Message):
    """kv-shuttle -> ingress, a few times a second while its store changes: the block ids it
    indexed (``added``) and dropped (``removed``) since its report ``seq - 1``, or (``full``) all it
    holds. Ids as their low 64 bits, 8 bytes each, little-endian (:mod:`pdflow.kv.holdings`).
    Taken only from the replica it names."""

    stage: str
    replica: int
    seq: int
    full: bool
    added: bytes
    removed: bytes = b""


class KvFetch(Message):
    """kv-shuttle -> another replica of it (named in the request's ``Route.fetch_from``): write
    the blocks of ``prompt_ids`` from block ``first_block`` on that your store holds into my
    arena's ``slots`` (one per block from ``first_block``; ``num_slots`` slots, ``region`` at
    ``address``), as chunks of request ``fetch_id``, then answer :class:`KvFetched`. ``stage``
    and ``replica``: who asks; taken only from that replica."""

    fetch_id: str
    stage: str
    replica: int
    prompt_ids: list[int]
    first_block: int
    address: str
    region: int
    num_slots: int
    slots: list[int]


class KvFetched(Message):
    """kv-shuttle -> the replica that sent :class:`KvFetch`: the first ``blocks`` blocks asked
    for are written (their chunks all sent; 0: none held, or the writes failed). ``stage`` and
    ``replica``: who answers; taken only from that replica."""

    fetch_id: str
    stage: str
    replica: int
    blocks: int


class ReplicaExited(Message):
    """a host's launcher -> the supervising launcher (a pipeline on several hosts): the process
    of a replica on its host exited; it restarts it (or, past ``max_restarts``, gives up)."""

    stage: str
    replica: int
    reason: str
    restarting: bool


class StageDown(Message):
    """launcher -> every stage: a replica died; whatever it held is lost."""

    stage: str
    replica: int
    reason: str


class StageUp(Message):
    """launcher -> every stage: a replica (re)started and is ready."""

    stage: str
    replica: int


class StageStatus(Message):
    """launcher -> every stage, every ``heartbeat_interval_s`` (at most a second), one per replica:
    what it is doing."""

    stage: str
    replica: int
    state: str  # "starting" | "ready" | "restarting"
    pid: int
    in_flight: int
    restarts: int
    stats: dict[str, int] = {}
    notes: dict[str, str] = {}
    heartbeat: int = -1  # the seq of the heartbeat that brought ``stats`` (-1: none yet)


class ProtocolRefused(Message):
    """stage -> launcher: a peer that speaks another protocol version tried to talk to this stage;
    its messages are refused, and the launcher stops the pipeline naming both versions."""

    stage: str
    replica: int
    error: str


# A chunk already on its way on the data plane may still land this long after the request it
# belongs to ended unfinished (a cancel, a failure, an expired lease): whoever registered the slots
# it may land in (decode's pool, the KV store) reuses them only after this quarantine.
LATE_WRITES_S = 3.0


class KvChunkHeader(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Describes one chunk of KV bytes on the data plane: ``layer``'s keys (or values) of tokens
    ``token_start .. token_end``, token-major, shaped ``shape``.

    The payload is written into the receiver's registered ``region`` at ``offset``; ``checksum``
    is the xxh3-64 of the payload (:func:`pdflow.kv.layout.checksum`), verified on arrival.
    Receivers count what has landed by the token range.

    ``codec``: how the payload is encoded (:attr:`pdflow.kv.codecs.KvCodec.spec`; "none": the
    KV's own bytes), block by block of ``codec_block`` tokens. An encoded payload lands at the
    start of the span its ``shape`` and ``dtype`` take in the region and is decoded there
    (:mod:`pdflow.kv.coded`); ``nbytes`` and ``checksum`` are the encoded payload's.
    """

    request_id: str
    layer: int
    kind: int  # 0: keys, 1: values, -1: not KV (raw bytes, e.g. in tests)
    token_start: int
    token_end: int
    dtype: str
    shape: tuple[int, ...]
    region: int
    offset: int
    nbytes: int
    checksum: int
    codec: str = "none"
    codec_block: int = 0


ControlMessage = (
    PrefillRequest
    | KvExpected
    | KvPlan
    | PrefixDestination
    | KvReturnSlots
    | KvInPlace
    | KvInStore
    | PlanWanted
    | KvForget
    | KvForgotten
    | KvHoldings
    | KvFetch
    | KvFetched
    | DecodeRequest
    | EgressRequest
    | KvDestination
    | PrefillDone
    | KvReleased
    | Tokens
    | TextDelta
    | RequestFailed
    | Cancel
    | StopRequest
    | Hello
    | Ready
    | Heartbeat
    | StageFailed
    | ReplicaExited
    | StageDown
    | StageUp
    | StageStatus
    | ProtocolRefused
)

ALL_MESSAGES: tuple[type, ...] = ControlMessage.__args__  # type: ignore[attr-defined]
LAUNCHER_MESSAGES: tuple[type, ...] = (Ready, Heartbeat, StageFailed, ProtocolRefused,  # stage -> launcher
                                       ReplicaExited)  # a host's launcher -> the supervising one
INGRESS_ONLY: tuple[type, ...] = (KvForget,)  # not about one request, and taken from ingress only
# about (or from) the replica it names, and taken from that replica only
SELF_REPORTS: tuple[type, ...] = (KvHoldings, KvFetch, KvFetched)



class ProtocolMismatch(RuntimeError):
    """A peer speaks another protocol version."""


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def decoder(types: type | tuple[type, ...] = ALL_MESSAGES) -> msgspec.msgpack.Decoder:
    """A typed decoder for one type or a tuple of message types (the built-in messages, plus
    plug-in stages' own); create one per socket, once."""
    if isinstance(types, tuple):
        types = types[0] if len(types) == 1 else Union[types]  # noqa: UP007 (a runtime union)
    return msgspec.msgpack.Decoder(types)


def with_plugins(extra: tuple[type, ...]) -> tuple[type, ...]:
    """The built-in messages plus ``extra`` (deduplicated); a tag used twice is a TypeError."""
    types = list(ALL_MESSAGES)
    tags = {t.__name__: t for t in types}
    for t in extra:
        if not (isinstance(t, type) and issubclass(t, Message)):
            raise TypeError(f"{t!r} is not a pdflow.messages.Message subclass")
        if tags.get(t.__name__) is t:
            continue
        if t.__name__ in tags:
            raise TypeError(f"message type {t.__module__}.{t.__qualname__} reuses the tag {t.__name__!r} "
                            f"of {tags[t.__name__].__module__}.{t.__name__}; rename it")
        tags[t.__name__] = t
        types.append(t)
    return tuple(types)


def check_hello(hello: Hello) -> None:
    if hello.protocol_version != PROTOCOL_VERSION:
        raise ProtocolMismatch(
            f"{hello.stage}-{hello.replica} (pid {hello.pid}) speaks pdflow protocol "
            f"{hello.protocol_version}, this process speaks {PROTOCOL_VERSION}: "
            "run the same pdflow version on every stage"
        )
