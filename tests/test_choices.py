"""The one home of the CLI's choices and bounds (geomscope/choices.py): the library's registries and
the seed's bound are those it names."""

from __future__ import annotations


def test_the_seed_bound_has_one_definition():
    from geomscope import choices
    from geomscope.options import SEED
    from geomscope.score.options import MAX_SEED

    assert MAX_SEED is choices.MAX_SEED == 2**64 - 1
    assert SEED.reason(2**64 - 1) is None and SEED.reason(0) is None and SEED.reason(2**64) is not None


def test_choices_match_the_library_registries():
    from geomscope import choices
    from geomscope.metrics.outliers import OUTLIER_RULES
    from geomscope.plot.figures import KINDS

    assert tuple(OUTLIER_RULES) == choices.OUTLIER_RULES
    assert set(choices.PLOT_KINDS) == {"auto", *KINDS}
