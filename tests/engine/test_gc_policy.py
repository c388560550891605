"""``tune_for_serving``: what start-up made is frozen, and the young generation's threshold is
raised; the older generations' ratios are left alone."""

from __future__ import annotations

import gc

from asyncengine.engine.gc_policy import YOUNG_THRESHOLD, tune_for_serving


def test_tune_for_serving_freezes_the_heap_and_spaces_collections():
    before = gc.get_threshold()
    try:
        tune_for_serving()
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == (YOUNG_THRESHOLD, *before[1:])
        assert gc.isenabled()
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
