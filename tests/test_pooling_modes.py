"""MaxPool and Pad in every mode (issue 12): fsdp at P = 2 and tp with a conv zone that holds
a MaxPool (or a Pad) give bitwise single mode's bounds under `blocked`, for IBP, CROWN,
alpha-CROWN (the MaxPool weights are optimised per spec row, split over ranks) and CROWN
with a prior (CROWN only on the neurons of inexact windows)."""

from __future__ import annotations

import pytest

from multirank import assert_pairs_bitwise, compile_pairs, run_pairs, zoo_cases

METHODS = ["ibp", "crown", "alpha-crown", "crown-prior"]
MODELS = {"fsdp": (("maxpool_cnn", "pad_avgpool_cnn"), {}),
          "tp": (("tp_maxpool_cnn", "tp_pad_cnn"), {"tp_intermediate": "crown"})}


@pytest.fixture(scope="module")
def pooling(tmp_path_factory):
    """Each mode's models compiled single and in that mode; the single programs run in
    process, the fsdp and tp ones in one job of 2 ranks."""
    tmp = tmp_path_factory.mktemp("pooling_modes")
    pairs = {}
    for mode, (models, options) in MODELS.items():
        (tmp / mode).mkdir()
        pairs[mode] = compile_pairs(tmp / mode, zoo_cases(tmp / mode, models, seed=11,
                                                          radius=0.2), mode, **options)
    single, runs = run_pairs(tmp, pairs["fsdp"] + pairs["tp"], METHODS, (2,))
    return pairs, single, runs


@pytest.mark.multirank
@pytest.mark.parametrize("mode", list(MODELS))
def test_bitwise_single_mode_at_p2(pooling, mode):
    pairs, single, runs = pooling
    assert_pairs_bitwise(pairs[mode], single, runs, METHODS, label=(mode,))
