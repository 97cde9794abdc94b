"""``shardwise plan`` prices every plan it prints by the step schedule, and ``shardwise estimate``
of each plan it saves, with the same options, gives the same step time (issue 15's acceptance:
within 1%; they share one code path, so the test holds them to 1e-6). Run as a user runs them:
subprocesses, stdout parsed with json.loads."""

from __future__ import annotations

import pytest

from tests.helpers import cli, cli_all, json_object

TINY = ["--model", "llama-tiny", "--layers", "2", "--batch", "8", "--seq", "64", "--mesh", "2x2",
        "--mesh-names", "dp,tp"]
# The agreement issue 15 asks for; the two commands share the schedule, so far tighter holds.
AGREEMENT = 1e-6


def test_estimate_of_every_saved_plan_gives_the_step_plan_printed(tmp_path):
    # every step option (each changes the schedule), async TP only where a plan is tensor-parallel
    options = ["--ac", "selective", "--compile", "--async-tp"]
    out = json_object(cli("plan", *TINY, *options, "--time-limit", "60", "--save-all", str(tmp_path),
                          "--json"))
    plans = {name: row for name, row in out["plans"].items() if row is not None}
    assert {"auto", "ddp", "fsdp", "fsdp_tp", "fsdp_tp_sp"} <= set(plans)
    assert out["step_s"] == plans["auto"]["step_s"] and out["chosen_from"] in ("ilp", *plans)
    for row in plans.values():
        assert set(row) >= {"step_s", "objective_s", "exposed_comm_s", "comm_s", "memory_per_device_bytes"}
        assert 0.0 <= row["exposed_comm_s"] <= row["comm_s"] + 1e-15
    saved = [name for name in plans if name != "ilp"]  # the ILP's solution a hand plan beat: not saved
    # async TP where the plan is tensor-parallel: estimate refuses it elsewhere
    runs = cli_all([["estimate", *TINY, *[o for o in options if o != "--async-tp" or plans[name]["async_tp"]],
                     "--plan", str(tmp_path / f"{name}.json"), "--json"] for name in saved])
    for name, proc in zip(saved, runs, strict=True):
        est, row = json_object(proc), plans[name]
        assert est["step_s"] == pytest.approx(row["step_s"], rel=AGREEMENT), name
        exposed = est["breakdown"]["exposed_comm_s"]
        assert exposed == pytest.approx(row["exposed_comm_s"], rel=AGREEMENT, abs=1e-12)
    for name, step in out["baselines"].items():
        if step is not None:
            assert plans["auto"]["step_s"] <= step * (1 + 1e-9), name
    assert any(row["async_tp"] for row in plans.values()) == ("--async-tp" in options)
