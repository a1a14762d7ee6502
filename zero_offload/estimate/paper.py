"""The ZeRO paper's Table 1 (Rajbhandari et al., SC'20): per-device model-state memory of
ZeRO-DP's three stages, from the same formulas as the table's ZeRO rows
(``rows.model_state_bytes``), printed with the paper's rounding.

Note [the paper's rounding in Table 1]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The table is in GB of 10^9 bytes (16 bytes x 7.5e9 parameters = 120 GB). Every printed cell
follows one rule: a value of 100 GB or more is printed as its whole part, truncated (1T at
N_d = 64: P_os = 4187.5 is printed 4187, P_os+g = 2218.75 is 2218); a smaller one to three
significant figures, at most two decimals, half up (41.25 is 41.3, 0.46875 is 0.47, 1.875 is
1.88, 15.625 is 15.6). ``paper_rounding`` is that rule; ``tests/test_estimate_paper.py``
checks every printed cell against it and against the unrounded formula.
"""

from __future__ import annotations

from decimal import ROUND_DOWN, ROUND_HALF_UP, Decimal

from .rows import Context, model_state_bytes

__all__ = [
    "TABLE1_DEGREES",
    "TABLE1_MODELS",
    "TABLE1_PRINTED",
    "paper_rounding",
    "table1",
    "table1_gb",
]

#: The models of Table 1: label, parameters (Psi).
TABLE1_MODELS = {"7.5B": 7_500_000_000, "128B": 128_000_000_000, "1T": 1_000_000_000_000}
#: The data-parallel degrees N_d of Table 1.
TABLE1_DEGREES = (1, 4, 16, 64, 256, 1024)
#: The stages of Table 1's columns: ZeRO stage and the paper's name.
TABLE1_STAGES = {1: "P_os", 2: "P_os+g", 3: "P_os+g+p"}

#: Table 1 as printed, GB: ``{(model, N_d): (P_os, P_os+g, P_os+g+p)}``.
TABLE1_PRINTED: dict[tuple[str, int], tuple[str, str, str]] = {
    ("7.5B", 1): ("120", "120", "120"),
    ("7.5B", 4): ("52.5", "41.3", "30"),
    ("7.5B", 16): ("35.6", "21.6", "7.5"),
    ("7.5B", 64): ("31.4", "16.6", "1.88"),
    ("7.5B", 256): ("30.4", "15.4", "0.47"),
    ("7.5B", 1024): ("30.1", "15.1", "0.12"),
    ("128B", 1): ("2048", "2048", "2048"),
    ("128B", 4): ("896", "704", "512"),
    ("128B", 16): ("608", "368", "128"),
    ("128B", 64): ("536", "284", "32"),
    ("128B", 256): ("518", "263", "8"),
    ("128B", 1024): ("513", "257", "2"),
    ("1T", 1): ("16000", "16000", "16000"),
    ("1T", 4): ("7000", "5500", "4000"),
    ("1T", 16): ("4750", "2875", "1000"),
    ("1T", 64): ("4187", "2218", "250"),
    ("1T", 256): ("4046", "2054", "62.5"),
    ("1T", 1024): ("4011", "2013", "15.6"),
}


def table1_gb(params: int, degree: int, stage: int) -> Decimal:
    """Model-state GB (10^9 bytes) per device at ZeRO ``stage`` (1-3) over ``degree``
    data-parallel ranks, mixed-precision Adam (2-byte weights and gradients, K = 12), exact."""
    ctx = Context(itemsize=2, world_size=degree, ranks_per_node=degree, bucket_bytes=1)
    return Decimal(model_state_bytes(stage, params, ctx)) / Decimal(10**9)


def paper_rounding(gb: Decimal) -> str:
    """``gb`` as Table 1 prints it; see Note [the paper's rounding in Table 1]."""
    if gb >= 100:
        return str(gb.to_integral_value(rounding=ROUND_DOWN))
    digits = max(0, min(2, 2 - gb.adjusted()))  # three significant figures, <= 2 decimals
    text = str(gb.quantize(Decimal(1).scaleb(-digits), rounding=ROUND_HALF_UP))
    return text.rstrip("0").rstrip(".") if "." in text else text


def table1() -> str:
    """Table 1 recomputed from the formulas, in the paper's layout and rounding, with the
    note on which stages this library runs and how its stage 3 differs from the column."""
    from ..profiling.report import format_table

    header = ["N_d"] + [
        f"{model} {name}" for model in TABLE1_MODELS for name in TABLE1_STAGES.values()
    ]
    rows = [
        [str(degree)]
        + [
            paper_rounding(table1_gb(params, degree, stage))
            for params in TABLE1_MODELS.values()
            for stage in TABLE1_STAGES
        ]
        for degree in TABLE1_DEGREES
    ]
    return (
        "ZeRO paper (SC'20) Table 1: per-device model-state memory, GB (1e9 bytes), "
        "mixed-precision Adam, K = 12\n"
        "P_os = 4Psi + K Psi/N_d (ZeRO-1), P_os+g = 2Psi + 14Psi/N_d (ZeRO-2), "
        "P_os+g+p = 16Psi/N_d (ZeRO-3)\n\n"
        + format_table(header, rows)
        + "\n\nthis library runs ZeRO-2 with offload, ZeRO-3 with parameter offload (each "
        "rank's shards in host RAM) and ZeRO-3 (P_os+g+p) with the shards on the device "
        "(OffloadConfig(partition_parameters=True)); in each the optimizer state (K Psi/N_d) "
        "is offloaded to the host, so the P_os+g+p column, which keeps it on the device, is "
        "the paper's accounting only."
    )
