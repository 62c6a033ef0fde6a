"""MaxPool and Pad in every mode (issue 12): fsdp at P = 2 and tp with a conv zone that holds
a MaxPool (or a Pad) give bitwise single mode's bounds under `blocked`, for IBP, CROWN,
alpha-CROWN (the MaxPool weights are optimised per spec row, split over ranks) and CROWN
with a prior (CROWN only on the neurons of inexact windows)."""

from __future__ import annotations

import pytest

from multirank import compile_pairs, run_job, zoo_cases

METHODS = ["ibp", "crown", "alpha-crown", "crown-prior"]


def _assert_bitwise(pairs, single, got, label):
    for name, s, other in pairs:
        for m in METHODS:
            assert got[(other["dir"], m)]["sha"] == single[(s["dir"], m)]["sha"], (label, name, m)


@pytest.mark.multirank
@pytest.mark.parametrize("mode,models,options", [
    ("fsdp", ("maxpool_cnn", "pad_avgpool_cnn"), {}),
    ("tp", ("tp_maxpool_cnn", "tp_pad_cnn"), {"tp_intermediate": "crown"}),
])
def test_bitwise_single_mode_at_p2(tmp_path, mode, models, options):
    pairs = compile_pairs(tmp_path, zoo_cases(tmp_path, models, seed=11, radius=0.2), mode,
                          **options)
    single = run_job(tmp_path, [s for _, s, _ in pairs], METHODS, 1, tag="single")
    got = run_job(tmp_path, [o for _, _, o in pairs], METHODS, 2, tag=mode)
    _assert_bitwise(pairs, single, got, mode)
