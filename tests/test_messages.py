"""pdflow.messages: every message round-trips, the wire format is a tagged array whose field order
is pinned, bad bytes raise msgspec errors, and the protocol version is checked on hello."""

from __future__ import annotations

import msgspec
import pytest

from pdflow.messages import (
    ALL_MESSAGES, PROTOCOL_VERSION, Cancel, DecodeRequest, EgressRequest, Heartbeat, Hello,
    KvChunkHeader, KvDestination, KvExpected, KvFetch, KvFetched, KvForget, KvForgotten, KvHoldings, KvPlan, KvInPlace, PlanWanted, KvInStore, KvReleased, KvReturnSlots, PrefillDone, PrefillRequest,
    PrefixDestination,
    ProtocolMismatch, ProtocolRefused, Ready, ReplicaExited, RequestFailed, Route, SamplingParams, StageDown, StageFailed,
    StageStatus, StageUp, StopRequest, TextDelta, TokenLogprob, Tokens, check_hello, decoder, encoder,
)

ROUTE = Route({"ingress": 0, "prefill": 1, "kv_shuttle": 2, "decode": 3, "egress": 1})
SAMPLING = SamplingParams(max_tokens=64, temperature=0.7, top_p=0.9, top_k=40, seed=1234,
                          stop_token_ids=(2, 49152), ignore_eos=True)
TIMELINE = {"prefill.start": [12.5], "kv.layer.sent": [12.51, 12.52, 12.53], "decode.step": []}

# For each message: one instance with every defaulted field left out, and one with every field set
# to something other than its default (where the message has defaults at all).
SAMPLES: dict[type, list[msgspec.Struct]] = {
    PrefillRequest: [
        PrefillRequest("req-1", [1, 2, 3], SamplingParams(), Route()),
        PrefillRequest("req-2", list(range(500)), SAMPLING, ROUTE),
    ],
    KvExpected: [KvExpected("req-1", [1, 2, 3], ROUTE), KvExpected("req-2", [4], ROUTE, keep_s=0.0)],
    PlanWanted: [PlanWanted("req-1")],
    KvForget: [KvForget("f-1", [1, 2, 3]), KvForget("f-2", [], everything=True)],
    KvForgotten: [KvForgotten("f-1", "kv_shuttle", 1, 12, 30)],
    KvPlan: [KvPlan("req-1", "tcp://127.0.0.1:5630", 0, 1456, 128, [2, 3, 4, 9]),
             KvPlan("req-2", "shm://@pdflow-1", 0, 1456, 128, [2, 3], prefix_slots=[0, 1])],
    KvInPlace: [KvInPlace("req-1", 300)],
    KvInStore: [KvInStore("req-1", "shm://@pdflow-1", 0, 1456, [0, 1, 5]),
                KvInStore("req-2", "shm://@pdflow-1", 0, 1456, [7], layer_in=[1.5, 1.6])],
    PrefixDestination: [PrefixDestination("req-1", "tcp://127.0.0.1:5620", 3)],
    KvReturnSlots: [KvReturnSlots("req-1", "tcp://127.0.0.1:5630", 0, 1456, 192, [17, 18])],
    DecodeRequest: [
        DecodeRequest("req-1", 17, SamplingParams(temperature=0.0), Route()),
        DecodeRequest("req-2", 4096, SAMPLING, ROUTE),
    ],
    EgressRequest: [
        EgressRequest("req-1", 17, 16),
        EgressRequest("req-2", 17, 32, stop=("\n\n", "END"), skip_special_tokens=False, route=ROUTE),
        EgressRequest("req-3~1", 25, 24, route=ROUTE, resume_ids=[9, 8, 7], resume_chars=11),
    ],
    KvDestination: [KvDestination("req-1", "tcp://127.0.0.1:5630", 7, 1_382_400)],
    PrefillDone: [
        PrefillDone("req-1", 42),
        PrefillDone("req-2", 2, finished=True, timeline=TIMELINE),
    ],
    KvReleased: [KvReleased("req-1"), KvReleased("req-2", [5, 6, 7])],
    Tokens: [
        Tokens("req-1", 0, [42]),
        Tokens("req-2", 5, [7, 8, 9], finish_reason="length", timeline=TIMELINE, cached_tokens=64),
    ],
    TextDelta: [
        TextDelta("req-1", "Hello", 1),
        TextDelta("req-2", " wörld ✓", 9, finish_reason="stop", timeline=TIMELINE, cached_tokens=128),
        TextDelta("req-3", "ab", 3, token_ids=[5, 6]),
    ],
    RequestFailed: [RequestFailed("req-1", "decode", "out of KV memory"),
                    RequestFailed("req-2", "kv-shuttle", "KV chunk lost", transient=True)],
    Cancel: [Cancel("req-1"), Cancel("req-2", reason="client disconnected")],
    StopRequest: [StopRequest("req-1")],
    Hello: [Hello(PROTOCOL_VERSION, "kv_shuttle", 1, 4242)],
    Ready: [Ready("decode", 0, 4243, PROTOCOL_VERSION)],
    Heartbeat: [Heartbeat("prefill", 0, 1), Heartbeat("prefill", 2, 999_999, in_flight=5, stats={"hits": 3}),
                Heartbeat("kv_shuttle", 0, 4, notes={"disk": "off, memory only: No space left on device"})],
    StageFailed: [StageFailed("decode", 1, "Traceback (most recent call last):\n  ...\nRuntimeError: boom")],
    ReplicaExited: [ReplicaExited("decode", 1, "exited with status 1", True)],
    KvHoldings: [KvHoldings("kv_shuttle", 0, 0, True, bytes(range(16))),
                 KvHoldings("kv_shuttle", 1, 7, False, b"", bytes(8))],
    KvFetch: [KvFetch("req-1:fetch", "kv_shuttle", 1, [1, 2, 3] * 64, 2, "tcp://10.0.0.2:7001", 0, 512, [7, 8, 40])],
    KvFetched: [KvFetched("req-1:fetch", "kv_shuttle", 0, 1), KvFetched("req-2:fetch", "kv_shuttle", 0, 0)],
    StageDown: [StageDown("kv_shuttle", 0, "exited with status -9")],
    StageUp: [StageUp("kv_shuttle", 0)],
    StageStatus: [StageStatus("decode", 0, "restarting", 4244, 3, 2),
                  StageStatus("kv_shuttle", 0, "ready", 4245, 1, 0, {"blocks_used": 7})],
    ProtocolRefused: [ProtocolRefused("decode", 0, "prefill-0 (pid 7) speaks pdflow protocol 1")],
}

