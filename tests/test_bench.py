"""bench.py's arithmetic on the CPU (its runs need a GPU): a side's medians and spread over its processes,
and the ratio line's word when the sides' spreads overlap."""

import pytest

import bench


def process(*steps):
    return {"steps": [dict(generate=g, train=t, push=0.2) for g, t in steps], "peak_gib": [70.0],
            "mismatched_tokens": [0] * len(steps), "checkpoint_s": 20.0, "sampled_tokens": 131072, "device": "H100"}


def test_a_side_has_its_medians_and_the_spread_of_its_processes():
    side = bench.combine([process((6.0, 4.0), (6.4, 4.2)), process((7.0, 4.4), (7.2, 4.6))])
    assert (side["generate"], side["train"]) == pytest.approx((6.7, 4.3))  # over all four steps
    assert side["spread"]["generate"] == pytest.approx((6.2, 7.1))
    assert side["spread"]["step"] == pytest.approx((6.2 + 4.1 + 0.2, 7.1 + 4.5 + 0.2))


def test_the_ratio_line_says_where_the_sides_spreads_overlap():
    exact = bench.combine([process((6.0, 4.0)), process((6.6, 4.1))])
    standard = bench.combine([process((6.4, 7.0)), process((7.0, 7.2))])
    assert bench.overlap_note(exact, standard) == " (the sides' spreads overlap: generate, push)"
    apart = bench.combine([process((9.0, 7.0)), process((9.5, 7.2))])
    assert bench.overlap_note(exact, apart) == " (the sides' spreads overlap: push)"


def test_a_save_is_costed_against_the_steps_that_neither_save_nor_run_beneath_a_write():
    """A saving step costs its phases and what its save held training, over the process's median timed step
    (10.5 s here); the report's last line is the slowest saving step, the process's first save included."""
    run = process((6.0, 4.0), (6.4, 4.2)) | {"pinning": 12.0, "saves": {
        "saving": [{"step": 10.6, "held": 1.5}, {"step": 10.8, "held": 2.0}], "beneath": [11.0, 10.5],
        "writes": [9.0, 9.5], "end_wait": 4.0}}
    cost = bench.save_costs(run)
    assert cost["saving"] == pytest.approx([1.6, 2.3]) and cost["beneath"] == pytest.approx([0.5, 0.0])
    assert bench.combine([run, process((6.0, 4.0))])["saves"] == [cost]  # the standard side saves nothing
    lines = bench.save_lines([cost], 2).splitlines()
    assert "a step that saves +1.60, +2.30 s" in lines[0] and "writes of 9.0, 9.5 s" in lines[0]
    assert lines[-1] == "  the slowest step that saves: +2.30 s over one that does not"
