"""The ZeRO paper's Table 1 (Rajbhandari et al., SC'20), every cell, from the estimator's
formulas: the ZeRO-1/2/3 rows of the table and zero_offload.estimate.paper."""

from __future__ import annotations

from decimal import Decimal

import pytest

from zero_offload.estimate import ModelShape, estimate
from zero_offload.estimate.paper import (
    TABLE1_DEGREES,
    TABLE1_MODELS,
    TABLE1_PRINTED,
    paper_rounding,
    table1,
    table1_gb,
)

STAGES = (1, 2, 3)
FORMULAS = {  # GB per device, Psi in parameters, N the DP degree, K = 12
    1: lambda psi, n: (4 * psi + 12 * psi / n) / 1e9,  # P_os
    2: lambda psi, n: (2 * psi + 14 * psi / n) / 1e9,  # P_os+g
    3: lambda psi, n: (16 * psi / n) / 1e9,  # P_os+g+p
}


def test_the_printed_table_has_every_cell() -> None:
    assert set(TABLE1_PRINTED) == {(m, n) for m in TABLE1_MODELS for n in TABLE1_DEGREES}


@pytest.mark.parametrize(("model", "degree"), sorted(TABLE1_PRINTED))
def test_every_cell_is_the_formula_with_the_papers_rounding(model: str, degree: int) -> None:
    psi = TABLE1_MODELS[model]
    for stage, printed in zip(STAGES, TABLE1_PRINTED[model, degree], strict=True):
        exact = table1_gb(psi, degree, stage)
        assert float(exact) == pytest.approx(
            FORMULAS[stage](psi, degree), rel=1e-9
        )  # partitioned parts: whole bytes
        assert paper_rounding(exact) == printed, (model, degree, stage)
        # Independently of the rule: the printed value is within its last digit's rounding
        # (truncation for the whole numbers of 100 GB and more).
        value, step = Decimal(printed), Decimal(1).scaleb(Decimal(printed).as_tuple().exponent)
        if exact >= 100:
            assert value <= exact < value + 1
        else:
            assert abs(exact - value) <= step / 2


def test_the_trillion_parameter_cell() -> None:
    # The paper's headline: 1T parameters on 1024 GPUs, 15.6 GB of model states each.
    assert table1_gb(10**12, 1024, 3) == Decimal("15.625")
    assert paper_rounding(table1_gb(10**12, 1024, 3)) == "15.6"


@pytest.mark.parametrize("degree", TABLE1_DEGREES)
def test_the_estimate_rows_are_table_one(degree: int) -> None:
    psi = TABLE1_MODELS["7.5B"]
    result = estimate(psi, world_size=degree, device_memory="80GiB", host_memory="1TiB")
    rows = {row.name: row for row in result.rows}
    for stage, name in zip(STAGES, ("ZeRO-1", "ZeRO-2", "ZeRO-3"), strict=True):
        assert Decimal(rows[name].device_model_states) / 10**9 == table1_gb(psi, degree, stage)
    assert rows["ZeRO-3"].library == "paper"


def test_rounding_rule_edges() -> None:
    assert paper_rounding(Decimal("41.25")) == "41.3"  # half up, not half even
    assert paper_rounding(Decimal("513.5")) == "513"  # truncated at 100 and above
    assert paper_rounding(Decimal("0.46875")) == "0.47"  # at most two decimals
    assert paper_rounding(Decimal("30")) == "30"


def test_the_table_says_which_stage_three_runs() -> None:
    """Stage 3 runs with the shards on the device (tests/test_zero3_device.py) and in host
    RAM, the optimizer state offloaded in both; the column (state on the device) is the
    paper's accounting, and the estimator's rows say so."""
    text = table1()
    assert "15.6" in text and "4011" in text
    assert "not implemented" not in text
    assert "ZeRO-3 (P_os+g+p) with the shards on the device" in text
    assert "partition_parameters=True" in text
    assert "column, which keeps it on the device, is the paper's accounting only" in text
    shape = ModelShape(layers=4, hidden=64, heads=4, vocab=64, seq_len=16)
    rows = {row.name: row for row in estimate(shape, world_size=4, device_memory=2**30).rows}
    assert rows["ZeRO-3"].library == "paper"
    assert rows["ZeRO-Offload + ZeRO-3 (shards on the device)"].library == "yes"
