"""A process that keeps replacing folders by symbolic links to victims and back (the race of
tests/test_delete_race.py); imports nothing heavy, so it starts at once."""

from __future__ import annotations

import os
import random
import time


def swap(pairs: list[tuple[str, str]], want, seen) -> None:
    """While ``want`` is positive, put a link to each victim in place of its target and back, over
    and over at random short intervals; when it turns negative, put things back and echo it in ``seen``."""
    rng = random.Random(0)
    while True:
        w = want.value
        if w == 0:
            return
        if w < 0:
            seen.value = w
            time.sleep(0.001)
            continue
        for target, victim in pairs:
            aside = target + ".aside"
            try:
                os.rename(target, aside)
            except OSError:
                continue
            try:
                os.symlink(victim, target)
                time.sleep(rng.uniform(0, 0.0003))
                os.unlink(target)
            except OSError:
                pass
            try:
                os.rename(aside, target)
            except OSError:
                pass
            time.sleep(rng.uniform(0, 0.0003))
