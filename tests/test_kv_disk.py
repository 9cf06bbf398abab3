"""pdflow.kv.disk: the store's disk tier on real files: round trips, restart, torn tails and bit
flips caught (never served), LRU by segment within the capacity, and a full disk turning the tier
off with its reason while what is there stays readable."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from pdflow.kv.disk import HEADER_BYTES, DiskInUse, DiskTier, Outcome

BLOCK = 4096 + 64  # any size: a block of the arena's layout, here small
SEGMENT = 4 * (HEADER_BYTES + BLOCK)  # four records a segment


def _block(seed: int) -> bytes:
    return random.Random(seed).randbytes(BLOCK)


def _tier(path: Path, capacity_segments: int = 8) -> DiskTier:
    return DiskTier(path, capacity_segments * SEGMENT, BLOCK, segment_bytes=SEGMENT)


def test_blocks_go_to_disk_and_come_back_as_they_were(tmp_path):
    disk = _tier(tmp_path)
    assert disk.put(1 << 100, None, _block(1)) and disk.put(2, 1 << 100, bytearray(_block(2)))
    assert not disk.put(2, 1 << 100, _block(2))  # stored already: a block id names its content
    into = bytearray(BLOCK)
    assert disk.get(1 << 100, into) is Outcome.HIT and bytes(into) == _block(1)
    assert disk.get(2, into) is Outcome.HIT and bytes(into) == _block(2)
    assert disk.get(3, into) is Outcome.MISS
    assert disk.parent(2) == 1 << 100 and disk.parent(1 << 100) is None and 2 in disk and 3 not in disk
    stats = disk.stats()
    assert (stats.blocks, stats.writes, stats.hits, stats.misses, stats.disabled) == (2, 2, 2, 1, "")
    with pytest.raises(ValueError, match="a block is"):
        disk.put(4, None, b"short")


def test_a_restart_finds_every_whole_block_and_cuts_a_torn_tail(tmp_path):
    disk = _tier(tmp_path)
    for i in range(6):  # two segments
        disk.put(i, i - 1 if i else None, _block(i))
    disk.close()
    segments = sorted(tmp_path.glob("seg-*.pdkv"))
    assert len(segments) == 2
    with open(segments[-1], "ab") as f:  # a crash in the middle of the next append
        f.write(b"PDKB" + bytes(HEADER_BYTES + 100))
    size = segments[-1].stat().st_size
    again = _tier(tmp_path)
    assert all(i in again for i in range(6)) and again.stats().corrupted == 1
    assert segments[-1].stat().st_size == size - HEADER_BYTES - 104  # cut back to its whole records
    into = bytearray(BLOCK)
    assert again.get(5, into) is Outcome.HIT and bytes(into) == _block(5) and again.parent(5) == 4
    assert again.put(6, 5, _block(6))  # appends go on (into a new segment)
    again.close()
    assert _tier(tmp_path).stats().blocks == 7


def test_a_flipped_bit_is_caught_on_read_and_the_block_never_served(tmp_path):
    disk = _tier(tmp_path)
    for i in range(3):
        disk.put(i, None, _block(i))
    disk.close()
    (segment,) = tmp_path.glob("seg-*.pdkv")
    with open(segment, "r+b") as f:  # one bit of block 1's payload
        f.seek(2 * HEADER_BYTES + BLOCK + 1000)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x10]))
    disk = _tier(tmp_path)
    into = bytearray(BLOCK)
    assert disk.get(1, into) is Outcome.CORRUPTED
    assert disk.get(1, into) is Outcome.MISS and 1 not in disk
    assert disk.get(0, into) is Outcome.HIT and disk.get(2, into) is Outcome.HIT and bytes(into) == _block(2)
    assert disk.stats().corrupted == 1
    disk.close()
    with open(segment, "r+b") as f:  # a damaged header: the scan stops there, earlier records stay
        f.seek(HEADER_BYTES + BLOCK + 20)
        f.write(b"\xff")
    disk = _tier(tmp_path)
    assert 0 in disk and 1 not in disk and 2 not in disk and disk.stats().corrupted == 1


def test_the_least_recently_used_segment_goes_first_and_the_capacity_holds(tmp_path):
    disk = _tier(tmp_path, capacity_segments=3)
    into = bytearray(BLOCK)
    for i in range(8):  # two full segments: [0..3], [4..7]
        disk.put(i, None, _block(i))
    assert disk.get(1, into) is Outcome.HIT  # the first segment is now the more recently used
    for i in range(8, 16):  # room for one more segment's worth only: the second goes
        disk.put(i, None, _block(i))
        assert disk.stats().bytes_used <= 3 * SEGMENT
    assert all(i in disk for i in range(4)) and not any(i in disk for i in range(4, 8))
    assert disk.stats().evicted_blocks >= 4 and len(list(tmp_path.glob("seg-*.pdkv"))) <= 3
    with pytest.raises(ValueError, match="two segments"):
        DiskTier(tmp_path / "small", SEGMENT, BLOCK, segment_bytes=SEGMENT)


def test_a_full_disk_turns_the_tier_off_with_its_reason_and_keeps_what_is_there(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root to mount a small tmpfs")
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={3 * SEGMENT}", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.strip()}")
    try:
        disk = DiskTier(mount, 100 * SEGMENT, BLOCK, segment_bytes=SEGMENT)  # more than the filesystem has
        stored = [i for i in range(40) if disk.put(i, None, _block(i))]
        assert 0 < len(stored) < 40
        assert "No space" in disk.stats().disabled
        assert not disk.put(99, None, _block(99))  # off: nothing more is tried
        into = bytearray(BLOCK)
        assert disk.get(stored[0], into) is Outcome.HIT and bytes(into) == _block(stored[0])
        disk.close()
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_blocks_move_between_scattered_buffers_in_one_call(tmp_path):
    disk = _tier(tmp_path)
    block = _block(7)
    spans = [block[i : i + 1040] for i in range(0, BLOCK, 1040)]  # as a block's spans in the arena
    assert disk.put(7, None, spans)
    into = [bytearray(1040) for _ in spans[:-1]] + [bytearray(BLOCK - 1040 * (len(spans) - 1))]
    assert disk.get(7, into) is Outcome.HIT and b"".join(into) == block
    one = bytearray(BLOCK)  # the checksum is the same however the payload was cut
    assert disk.get(7, one) is Outcome.HIT and bytes(one) == block


def test_one_process_owns_a_directory(tmp_path):
    disk = _tier(tmp_path)
    with pytest.raises(DiskInUse, match="give each its own disk_path"):
        _tier(tmp_path)
    disk.close()
    _tier(tmp_path).close()  # free again once closed


def test_versions_replace_and_a_pinned_version_is_told_apart(tmp_path):
    disk = _tier(tmp_path)
    into = bytearray(BLOCK)
    assert disk.put(5, None, _block(1), version=3)
    assert not disk.put(5, None, _block(1), version=3)  # that version is there
    assert disk.put(5, None, _block(2), version=4)  # re-put: a new version replaces it
    assert disk.version(5) == 4
    assert disk.get(5, into, version=3) is Outcome.VERSION_MISMATCH
    assert disk.get(5, into, version=4) is Outcome.HIT and bytes(into) == _block(2)
    disk.close()
    again = _tier(tmp_path)  # the replaced version stays buried after a restart
    assert again.version(5) == 4 and again.max_version == 4
    assert again.get(5, into) is Outcome.HIT and bytes(into) == _block(2)
    again.close()


def test_forgotten_and_expired_blocks_are_overwritten_and_stay_gone_after_a_restart(tmp_path):
    disk = _tier(tmp_path)
    now = time.time()
    for i in range(3):
        disk.put(i, None, _block(i))
    disk.put(10, None, _block(10), expires_at=now + 0.2)
    assert 10 in disk
    assert disk.forget([1, 99]) == 1 and 1 not in disk
    into = bytearray(BLOCK)
    assert disk.get(1, into) is Outcome.MISS
    time.sleep(0.25)
    assert 10 not in disk and disk.get(10, into) is Outcome.MISS  # past its expiry: never served
    disk.put(11, None, _block(11), expires_at=time.time() + 0.01)
    time.sleep(0.02)
    assert disk.expire() == 1 and disk.stats().expired == 2 and disk.stats().forgotten == 1
    disk.close()
    raw = b"".join(p.read_bytes() for p in tmp_path.glob("seg-*.pdkv"))
    for gone in (1, 10, 11):  # not a byte of what was forgotten or expired is left on disk
        assert _block(gone)[:256] not in raw
    assert _block(0)[:256] in raw
    again = _tier(tmp_path)
    assert sorted(i for i in range(12) if i in again) == [0, 2]
    assert again.forget() == 2 and not list(tmp_path.glob("seg-*.pdkv"))  # everything: the files go
    assert again.put(3, None, _block(3)) and 3 in again
    again.close()


_WRITER = """
import random, sys
from pathlib import Path
from pdflow.kv.disk import DiskTier
path, block, segment, start = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
disk = DiskTier(path, 1 << 40, block, segment_bytes=segment)
i = start
while True:  # until killed
    disk.put(i, i - 1 if i else None, random.Random(i).randbytes(block))
    i += 1
