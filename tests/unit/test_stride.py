"""Which saves a node sends (agents/stride.py): multiples of a stride, a power of two that
widens while a rank would skip one and narrows once sends keep up again."""

from __future__ import annotations

from agents.stride import FAST_PASSES, MAX_STRIDE, Stride, Strides


def test_the_newest_goes_until_one_would_be_skipped_then_only_multiples_of_the_stride():
    s = Stride()
    assert s.pick({0: [1, 2, 3], 1: [3]}, {}) == {0: 3, 1: 3}  # nothing sent yet: no skip
    assert s.pick({0: [3, 4]}, {0: 3}) == {0: 4} and s.stride == 1
    assert s.pick({0: [4, 5, 6]}, {0: 4}) == {0: 6} and s.stride == 2  # 5 would be skipped
    assert s.pick({0: [6, 7]}, {0: 6}) == {0: 6}  # 7 is no multiple: nothing new to send
    # 8 and 12 are multiples of 4 newer than 6: one would be skipped again, so 8
    assert s.pick({0: [6, 7, 8, 9, 10, 11, 12, 13]}, {0: 6}) == {0: 8} and s.stride == 8


def test_a_planned_moves_step_goes_whatever_the_stride():
    s = Stride()
    s.stride = 8
    assert s.pick({0: [13], 1: []}, {0: 12}, aligned=False) == {0: 13, 1: -1}
    assert s.stride == 8


def test_a_stride_narrows_after_passes_that_kept_up_and_not_after_one():
    s = Stride()
    s.stride = 4
    s.passed(8, 9)  # the pass ended before step 10 was saved: one pass kept up
    assert s.stride == 4
    s.passed(12, 14)  # step 14 saved already: it did not
    s.passed(16, 17)
    assert s.stride == 4
    for _ in range(FAST_PASSES - 1):
        s.passed(20, 21)
    assert s.stride == 2
    for _ in range(FAST_PASSES):
        s.passed(22, 22)
    assert s.stride == 1
    s.passed(23, 23)
    assert s.stride == 1  # never below one


def test_strides_of_two_nodes_share_every_multiple_of_the_wider():
    """Any two nodes' strides: every step the wider one sends, the narrower one sends too."""
    narrow, wide = Stride(), Stride()
    narrow.stride, wide.stride = 2, 8
    sent_narrow = {narrow.pick({0: list(range(s - 1, s + 1))}, {})[0] for s in range(2, 64, 2)}
    sent_wide = {wide.pick({0: list(range(s - 7, s + 1))}, {})[0] for s in range(8, 64, 8)}
    assert sent_wide <= sent_narrow


def test_the_stride_stays_bounded():
    s = Stride()
    s.pick({0: list(range(100_000))}, {0: -1})
    assert s.stride == MAX_STRIDE


def test_a_buddy_after_the_spare_goes_at_half_its_rate_and_a_refusing_target_widens_nothing():
    spare, buddy = ("10.0.0.3", 1), ("10.0.0.2", 1)
    s = Strides()
    s.targets([spare, buddy])
    assert s.pick(spare, {0: [4, 5, 6]}, {0: 4}, True) == {0: 6} and s.stride(spare) == 2
    assert s.pick(buddy, {0: [4, 5, 6, 7, 8]}, {0: 4}, True) == {0: 8}  # a multiple of 4
    assert s.stride(buddy) == 1  # its own: the spare's rate bounds it, not its sends
    s.refused(buddy)
    assert s.pick(buddy, {0: list(range(4, 40))}, {0: 4}, True) == {0: 36}
    assert s.stride(buddy) == 1  # behind only as it refused: nothing skipped by us
    s.went(buddy, 36)
    alone = Strides()
    alone.targets([buddy])  # no spare: the buddy is the first
    assert alone.pick(buddy, {0: [4, 5]}, {0: 4}, True) == {0: 5}


def test_a_spare_whose_sends_keep_up_narrows_though_its_buddys_after_them_do_not():
    """Kept up or not is counted per target as its sends end: a spare's copies that arrive
    before the next save narrow its stride, whatever its buddy's after them take."""
    spare, buddy = ("10.0.0.3", 1), ("10.0.0.2", 1)
    s = Strides()
    s.targets([spare, buddy])
    s.pick(spare, {0: [4, 5, 6]}, {0: 4}, True)
    assert s.stride(spare) == 2
    for step in range(8, 8 + 4 * FAST_PASSES, 4):  # each pass: the spare, then the buddy
        assert s.pick(spare, {0: [step - 1, step]}, {0: step - 2}, True) == {0: step}
        s.went(spare, step)
        s.ended(spare, step)  # the spare's copy was there before step + 1 was saved
        assert s.pick(buddy, {0: [step - 1, step]}, {0: step - 4}, True) == {0: step}
        s.went(buddy, step)
        s.ended(buddy, step + 1)  # the buddy's took the pass past the next save
    assert s.stride(spare) == 1
    # A spare whose sends end after the next save stays as it is.
    slow = Strides()
    slow.targets([spare, buddy])
    slow.pick(spare, {0: [4, 5, 6]}, {0: 4}, True)
    for step in range(8, 8 + 4 * FAST_PASSES, 4):
        slow.pick(spare, {0: [step - 1, step]}, {0: step - 2}, True)
        slow.went(spare, step)
        slow.ended(spare, step + 1)
    assert slow.stride(spare) == 2


def _sends_to_the_spare(pass_saves: int, first: int, last: int, window: int = 2) -> list[int]:
    """The steps one node sends the spare: its ranks save every step and hold the last
    ``window``; a pass that sends takes ``pass_saves`` saves, one with nothing to send waits
    for the next save; its first pass begins at save ``first``."""
    spare = ("10.0.0.9", 1)
    strides = Strides()
    strides.targets([spare])
    went: list[int] = []
    begins = first
    for step in range(last + 1):
        strides.saved(0, step, 0)
        if step < begins:
            continue
        held = list(range(max(0, step - window + 1), step + 1))
        picked = strides.pick(spare, {0: held}, {0: went[-1]} if went else {}, True)[0]
        if picked > (went[-1] if went else -1):
            strides.went(spare, picked)
            went.append(picked)
            begins = step + pass_saves
            strides.ended(spare, begins)
        else:
            begins = step + 1
    return went


def test_two_nodes_whose_sends_outlast_the_saves_they_hold_still_send_common_steps():
    """A send that takes longer than a rank holds its saves: what it skipped is counted from
    every save that came, not from those still held, so both nodes widen to the same
    multiples (before, each saw one unsent multiple among the two it held, kept a stride of
    2 and sent other steps than the other: 4, 10, 16, ... and 6, 12, 18, ...: the newest
    step both had on the spare was 0)."""
    one, other = _sends_to_the_spare(6, 0, 200), _sends_to_the_spare(6, 2, 200)
    assert one[-1] >= 200 - 16 and other[-1] >= 200 - 16  # each kept sending
    assert max(set(one) & set(other)) >= 200 - 24, (one[-6:], other[-6:])
