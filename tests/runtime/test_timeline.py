"""The manager's timeline keeps the last ``maxlen`` operators in flat arrays and yields them as tuples."""

from __future__ import annotations

from array import array

from dynn_runtime.runtime.controls import OpTimeline


def test_the_timeline_keeps_the_last_maxlen_entries_in_order():
    tl = OpTimeline(8)
    expected = []
    for j in range(5):
        tl.append((0, j, 100 + j, "forward"))
        expected.append((0, j, 100 + j, "forward"))
    words = array("q")
    for j in range(5, 40):  # the observer's triples: position, used, phase code (0 forward, 1 backward, 2 optimizer)
        words.extend((j, 200 + j, j % 3))
        expected.append((1, j, 200 + j, ("forward", "backward", "optimizer")[j % 3]))
    tl.extend_words(1, memoryview(words))
    tl.append((2, 40, 7, "optimizer"))
    expected.append((2, 40, 7, "optimizer"))
    assert len(tl) == 8
    assert list(tl) == expected[-8:]
    for j in range(41, 100):  # trimmed as it grows, never below maxlen
        tl.append((3, j, j, "backward"))
        expected.append((3, j, j, "backward"))
        assert list(tl) == expected[-8:]


def test_words_keep_every_bit_of_large_byte_counts_and_each_phase():
    """The observer's words are copied as bytes: a count past 32 bits and each phase code survive."""
    tl = OpTimeline(16)
    big = (1 << 40) + 12345
    words = array("q", [7, big, 0, 8, big + 1, 1, 9, (1 << 62) - 1, 2])
    tl.extend_words(5, memoryview(words).cast("B").cast("q"))  # a cast view, as the observer's bytes give
    assert list(tl) == [(5, 7, big, "forward"), (5, 8, big + 1, "backward"), (5, 9, (1 << 62) - 1, "optimizer")]