HEADER = KvChunkHeader("req-1", 29, 1, 0, 17, "bfloat16", (17, 3, 64), 4, 1_234_560, 6528, 2**64 - 1)


def test_every_message_has_samples() -> None:
    assert len(ALL_MESSAGES) == len(set(ALL_MESSAGES)) == len(SAMPLES)
    assert set(SAMPLES) == set(ALL_MESSAGES), "add samples for a new message here"
    for cls in ALL_MESSAGES:
        assert any(isinstance(m, cls) for m in SAMPLES[cls])


def test_every_message_is_a_frozen_tagged_array() -> None:
    for cls in ALL_MESSAGES:
        config = cls.__struct_config__
        assert config.frozen and config.array_like, cls
        assert config.tag == cls.__name__, cls
    with pytest.raises(AttributeError):
        SAMPLES[Tokens][0].index = 3  # type: ignore[misc]


def _samples() -> list[msgspec.Struct]:
    return [m for cls in ALL_MESSAGES for m in SAMPLES[cls]]


@pytest.mark.parametrize("message", _samples(), ids=lambda m: type(m).__name__)
def test_round_trip(message: msgspec.Struct) -> None:
    data = encoder().encode(message)
    back = decoder().decode(data)
    assert type(back) is type(message)
    assert back == message
    assert msgspec.structs.asdict(back) == msgspec.structs.asdict(message)
    # a decoder typed for just this class reads it too
    assert decoder(type(message)).decode(data) == message


