"""Skeletons match exactly the buffers that differ from theirs only inside the payloads.

:class:`pytreeio.skeleton.Skeleton` keeps a skeleton gathered (offsets and
bytes) or masked (a mask over the whole buffer); both forms must accept and
refuse the same buffers, whatever the payloads' lengths and places.
"""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

from pytreeio import skeleton
from pytreeio.skeleton import MAX_SKELETON, Skeleton


@st.composite
def _buffers(draw: st.DrawFn) -> tuple[np.ndarray, list[int], list[int]]:
    n = draw(st.integers(1, 300))
    cuts = sorted(draw(st.lists(st.integers(0, n), max_size=12)))
    cuts = cuts[: len(cuts) // 2 * 2]
    seed = draw(st.integers(0, 2**32 - 1))
    data = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    return data, cuts[0::2], cuts[1::2]


@pytest.mark.parametrize("form", ["gathered", "masked"])
@settings(max_examples=150, deadline=None)
@given(case=_buffers(), flip=st.integers(0, 2**16))
def test_a_skeleton_matches_payload_changes_and_refuses_skeleton_changes(
    form: str, case: tuple[np.ndarray, list[int], list[int]], flip: int
) -> None:
    data, starts, stops = case
    share = 0 if form == "gathered" else 10**9  # which form `of` picks
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(skeleton, "_MASKED_MIN_SHARE", share)
        sk = Skeleton.of(data.tobytes(), starts, stops)
    assert sk is not None
    inside = np.zeros(data.size, bool)
    for a, b in zip(starts, stops):
        inside[a:b] = True
    outside = np.flatnonzero(~inside)
    if form == "masked" and outside.size:
        assert sk._mask is not None
    np.testing.assert_array_equal(sk.positions, outside)
    assert sk.matches(data)
    assert not sk.matches(data[:-1])
    assert not sk.matches(np.concatenate([data, data[:1]]))
    changed = data.copy()
    changed[inside] ^= np.uint8(flip & 0xFF or 1)
    assert sk.matches(changed)
    if outside.size:
        bad = data.copy()
        bad[outside[flip % outside.size]] ^= np.uint8(1 << (flip % 8))
        assert not sk.matches(bad)


def test_the_form_follows_the_skeletons_share_of_the_buffer() -> None:
    data = np.arange(4096, dtype=np.uint32).view(np.uint8)
    mostly_framing = Skeleton.of(data, [100], [200])  # 100 payload bytes of 16384
    mostly_payload = Skeleton.of(data, [100], [16000])
    assert mostly_framing is not None and mostly_framing._mask is not None
    assert mostly_payload is not None and mostly_payload._mask is None


def test_payloads_out_of_order_or_a_skeleton_too_large_are_not_kept() -> None:
    data = np.zeros(MAX_SKELETON + 10, np.uint8)
    assert Skeleton.of(data, [5, 3], [6, 4]) is None
    assert Skeleton.of(data, [5], [4]) is None
    assert Skeleton.of(data, [0], [len(data) + 1]) is None
    assert Skeleton.of(data, [0], [5]) is None  # MAX_SKELETON + 5 skeleton bytes
