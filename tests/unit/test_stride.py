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
