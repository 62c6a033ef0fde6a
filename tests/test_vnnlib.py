"""Tests for the VNN-LIB 1.0 parser (shardbound.compiler.vnnlib).

Semantics are checked by evaluating the parsed C @ y <= d rows on concrete output vectors
rather than by comparing against one particular row layout, so the tests pin down meaning
(which outputs are violations) and only the documented normalisation c.y <= d.
"""

import re
from pathlib import Path

import numpy as np
import pytest

from conftest import SHARED
from shardbound.compiler.errors import ShardboundError
from shardbound.compiler.vnnlib import (Case, Conjunction, Property, parse_vnnlib,
                                        parse_vnnlib_text)

BENCH = Path(SHARED)        # ../shared/benchmarks next to the repository, or absent


def _bench_files(family):
    files = sorted((BENCH / family).glob("prop_*.vnnlib")) if BENCH.is_dir() else []
    if not files:
        return [pytest.param(None, marks=pytest.mark.skip(reason=f"no {BENCH}/{family}"))]
    return [pytest.param(f, id=f.name) for f in files]


def _bench(rel):
    path = BENCH / rel
    if not path.is_file():
        pytest.skip(f"{path} not available")
    return path


def _decls(n_in, n_out):
    return "".join(f"(declare-const X_{i} Real)\n" for i in range(n_in)) + \
        "".join(f"(declare-const Y_{j} Real)\n" for j in range(n_out))


def _unit_box(n_in):
    return "".join(f"(assert (>= X_{i} 0))\n(assert (<= X_{i} 1))\n" for i in range(n_in))


def _check_structure(prop, n_in, n_out):
    assert isinstance(prop, Property)
    assert (prop.num_inputs, prop.num_outputs) == (n_in, n_out)
    assert prop.cases
    for case in prop.cases:
        assert case.lower.dtype == np.float64 and case.lower.shape == (n_in,)
        assert case.upper.dtype == np.float64 and case.upper.shape == (n_in,)
        assert np.all(np.isfinite(case.lower)) and np.all(np.isfinite(case.upper))
        assert np.all(case.lower <= case.upper)
        assert case.disjuncts
        for conj in case.disjuncts:
            assert conj.C.dtype == np.float64 and conj.d.dtype == np.float64
            assert conj.C.ndim == 2 and conj.C.shape[1] == n_out
            assert conj.d.shape == (conj.C.shape[0],)


# ---- real benchmarks -----------------------------------------------------------------

@pytest.mark.parametrize("path", _bench_files("acasxu"))
def test_acasxu_files_parse(path):
    prop = parse_vnnlib(path)
    assert prop.path == str(path)
    _check_structure(prop, 5, 5)


@pytest.mark.parametrize("path", _bench_files("mnistfc"))
def test_mnistfc_files_parse_with_robustness_semantics(path):
    prop = parse_vnnlib(path)       # parse speed: bench/vnnlib_parse.py
    _check_structure(prop, 784, 10)
    label = int(re.search(r"label: (\d+)", path.read_text()).group(1))
    eps = float(re.search(r"_([0-9.]+)\.vnnlib$", path.name).group(1))
    (case,) = prop.cases
    assert np.all(case.lower >= 0.0) and np.all(case.upper <= 1.0)
    assert np.all(case.upper - case.lower <= 2 * eps + 1e-6)
    assert len(case.disjuncts) == 9
    # Correctly classified (label strictly largest): not a violation.
    y = np.zeros(10)
    y[label] = 1.0
    assert prop.holds_for_output(0, y)
    # Each other class j reaching the label's score is a violation, and exactly one
    # disjunct (the one saying Y_j >= Y_label) is responsible.
    for j in range(10):
        if j == label:
            continue
        y = np.zeros(10)
        y[label] = 1.0
        y[j] = 1.5
        assert prop.violates_output(0, y)
        assert sum(conj.is_satisfied(y) for conj in case.disjuncts) == 1
        y[j] = 1.0  # tie counts: strict/non-strict boundary is a violation
        assert prop.violates_output(0, y)
    rows = np.vstack([conj.C for conj in case.disjuncts])
    assert np.all(rows[:, label] == 1.0)  # Y_j >= Y_t  <=>  Y_t - Y_j <= 0
    assert np.all(rows.sum(axis=1) == 0.0)
    assert all(conj.d[0] == 0.0 for conj in case.disjuncts)


