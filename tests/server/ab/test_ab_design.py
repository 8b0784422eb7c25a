"""An experiment's design as a record (``ab/design.py``): arms, allocations, phases and the
assignment every replica computes alike, consistent across a ramp; bad input named by field."""

from __future__ import annotations

import hashlib

import pytest

from steerserve.server.ab.design import (
    BUCKETS,
    Arm,
    Design,
    DesignError,
    Phase,
    check_allocation,
    counts,
    layouts,
    parse_allocation,
    parse_arm,
    two_arms,
)
from steerserve.server.ab.experiment import Experiment

USERS = [f"user-{i}" for i in range(4000)]


def three(name: str = "ramp") -> Design:
    return Design(
        name, (parse_arm("control=off"), parse_arm("v1=on"), parse_arm("v2=auto")), "control"
    )


def phases(design: Design, *allocations: dict[str, float]) -> list[Phase]:
    return [Phase(i + 1, design, a, float(i), None, "test") for i, a in enumerate(allocations)]


def test_arms_parse_each_form_and_name_the_flag() -> None:
    assert parse_arm("c=off") == Arm("c", False)
    assert parse_arm("v=on").spec == "on" and parse_arm("v=auto").spec == "auto"
    assert parse_arm("v=preset:steering-on") == Arm("v", None, "steering-on")
    got = parse_arm('v={"interventions": {"recall": 1.5}}')
    assert got.steering == {"interventions": {"recall": 1.5}}
    assert Arm.of(got.record()) == got  # a record reads back as the arm it was
    for text, why in (
        ("novalue", "expected NAME=SPEC"),
        ("V1=on", "arm name"),  # the preset name rule: lowercase
        ("v={not json", "not JSON"),
        ("pair=on", "reserved"),
        ("v=preset:Bad Name", "preset name"),
    ):
        with pytest.raises(DesignError, match=why) as e:
            parse_arm(text)
        assert e.value.param == "--ab-arm"


def test_a_design_needs_two_arms_unique_names_and_a_control_among_them() -> None:
    c, v = parse_arm("c=off"), parse_arm("v=on")
    for arms, control, flag in (
        ((c,), "c", "--ab-arm"),
        ((c, c), "c", "--ab-arm"),
        ((c, v), "x", "--ab-control"),
    ):
        with pytest.raises(DesignError) as e:
            Design("e", arms, control)
        assert e.value.param == flag
    with pytest.raises(DesignError, match="--ab-name"):
        Design("", (c, v), "c")


@pytest.mark.parametrize(
    ("given", "why"),
    [
        ({"control": 0.5, "v1": 0.2, "v2": 0.2}, "sum to 0.9, not 1"),
        ({"control": 1.2, "v1": -0.1, "v2": -0.1}, "above 1"),
        ({"control": 0.8, "v1": 0.3, "v2": -0.1}, "v2's share -0.1 is below 0"),
        ({"control": 0.5, "nope": 0.5}, "'nope' is not an arm"),
        ({"control": "half", "v1": 0.5}, "must be a number"),
        ({"control": float("nan"), "v1": 1.0}, "must be a number"),
        ({"control": True, "v1": 0.0}, "must be a number"),
    ],
)
def test_bad_allocations_are_refused_naming_the_field(given: dict, why: str) -> None:
    with pytest.raises(DesignError, match=why) as e:
        check_allocation(given, three(), "allocation")
    assert e.value.param == "allocation"


def test_allocations_from_flags_default_to_equal_shares_and_round_to_buckets() -> None:
    d = three()
    assert parse_allocation([], d) == pytest.approx({"control": 1 / 3, "v1": 1 / 3, "v2": 1 / 3})
    assert parse_allocation(["control=0.8,v1=0.1", "v2=0.1"], d)["v2"] == 0.1
    with pytest.raises(DesignError, match="expected NAME=SHARE"):
        parse_allocation(["control"], d)
    thirds = counts(parse_allocation([], d), d.names)
    assert sum(thirds.values()) == BUCKETS and sorted(thirds.values()) == [3333, 3333, 3334]