def test_nested_structs_and_defaults_survive() -> None:
    back = decoder().decode(encoder().encode(SAMPLES[PrefillRequest][1]))
    assert back.sampling == SAMPLING and back.route == ROUTE
    assert back.sampling.stop_token_ids == (2, 49152) and isinstance(back.sampling.stop_token_ids, tuple)
    assert back.sampling.seed == 1234 and back.sampling.ignore_eos is True
    minimal = decoder().decode(encoder().encode(SAMPLES[EgressRequest][0]))
    assert (minimal.stop, minimal.skip_special_tokens, minimal.route) == ((), True, Route())
    done = decoder().decode(encoder().encode(SAMPLES[PrefillDone][1]))
    assert done.timeline == TIMELINE and done.finished is True


def test_one_encoder_and_decoder_serve_many_messages() -> None:
    enc, dec = encoder(), decoder()
    messages = _samples()
    assert [dec.decode(enc.encode(m)) for m in messages] == messages


def test_kv_chunk_header_round_trip() -> None:
    data = encoder().encode(HEADER)
    back = decoder(KvChunkHeader).decode(data)
    assert type(back) is KvChunkHeader and back == HEADER
    assert back.shape == (17, 3, 64) and back.checksum == 2**64 - 1
    # it is not a control message: untagged, so the control decoder refuses it
    assert msgspec.msgpack.decode(data)[0] == "req-1"
    with pytest.raises(msgspec.ValidationError):
        decoder().decode(data)


@pytest.mark.parametrize("garbage", [b"", b"\xc1", b"\x93\x01", b"not msgpack at all", b"\xff" * 8])
def test_garbage_raises_a_decode_error(garbage: bytes) -> None:
    with pytest.raises(msgspec.DecodeError):
        decoder().decode(garbage)
    with pytest.raises(msgspec.DecodeError):
        decoder(KvChunkHeader).decode(garbage)


def test_wrong_type_raises_a_validation_error() -> None:
    enc = encoder()
    with pytest.raises(msgspec.ValidationError):
        decoder(Hello).decode(enc.encode(Heartbeat("prefill", 0, 1)))  # the wrong message
    with pytest.raises(msgspec.ValidationError):
        decoder(KvChunkHeader).decode(enc.encode(Heartbeat("prefill", 0, 1)))  # too short
    with pytest.raises(msgspec.ValidationError, match="Nope"):
        decoder().decode(msgspec.msgpack.encode(["Nope", "req-1"]))  # unknown tag
    with pytest.raises(msgspec.ValidationError):
        decoder().decode(msgspec.msgpack.encode(["Tokens", "req-1", "zero", [1]]))  # a field's type
    with pytest.raises(msgspec.ValidationError):
        decoder().decode(msgspec.msgpack.encode(["Tokens", "req-1"]))  # required fields missing
    with pytest.raises(msgspec.ValidationError):
        decoder().decode(msgspec.msgpack.encode({"request_id": "req-1"}))  # a map, not an array


def test_wire_format_is_an_array_tagged_with_the_class_name() -> None:
    for message in _samples():
        raw = msgspec.msgpack.decode(encoder().encode(message))
        assert isinstance(raw, list), type(message)
        assert raw[0] == type(message).__name__
        fields = msgspec.structs.fields(type(message))
        # the items after the tag are the fields, in declaration order
        for item, field in zip(raw[1:], fields):
            value = getattr(message, field.name)
            if not isinstance(value, msgspec.Struct | tuple):
                assert item == value, (type(message).__name__, field.name)
    route_map = {"ingress": 0, "prefill": 1, "kv_shuttle": 2, "decode": 3, "egress": 1}
    assert msgspec.msgpack.decode(encoder().encode(ROUTE)) == [route_map, {}]
    raw = msgspec.msgpack.decode(encoder().encode(SAMPLES[PrefillRequest][1]))
    assert raw[:3] == ["PrefillRequest", "req-2", list(range(500))]
    assert raw[3][:5] == [64, 0.7, 0.9, 40, 1234] and raw[4] == [route_map, {}]


