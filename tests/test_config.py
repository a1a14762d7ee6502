"""AcceleratorConfig, byte parsing and OffloadConfig's modes: each field's validation names
field, value, range."""

from __future__ import annotations

import dataclasses
import json

import pytest

from zero_offload.config import (
    DEVICE_BUDGET_ENV,
    AcceleratorConfig,
    GradStaging,
    OffloadConfig,
    format_bytes,
    parse_bytes,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("8GiB", 8 * 2**30),
        ("512MiB", 512 * 2**20),
        ("2GB", 2 * 10**9),
        ("1.5 KiB", 1536),
        ("1e6", 10**6),
        ("4g", 4 * 2**30),
        ("100", 100),
        (123, 123),
    ],
)
def test_parse_bytes_accepts_units(text: str | int, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["eight", "8 parsecs", "", "GiB", "-5"])
def test_parse_bytes_rejects_garbage_naming_the_value(text: str) -> None:
    with pytest.raises(ValueError, match="budget_x"):
        parse_bytes(text, name="budget_x")


def test_parse_bytes_rejects_wrong_types() -> None:
    with pytest.raises(TypeError, match="n"):
        parse_bytes(1.5, name="n")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        parse_bytes(True)
    with pytest.raises(ValueError, match=">= 0"):
        parse_bytes(-1)


def test_format_bytes() -> None:
    assert format_bytes(3 * 2**30) == "3.00 GiB"
    assert format_bytes(12) == "12 B"


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("device_budget", 0, "device_budget must be > 0"),
        ("device_budget", "lots", "device_budget='lots' is not a byte count"),
        ("device_budget", -3, "device_budget must be >= 0"),
        ("link_bandwidth", 0.0, "link_bandwidth must be a finite number > 0"),
        ("link_bandwidth", float("inf"), "link_bandwidth must be a finite number > 0"),
        ("link_bandwidth", "fast", "link_bandwidth must be a number"),
        ("link_latency", -1e-3, "link_latency must be a finite number >= 0"),
        ("link_latency", float("nan"), "link_latency must be a finite number >= 0"),
    ],
)
def test_accelerator_config_validates_each_field(field: str, value: object, message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        AcceleratorConfig(**{field: value})  # type: ignore[arg-type]


def test_budget_string_is_parsed_and_config_is_frozen() -> None:
    cfg = AcceleratorConfig(device_budget="2MiB")
    assert cfg.device_budget == 2 * 2**20
    with pytest.raises(AttributeError):
        cfg.device_budget = 5  # type: ignore[misc]


def test_budget_resolution_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DEVICE_BUDGET_ENV, "3MiB")
    assert AcceleratorConfig(device_budget=1000).resolved_device_budget(7, "d") == (1000, "config")
    budget, source = AcceleratorConfig().resolved_device_budget(7, "d")
    assert budget == 3 * 2**20 and DEVICE_BUDGET_ENV in source
    monkeypatch.delenv(DEVICE_BUDGET_ENV)
    assert AcceleratorConfig().resolved_device_budget(7, "d") == (7, "d")
    monkeypatch.setenv(DEVICE_BUDGET_ENV, "nonsense")
    with pytest.raises(ValueError, match=DEVICE_BUDGET_ENV):
        AcceleratorConfig().resolved_device_budget(7, "d")


def test_an_infinite_byte_count_is_a_value_error_not_an_overflow(monkeypatch) -> None:
    with pytest.raises(ValueError, match="not a finite byte count"):
        parse_bytes("1e400", name="budget")
    monkeypatch.setenv("ZERO_OFFLOAD_DEVICE_BUDGET", "1e400")
    with pytest.raises(ValueError, match="ZERO_OFFLOAD_DEVICE_BUDGET='1e400' is not a finite"):
        AcceleratorConfig().resolved_device_budget(1, "default")