def test_two_arms_steer_exactly_the_subjects_the_split_steered_before_phases() -> None:
    """Phase 1 of the two-arm shorthand: the subjects whose hash is below the split, as the
    experiment before phases assigned them (so an experiment keeps its subjects)."""
    for split in (0.1, 0.25, 0.5, 0.9):
        exp = Experiment("exp-1", split)
        for u in USERS[:1000]:
            digest = hashlib.sha256(f"exp-1\x00{u}".encode()).hexdigest()
            old = "steered" if int(digest[:15], 16) / 16**15 < split else "unsteered"
            assert exp.assign(u).arm == old
    with pytest.raises(DesignError, match="--ab-split"):
        two_arms("x", 1.5)


def test_a_ramp_moves_subjects_only_from_the_control_into_the_treatment_that_grows() -> None:
    """Three arms ramped 0.2 -> 0.5 (0.1/0.1 -> 0.25/0.25): nobody leaves a treatment, and
    the shares hold within binomial bounds in both phases; the layout is the same from the
    same records whoever computes it."""
    d = three()
    ph = phases(d, {"control": 0.8, "v1": 0.1, "v2": 0.1},
                {"control": 0.5, "v1": 0.25, "v2": 0.25})  # fmt: skip
    before = Experiment(design=d, phases=ph[:1])
    after = Experiment(design=d, phases=ph)
    moves: dict[tuple[str, str], int] = {}
    shares = {"control": 0, "v1": 0, "v2": 0}
    for u in USERS:
        a, b = before.assign(u), after.assign(u)
        assert b.phase == 2 and a.phase == 1
        shares[b.arm] += 1
        if a.arm != b.arm:
            moves[a.arm, b.arm] = moves.get((a.arm, b.arm), 0) + 1
    assert set(moves) == {("control", "v1"), ("control", "v2")}
    for arm, want in (("control", 0.5), ("v1", 0.25), ("v2", 0.25)):
        sd = (len(USERS) * want * (1 - want)) ** 0.5
        assert abs(shares[arm] - len(USERS) * want) < 4 * sd, shares
    again = Experiment(design=d, phases=list(ph))  # another replica, the same records
    assert all(again.assign(u).arm == after.assign(u).arm for u in USERS[:500])


def test_a_shrink_returns_subjects_to_the_control_only_and_a_grab_is_refused() -> None:
    d = three()
    start = {"control": 0.5, "v1": 0.25, "v2": 0.25}
    shrunk = phases(d, start, {"control": 0.7, "v1": 0.05, "v2": 0.25})
    a, b = (Experiment(design=d, phases=shrunk[:1]), Experiment(design=d, phases=shrunk))
    moved = {(a.assign(u).arm, b.assign(u).arm) for u in USERS} - {(x, x) for x in d.names}
    assert moved == {("v1", "control")}
    # v1 giving up 0.2 while v2 takes 0.4: v2 would need more than the control's 0.1
    grab = phases(d, {"control": 0.1, "v1": 0.5, "v2": 0.4}, {"control": 0.1, "v1": 0.1, "v2": 0.8})
    with pytest.raises(DesignError, match="grows only into the control's share") as e:
        layouts(grab)
    assert e.value.param == "allocation"


def test_a_new_arm_takes_from_the_control_and_a_removed_one_gives_back() -> None:
    two = Design("e", (parse_arm("control=off"), parse_arm("v1=on")), "control")
    d = three("e")
    ph = [
        Phase(1, two, {"control": 0.6, "v1": 0.4}, 0.0),
        Phase(2, d, {"control": 0.3, "v1": 0.4, "v2": 0.3}, 1.0),
    ]
    (n1, l1), (n2, l2) = layouts(ph)
    moved = {(n1[l1[b]], n2[l2[b]]) for b in range(BUCKETS)} - {(x, x) for x in d.names}
    assert moved == {("control", "v2")}
    gone = [Phase(3, two, {"control": 0.6, "v1": 0.4}, 2.0)]  # v2 removed: its subjects back
    (_, _), (n2, l2), (n3, l3) = layouts([*ph, *gone])
    moved = {(n2[l2[b]], n3[l3[b]]) for b in range(BUCKETS)} - {(x, x) for x in d.names}
    assert moved == {("v2", "control")}


def test_renaming_the_experiment_reshuffles() -> None:
    a, b = Experiment("exp-1", 0.5), Experiment("exp-2", 0.5)
    same = sum(a.assign(u).arm == b.assign(u).arm for u in USERS) / len(USERS)
    assert 0.45 < same < 0.55