"""


def _served_exactly_or_refused(path: Path, block: int, segment: int) -> tuple[int, int]:
    """Open the tier as a restarted process would and read every block it lists: each one is
    either exactly what was written or refused (CORRUPTED, then MISS). (served, refused)."""
    disk = DiskTier(path, 1 << 40, block, segment_bytes=segment)
    served = refused = 0
    into = bytearray(block)
    for block_id in list(disk._index):
        outcome = disk.get(block_id, into)
        if outcome is Outcome.HIT:
            assert bytes(into) == random.Random(block_id).randbytes(block), f"block {block_id} served wrong bytes"
            served += 1
        else:
            assert outcome is Outcome.CORRUPTED and block_id not in disk
            refused += 1
    disk.close()
    return served, refused


def test_kill_9_mid_write_then_damage_on_disk_never_serves_a_wrong_byte(tmp_path):
    """A writer process SIGKILLed at random moments (its appends cut anywhere), then truncations
    and bit flips injected into the segment files: every block a restarted tier serves is exactly
    what was written; every damaged one is refused and counted."""
    import signal
    import sys

    block, segment = 1 << 20, 6 << 20
    rng = random.Random(7)
    start = 0
    for _ in range(3):
        child = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), str(block), str(segment), str(start)])
        try:
            deadline = time.monotonic() + 30
            while sum(p.stat().st_size for p in tmp_path.glob("seg-*.pdkv")) < (start + 4) * block:
                assert time.monotonic() < deadline and child.poll() is None
                time.sleep(0.01)
            time.sleep(rng.uniform(0, 0.05))
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait()
        served, refused = _served_exactly_or_refused(tmp_path, block, segment)
        assert served >= start + 4 and refused == 0  # a cut tail is cut at the scan, never indexed
        start = served + 10
    files = sorted(tmp_path.glob("seg-*.pdkv"))
    with open(files[0], "r+b") as f:  # bits flipped in two payloads of the first segment
        for offset in (HEADER_BYTES + 5, 2 * (HEADER_BYTES + block) + HEADER_BYTES + block // 2):
            f.seek(offset)
            byte = f.read(1)[0]
            f.seek(offset)
            f.write(bytes([byte ^ 0x40]))
    # a record cut short, in the newest segment that holds one (a kill can leave the newest empty)
    last = [f for f in files if f.stat().st_size >= HEADER_BYTES + block][-1]
    assert last != files[0]
    os.truncate(last, last.stat().st_size - block // 3)
    served, refused = _served_exactly_or_refused(tmp_path, block, segment)
    assert refused == 2 and served > 0


def test_runs_of_blocks_written_together_come_back_in_one_read_and_damage_still_stops_them(tmp_path):
    disk = _tier(tmp_path, capacity_segments=16)
    for i in range(10):  # segments of four: runs [0..3], [4..7], [8, 9]
        disk.put(i, i - 1 if i else None, _block(i))
    intos = [bytearray(BLOCK) for _ in range(10)]
    reads = []
    real = os.preadv
    try:
        os.preadv = lambda fd, buffers, offset: reads.append(len(buffers)) or real(fd, buffers, offset)
        assert disk.get_many(list(range(10)), intos) == [Outcome.HIT] * 10
    finally:
        os.preadv = real
    assert len(reads) == 3  # one read per segment's run
    assert all(bytes(into) == _block(i) for i, into in enumerate(intos))
    assert disk.get_many([0, 1, 2], intos[:3], versions=[0, 0, 5]) == [Outcome.HIT, Outcome.HIT,
                                                                       Outcome.VERSION_MISMATCH]
    disk.close()
    (first, *_) = sorted(tmp_path.glob("seg-*.pdkv"))
    with open(first, "r+b") as f:  # block 2's payload damaged
        f.seek(2 * (HEADER_BYTES + BLOCK) + HEADER_BYTES + 9)
        f.write(b"\x00\x01")
    disk = _tier(tmp_path, capacity_segments=16)
    assert disk.get_many(list(range(10)), intos) == [Outcome.HIT, Outcome.HIT, Outcome.CORRUPTED]
    assert 2 not in disk and disk.get_many([5, 6, 99], intos[:3]) == [Outcome.HIT, Outcome.HIT, Outcome.MISS]
    disk.close()


def test_any_write_error_turns_the_tier_off_instead_of_raising(tmp_path):
    import errno

    disk = _tier(tmp_path)
    assert disk.put(1, None, _block(1))
    real = os.pwritev

    def failing(*args):
        raise OSError(errno.EIO, "Input/output error")

    os.pwritev = failing
    try:
        assert not disk.put(2, 1, _block(2))  # no exception: the writer task (and its stage) go on
    finally:
        os.pwritev = real
    assert "Input/output error" in disk.stats().disabled and not disk.put(3, None, _block(3))
    into = bytearray(BLOCK)
    assert disk.get(1, into) is Outcome.HIT and bytes(into) == _block(1)
    disk.close()