def test_acasxu_prop1_box_and_output_row():
    prop = parse_vnnlib(_bench("acasxu/prop_1.vnnlib"))
    (case,) = prop.cases
    np.testing.assert_array_equal(case.lower, [0.6, -0.5, -0.5, 0.45, -0.5])
    np.testing.assert_array_equal(case.upper, [0.679857769, 0.5, 0.5, 0.5, -0.45])
    (conj,) = case.disjuncts
    # Y_0 >= 3.99...  <=>  -Y_0 <= -3.99...
    np.testing.assert_array_equal(conj.C, [[-1.0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(conj.d, [-3.991125645861615])
    assert prop.violates_output(0, [4.0, 9, 9, 9, 9])
    assert prop.violates_output(0, [3.991125645861615, 0, 0, 0, 0])
    assert prop.holds_for_output(0, [3.99, 100, 100, 100, 100])
    x_in = (case.lower + case.upper) / 2
    assert prop.is_counterexample(x_in, [5.0, 0, 0, 0, 0])
    assert not prop.is_counterexample(case.upper + 1.0, [5.0, 0, 0, 0, 0])


def test_acasxu_prop2_conjunction_of_asserts():
    prop = parse_vnnlib(_bench("acasxu/prop_2.vnnlib"))
    (case,) = prop.cases
    (conj,) = case.disjuncts
    assert conj.C.shape == (4, 5)
    assert prop.violates_output(0, [5.0, 1, 2, 3, 4])  # COC maximal
    assert prop.holds_for_output(0, [3.0, 1, 2, 5, 4])


def test_acasxu_prop6_two_input_boxes():
    prop = parse_vnnlib(_bench("acasxu/prop_6.vnnlib"))
    assert len(prop.cases) == 2
    first, second = prop.cases
    assert first.lower[1] == pytest.approx(0.11140846)
    assert first.upper[1] == pytest.approx(0.499999896)
    assert second.lower[1] == pytest.approx(-0.499999896)
    assert second.upper[1] == pytest.approx(-0.11140846)
    np.testing.assert_array_equal(first.lower[[0, 2, 3, 4]], second.lower[[0, 2, 3, 4]])
    for index, case in enumerate(prop.cases):
        assert len(case.disjuncts) == 4
        assert prop.holds_for_output(index, [0.0, 1, 2, 3, 4])  # COC minimal
        assert prop.violates_output(index, [2.0, 1, 3, 4, 5])


def test_acasxu_prop7_conjunctions_in_disjunction():
    prop = parse_vnnlib(_bench("acasxu/prop_7.vnnlib"))
    (case,) = prop.cases
    assert [conj.C.shape[0] for conj in case.disjuncts] == [3, 3]
    assert prop.violates_output(0, [1.0, 1, 1, 0, 5])  # strong left minimal
    assert prop.violates_output(0, [1.0, 1, 1, 5, 0])  # strong right minimal
    assert prop.holds_for_output(0, [0.0, 1, 1, 5, 5])


# ---- hand-written properties -----------------------------------------------------------

def test_numbers_in_all_forms():
    text = _decls(8, 1) + """
    (assert (>= X_0 1e-3)) (assert (<= X_0 1E+2))
    (assert (>= X_1 -0.5)) (assert (<= X_1 +2))
    (assert (>= X_2 .5))   (assert (<= X_2 5.))
    (assert (>= X_3 -.25)) (assert (<= X_3 -1.5e-1))
    (assert (>= X_4 0))    (assert (<= X_4 007))
    (assert (>= X_5 (- 3))) (assert (<= X_5 (- 2.5e0)))
    (assert (>= X_6 -1e2)) (assert (<= X_6 +.5E1))
    (assert (>= X_7 1.)) (assert (<= X_7 12345678901234567890))
    (assert (<= Y_0 0))
    """
    (case,) = parse_vnnlib_text(text).cases
    np.testing.assert_array_equal(case.lower, [1e-3, -0.5, 0.5, -0.25, 0, -3, -100, 1.0])
    np.testing.assert_array_equal(case.upper, [100, 2, 5, -0.15, 7, -2.5, 5, 1.2345678901234567e19])


def test_variable_vs_variable_and_number_vs_variable():
    text = _decls(1, 3) + _unit_box(1) + """
    (assert (<= Y_0 Y_1))
    (assert (>= 2 Y_2))
    (assert (<= 1 Y_0))
    """
    prop = parse_vnnlib_text(text)
    (conj,) = prop.cases[0].disjuncts
    np.testing.assert_array_equal(conj.C, [[1, -1, 0], [0, 0, 1], [-1, 0, 0]])
    np.testing.assert_array_equal(conj.d, [0, 2, -1])
    assert conj.is_satisfied([1.5, 2.0, 2.0])
    assert not conj.is_satisfied([1.5, 1.0, 0.0])
    assert not conj.is_satisfied([0.5, 1.0, 0.0])


def test_linear_expressions():
    # Y_0 + 2*Y_1 - Y_2 + 1 <= 3 - Y_3 + Y_1*(-0.5)  <=>  Y_0 + 2.5 Y_1 - Y_2 + Y_3 <= 2
    text = _decls(1, 4) + _unit_box(1) + """
    (assert (<= (+ Y_0 (* 2 Y_1) (- Y_2) 1) (+ (- 3 Y_3) (* Y_1 -0.5))))
    (assert (>= (- Y_0 Y_1 Y_2) (* 2 (* 3 (+ Y_3 1)))))
    """
    (conj,) = parse_vnnlib_text(text).cases[0].disjuncts
    np.testing.assert_allclose(conj.C[0], [1, 2.5, -1, 1])
    assert conj.d[0] == pytest.approx(2)
    # Y_0 - Y_1 - Y_2 >= 6 Y_3 + 6  <=>  -Y_0 + Y_1 + Y_2 + 6 Y_3 <= -6
    np.testing.assert_allclose(conj.C[1], [-1, 1, 1, 6])
    assert conj.d[1] == pytest.approx(-6)


def test_input_bounds_from_scaled_and_negated_terms():
    text = _decls(2, 1) + """
    (assert (<= (* 2 X_0) 1)) (assert (>= (- X_0) -1))
    (assert (<= 0 X_0))
    (assert (>= (* -4 X_1) -2)) (assert (>= X_1 -3)) (assert (>= X_1 -1))
    (assert (<= Y_0 0))
    """
    (case,) = parse_vnnlib_text(text).cases
    np.testing.assert_array_equal(case.lower, [0, -1])  # tightest lower bound wins
    np.testing.assert_array_equal(case.upper, [0.5, 0.5])


def test_strict_inequalities_are_non_strict():
    text = _decls(1, 2) + "(assert (> X_0 -1)) (assert (< X_0 1)) (assert (< Y_0 Y_1))"
    prop = parse_vnnlib_text(text)
    case = prop.cases[0]
    np.testing.assert_array_equal([case.lower[0], case.upper[0]], [-1, 1])
    assert prop.violates_output(0, [1.0, 1.0])
    assert prop.holds_for_output(0, [1.0, 0.5])


def test_equality_and_chained_comparison():
    text = _decls(1, 3) + "(assert (<= -1 X_0 1)) (assert (= Y_0 2)) (assert (>= Y_1 Y_2 0))"
    prop = parse_vnnlib_text(text)
    case = prop.cases[0]
    assert (case.lower[0], case.upper[0]) == (-1, 1)
    assert prop.violates_output(0, [2.0, 1.0, 0.5])
    assert prop.holds_for_output(0, [2.1, 1.0, 0.5])
    assert prop.holds_for_output(0, [2.0, 1.0, -0.5])


def test_multiple_input_boxes_via_or_of_and():
    text = _decls(2, 2) + """
    (assert (or (and (>= X_0 0) (<= X_0 1) (>= X_1 0) (<= X_1 1))
                (and (>= X_0 2) (<= X_0 3) (>= X_1 2) (<= X_1 3))))
    (assert (or (and (<= Y_0 Y_1)) (and (<= Y_1 -5))))
    """
    prop = parse_vnnlib_text(text)
    assert len(prop.cases) == 2
    np.testing.assert_array_equal(prop.cases[1].lower, [2, 2])
    for case in prop.cases:
        assert len(case.disjuncts) == 2
    assert prop.is_counterexample([2.5, 2.5], [0.0, 1.0])
    assert prop.is_counterexample([0.5, 0.5], [9.0, -6.0])
    assert not prop.is_counterexample([1.5, 1.5], [0.0, 1.0])  # between the boxes
    assert not prop.is_counterexample([0.5, 0.5], [2.0, 1.0])


def test_mixed_input_output_terms_group_by_box():
    text = _decls(1, 2) + """
    (assert (or (and (>= X_0 0) (<= X_0 1) (<= Y_0 0))
                (and (>= X_0 2) (<= X_0 3) (>= Y_1 4))
                (and (<= X_0 1) (>= X_0 0) (<= Y_1 Y_0))))
    """
    prop = parse_vnnlib_text(text)
    assert [len(case.disjuncts) for case in prop.cases] == [2, 1]
    np.testing.assert_array_equal(prop.cases[0].lower, [0])
    np.testing.assert_array_equal(prop.cases[1].upper, [3])
    assert prop.violates_output(0, [1.0, 0.5])   # Y_1 <= Y_0
    assert prop.holds_for_output(0, [1.0, 5.0])
    assert prop.violates_output(1, [1.0, 5.0])   # Y_1 >= 4
    assert not prop.is_counterexample([2.5], [-1.0, 0.0])


def test_comments_nested_and_and_empty_box_dropped():
    text = """; header comment
    (declare-const X_0 Real) ; trailing comment
    (declare-const Y_0 Real)(declare-const Y_1 Real)
    (assert (and (and (>= X_0 ; comment inside an expression
                          0) (<= X_0 1))
                 (and (and (<= Y_0 1)) (and))))
    (assert (or (and (<= Y_1 0)) (and (>= X_0 5) (<= Y_1 10)) (and (<= Y_1 2) true)))
    (check-sat)
    ; final comment without newline"""
    prop = parse_vnnlib_text(text)
    (case,) = prop.cases  # X_0 >= 5 contradicts X_0 <= 1: that alternative is dropped
    assert len(case.disjuncts) == 2
    assert [conj.C.shape[0] for conj in case.disjuncts] == [2, 2]
    assert prop.violates_output(0, [1.0, 1.5])
    assert prop.holds_for_output(0, [1.5, 0.0])


def test_no_output_constraint_means_whole_box_violates():
    prop = parse_vnnlib_text(_decls(1, 1) + _unit_box(1))
    (conj,) = prop.cases[0].disjuncts
    assert conj.C.shape == (0, 1)
    assert prop.is_counterexample([0.5], [123.0])


def test_batched_is_satisfied_and_readonly_arrays():
    prop = parse_vnnlib_text(_decls(1, 2) + _unit_box(1) + "(assert (<= Y_0 Y_1))")
    conj = prop.cases[0].disjuncts[0]
    np.testing.assert_array_equal(conj.is_satisfied(np.array([[0, 1], [1, 0]])), [True, False])
    with pytest.raises(ValueError):
        conj.C[0, 0] = 5.0
    with pytest.raises(ValueError):
        prop.cases[0].lower[0] = 5.0
    assert isinstance(prop.cases[0], Case) and isinstance(conj, Conjunction)


def test_parse_vnnlib_reads_file(tmp_path):
    path = tmp_path / "ok.vnnlib"
    path.write_text(_decls(2, 1) + _unit_box(2) + "(assert (>= Y_0 1))\n")
    prop = parse_vnnlib(path)
    assert prop.path == str(path)
    assert prop.num_inputs == 2 and prop.num_outputs == 1


# ---- malformed inputs ------------------------------------------------------------------

HEAD = "(declare-const X_0 Real)\n(declare-const Y_0 Real)\n(declare-const Y_1 Real)\n"
BOX = "(assert (>= X_0 0))\n(assert (<= X_0 1))\n"  # lines 4-5 after HEAD

BAD_CASES = [
    ("extra_close", HEAD + BOX + "(assert (<= Y_0 1)))\n", 6, "')'"),
    ("unclosed", HEAD + BOX + "(assert (<= Y_0 1)\n(assert (<= Y_1 2))\n", 6, "'('"),
    ("unknown_op", HEAD + BOX + "\n(assert (not (<= Y_0 1)))\n", 7, "'not'"),
    ("unknown_term_op", HEAD + BOX + "(assert (<= (/ Y_0 2) 1))\n", 6, "'/'"),
    ("undeclared", HEAD + BOX + "(assert (<= Y_0 X_7))\n", 6, "X_7"),
    ("unknown_var", HEAD + BOX + "(assert (or\n  (and (<= Z_3 1))))\n", 7, "Z_3"),
    ("nonlinear", HEAD + BOX + "(assert (<= (* Y_0 Y_1) 1))\n", 6, "(* Y_0 Y_1)"),
    ("bad_number", HEAD + BOX + "(assert (<= Y_0 1.2.3))\n", 6, "1.2.3"),
    ("bad_number_exp", HEAD + "(assert (>= X_0 1e))\n", 4, "1e"),
    ("missing_upper", HEAD + "(assert (>= X_0 0))\n(assert (<= Y_0 1))\n", 1, "X_0"),
    ("index_gap", "(declare-const X_0 Real)\n(declare-const X_2 Real)\n"
     "(declare-const Y_0 Real)\n", 2, "X_1"),
    ("mixed_xy", HEAD + BOX + "(assert (<= X_0 Y_0))\n", 6, "(<= X_0 Y_0)"),
    ("two_inputs", "(declare-const X_0 Real)\n(declare-const X_1 Real)\n"
     "(declare-const Y_0 Real)\n(assert (<= (+ X_0 X_1) 1))\n", 4, "(<= (+ X_0 X_1) 1)"),
    ("duplicate_decl", HEAD + "(declare-const Y_0 Real)\n", 4, "Y_0"),
    ("int_sort", HEAD + "(declare-const Y_2 Int)\n", 4, "Int"),
    ("bad_decl_name", HEAD + "(declare-const out Real)\n", 4, "out"),
    ("unknown_command", HEAD + BOX + "(define-fun f () Real 1)\n", 6, "define-fun"),
    ("stray_atom", HEAD + "oops\n", 4, "oops"),
    ("arity", HEAD + BOX + "(assert (<= Y_0))\n", 6, "'<='"),
    ("no_outputs", "(declare-const X_0 Real)\n" + BOX, 1, "Y_0"),
    ("empty_box", HEAD + "(assert (>= X_0 2))\n(assert (<= X_0 1))\n", 5, "X_0"),
    ("always_false", HEAD + BOX + "(assert (<= Y_0 1))\n(assert (<= 2 1))\n", 1, "false"),
    ("empty_or", HEAD + BOX + "(assert (or))\n", 6, "(or)"),
]


@pytest.mark.parametrize("text,line,token", [pytest.param(t, l, k, id=i)
                                             for i, t, l, k in BAD_CASES])
def test_malformed_inputs_name_file_line_and_token(tmp_path, text, line, token):
    path = tmp_path / "bad.vnnlib"
    path.write_text(text)
    with pytest.raises(ShardboundError) as info:
        parse_vnnlib(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{path}:{line}: "), message
    assert token in message, message


def test_missing_bound_in_one_alternative_names_the_declaration_line():
    text = "(declare-const Y_0 Real)\n(declare-const X_1 Real)\n(declare-const X_0 Real)\n" \
        "(assert (or (and (>= X_0 0) (<= X_0 1) (>= X_1 0) (<= X_1 1))\n" \
        "            (and (>= X_0 0) (<= X_0 1) (>= X_1 0))))\n"
    with pytest.raises(ShardboundError,
                       match=r"^prop\.vnnlib:2: input X_1 has no upper bound in alternative 2"):
        parse_vnnlib_text(text, "prop.vnnlib")


def test_unreadable_file_is_a_user_error(tmp_path):
    with pytest.raises(ShardboundError, match="missing.vnnlib"):
        parse_vnnlib(tmp_path / "missing.vnnlib")