def test_older_and_newer_peers_still_decode() -> None:
    # an older peer leaves out fields appended later: they take their defaults
    old = decoder().decode(msgspec.msgpack.encode(["Tokens", "req-1", 3, [5, 6]]))
    assert old == Tokens("req-1", 3, [5, 6], finish_reason=None, timeline={})
    # a newer peer appends fields this version does not know: they are ignored
    new = decoder().decode(msgspec.msgpack.encode(["Heartbeat", "decode", 1, 7, 2, {}, {}, "from the future"]))
    assert new == Heartbeat("decode", 1, 7, in_flight=2)


# Field order is the wire format (array_like): a reorder or an insertion silently garbles every
# peer running the previous version. Append new fields at the end, with defaults, and extend these.
def _names(cls: type) -> list[str]:
    return [f.name for f in msgspec.structs.fields(cls)]


def test_field_order_is_pinned() -> None:
    assert _names(PrefillRequest) == ["request_id", "prompt_ids", "sampling", "route", "keep_s"]
    assert _names(KvExpected) == ["request_id", "prompt_ids", "route", "keep_s", "reuse_prefix"]
    assert _names(Heartbeat)[-2:] == ["stats", "notes"]
    assert _names(Tokens) == ["request_id", "index", "token_ids", "finish_reason", "timeline", "cached_tokens",
                              "draft_proposed", "draft_accepted", "logprobs", "prompt_logprobs"]
    assert _names(KvChunkHeader) == [
        "request_id", "layer", "kind", "token_start", "token_end", "dtype", "shape",
        "region", "offset", "nbytes", "checksum", "codec", "codec_block",
    ]
    assert _names(SamplingParams) == [
        "max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos",
        "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "logit_bias",
        "logprobs", "prompt_logprobs", "guide",
    ]
    assert _names(TokenLogprob) == ["logprob", "top_ids", "top_logprobs"]
    assert _names(Route) == ["replicas", "fetch_from"]
    assert _names(Hello) == ["protocol_version", "stage", "replica", "pid"]
    assert _names(TextDelta) == ["request_id", "text", "completion_tokens", "finish_reason", "timeline",
                                 "cached_tokens", "token_ids", "draft_proposed", "draft_accepted", "logprobs",
                                 "prompt_logprobs"]
    assert _names(EgressRequest)[-2:] == ["resume_ids", "resume_chars"]
    assert _names(DecodeRequest) == ["request_id", "prompt_len", "sampling", "route", "prompt_ids"]
    assert _names(ReplicaExited) == ["stage", "replica", "reason", "restarting"]
    assert _names(KvHoldings) == ["stage", "replica", "seq", "full", "added", "removed"]
    assert _names(KvFetch) == ["fetch_id", "stage", "replica", "prompt_ids", "first_block", "address", "region",
                               "num_slots", "slots"]
    assert _names(KvFetched) == ["fetch_id", "stage", "replica", "blocks"]


def test_appended_fields_have_defaults() -> None:
    """Once a field has a default, every later one needs one too (else old peers cannot decode)."""
    for cls in (*ALL_MESSAGES, SamplingParams, Route, KvChunkHeader):
        seen_default = False
        for field in msgspec.structs.fields(cls):
            has_default = field.default is not msgspec.NODEFAULT or field.default_factory is not msgspec.NODEFAULT
            assert has_default or not seen_default, (cls.__name__, field.name)
            seen_default |= has_default


def test_check_hello_accepts_this_version() -> None:
    assert check_hello(Hello(PROTOCOL_VERSION, "decode", 0, 4242)) is None


@pytest.mark.parametrize("version", [PROTOCOL_VERSION + 6, 0, -3])
def test_check_hello_rejects_other_versions(version: int) -> None:
    with pytest.raises(ProtocolMismatch) as info:
        check_hello(Hello(version, "kv_shuttle", 3, 4242))
    message = str(info.value)
    assert "kv_shuttle" in message
    assert f"protocol {version}," in message
    assert f"speaks {PROTOCOL_VERSION}" in message
    assert isinstance(info.value, RuntimeError)


def test_check_hello_after_the_wire() -> None:
    hello = decoder().decode(encoder().encode(Hello(PROTOCOL_VERSION + 1, "egress", 0, 1)))
    with pytest.raises(ProtocolMismatch, match="egress"):
        check_hello(hello)
