"""The one home of the CLI's choices and bounds (geomscope/choices.py): the library's registries and
the seed's bound are those it names."""

from __future__ import annotations


def test_the_seed_bound_has_one_definition():
    from geomscope import choices
    from geomscope.options import SEED
    from geomscope.score.options import MAX_SEED

    assert MAX_SEED is choices.MAX_SEED == 2**64 - 1
    assert SEED.reason(2**64 - 1) is None and SEED.reason(0) is None and SEED.reason(2**64) is not None