#: OffloadConfig's byte fields, each with what it needs beside it.
_BYTE_FIELDS = {
    "host_budget": {"nvme_dir": "/tmp/zero-offload-never-opened"},
    "speculation_bytes": {},
    "bucket_bytes": {},
}


@pytest.mark.parametrize("field", sorted(_BYTE_FIELDS))
@pytest.mark.parametrize(
    ("text", "suggestions"),
    [
        # A small number is likelier GiB (or MiB) than bytes: it is offered with units.
        ("48", ["'48GiB'", "'48GB'", "the int 48"]),
        (" 2.5 ", ["'2.5GiB'", "'2.5GB'", "'2.5B'"]),
        # From 1024 up, likelier bytes: offered spelled with a unit.
        ("25769803776", ["'24GiB'", "the int 25769803776"]),
        ("1e9", ["'1GB'", "'1e9B'"]),
        ("4096", ["'4KiB'", "the int 4096"]),
    ],
)
def test_a_byte_field_refuses_a_number_without_a_unit(
    field: str, text: str, suggestions: list[str]
) -> None:
    """ "48" meant as 48 GiB would be 48 bytes: every byte string needs its unit."""
    with pytest.raises(ValueError, match="has no unit") as info:
        OffloadConfig(**_BYTE_FIELDS[field], **{field: text})
    assert f"OffloadConfig.{field}={text!r}" in str(info.value)
    for suggestion in suggestions:
        assert suggestion in str(info.value)


@pytest.mark.parametrize("field", sorted(_BYTE_FIELDS))
@pytest.mark.parametrize(
    ("value", "nbytes"), [(8192, 8192), ("48GiB", 48 * 2**30), ("8192B", 8192)]
)
def test_a_byte_field_takes_an_int_or_a_unit(field: str, value: object, nbytes: int) -> None:
    config = OffloadConfig(**_BYTE_FIELDS[field], **{field: value})
    assert getattr(config, field) == nbytes


def test_a_flags_byte_count_offers_no_int() -> None:
    """A command-line flag is a string: its messages offer the B unit, never an int."""
    from zero_offload.config import parse_bytes_with_unit

    with pytest.raises(ValueError, match="has no unit") as info:
        parse_bytes_with_unit("25769803776", name="--host-memory", ints=False)
    assert "'24GiB'" in str(info.value) and "'25769803776B'" in str(info.value)
    assert "int" not in str(info.value)
    with pytest.raises(ValueError, match="not a byte count") as info:
        parse_bytes_with_unit("abc", name="--host-memory", ints=False)
    assert "'8GiB'" in str(info.value) and "int" not in str(info.value)
    with pytest.raises(ValueError, match="not a finite byte count"):
        parse_bytes_with_unit("1e400", name="--host-memory", ints=False)


@pytest.mark.parametrize("given", ["in_flight", GradStaging.IN_FLIGHT])
def test_grad_staging_is_normalised_to_its_member(given: object) -> None:
    config = OffloadConfig(grad_staging=given)
    assert config.grad_staging is GradStaging.IN_FLIGHT
    # Backwards compatible: equal to, hashed, printed and serialised as the spelling.
    assert config.grad_staging == "in_flight"
    assert hash(config.grad_staging) == hash("in_flight")
    assert f"{config.grad_staging}" == str(config.grad_staging) == "in_flight"
    assert json.dumps({"grad_staging": config.grad_staging}) == '{"grad_staging": "in_flight"}'
    assert dataclasses.replace(config).grad_staging is GradStaging.IN_FLIGHT
    assert OffloadConfig().grad_staging is GradStaging.PER_BUCKET


@pytest.mark.parametrize("bad", ["ring", "IN_FLIGHT", None, 1, ["in_flight"]])
def test_grad_staging_refuses_other_values_naming_them_and_the_choices(bad: object) -> None:
    with pytest.raises(ValueError) as raised:
        OffloadConfig(grad_staging=bad)
    assert str(raised.value) == (
        f"OffloadConfig.grad_staging must be 'per_bucket' or 'in_flight', got {bad!r}"
    )
