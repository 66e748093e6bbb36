"""The waiting lines' rule (quotawrap/ledger/lines.py), the parts the Lua mirror test does not cover."""

from __future__ import annotations

import itertools

from quotawrap.ledger import lines


def test_decide_reads_the_room_only_where_reads_room_says() -> None:
    """A reserve skips never_fits and crowded when reads_room is False: decide's answer must then be the same
    whatever they would have been, on every input; and where it is True they do change some answer."""
    crowds: list[tuple[lines.LineName, ...]] = [(), ("run",), ("model_day",), ("run", "model_day")]
    changed = 0
    for ahead_run, ahead_md, allowed, can_wait, enforce in itertools.product(
        (0, 2), (0, 1), (False, True), (False, True), (False, True)
    ):
        aheads: dict[lines.LineName, int] = {"run": ahead_run, "model_day": ahead_md}
        answers = {
            lines.decide(aheads, allowed=allowed, never=never, crowd=crowd, can_wait=can_wait, enforce=enforce)
            for never in (False, True)
            for crowd in crowds
        }
        if lines.reads_room(aheads, allowed=allowed, can_wait=can_wait, enforce=enforce):
            changed += len(answers) > 1
        else:
            assert len(answers) == 1, (aheads, allowed, can_wait, enforce)
    assert changed == 1  # the head of its lines, not allowed, may wait
