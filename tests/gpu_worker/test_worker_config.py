"""gpu_worker.config: `worker start`'s options become one WorkerConfig; a model's defaults are
resolved in one place, the same for workers and LocalStreamer."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import typer

from gpu_worker import LocalStreamer, ManagedModel
from gpu_worker.cli import app
from gpu_worker.config import BatchSettings, WorkerConfig

RENAMED = {"redis": "redis_url", "busy_poll_us": "busy_poll_s"}  # the CLI's names, the field's


def start_command() -> Any:
    """`worker start` as typer builds it (on typer's own copy of click)."""
    return typer.main.get_command(app).commands["start"]  # type: ignore[attr-defined]


def options() -> list[Any]:
    return [param for param in start_command().params if param.param_type_name == "option"]


def test_every_option_reads_an_environment_variable_named_after_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    command = start_command()
    ctx = command.make_context("start", ["--model", "tests.models:Toy"])
    help_text = command.get_help(ctx)
    for option in options():
        assert option.name is not None
        name = "REDIS_URL" if option.name == "redis" else f"MICROBATCH_WORKER_{option.name.upper()}"
        monkeypatch.setenv(name, "from-the-environment")
        assert option.resolve_envvar_value(ctx) == "from-the-environment", option.name
        monkeypatch.delenv(name)
        assert name in help_text, name


def test_every_option_is_a_field_of_the_config_and_every_field_an_option() -> None:
    names = {option.name for option in options()}
    fields = {field.name for field in dataclasses.fields(WorkerConfig)}
    assert {RENAMED.get(name, name) for name in names if name} == fields - {"max_start_failures"}


def test_options_become_a_config_in_its_units() -> None:
    command = start_command()
    args = ["--model", "tests.models:Toy", "--busy-poll-us", "2000", "--cuda", "0,1"]
    ctx = command.make_context("start", [*args, "--max-queue-items", "auto"])
    config = WorkerConfig.from_options(**ctx.params)
    assert config.busy_poll_s == pytest.approx(0.002)
    assert config.cuda == [0, 1]
    assert config.max_queue_items is None and config.max_latency is None
    config.validate()
    assert WorkerConfig.from_json(config.to_json()) == config


class Defaults(ManagedModel):
    name = "defaults"
    batch_size = 7
    max_latency = 0.25
    max_batch_cost = 90

    def predict(self, batch: list[int]) -> list[int]:
        return batch


def test_a_models_defaults_are_resolved_the_same_way_for_workers_and_local_streamers() -> None:
    defaults = WorkerConfig(model="m").batch_settings(Defaults)
    assert (defaults.batch_size, defaults.max_latency, defaults.max_batch_cost) == (7, 0.25, 90)
    assert defaults.busy_poll_s is None  # a worker decides as it goes; an embedded loop,
    with LocalStreamer(Defaults) as local:  # shared with its callers, never spins
        assert local.settings == dataclasses.replace(defaults, busy_poll_s=0.0)

    worker = WorkerConfig(model="m", batch_size=3, max_latency=0.0, max_batch_cost=0, busy_poll_s=0)
    settings = worker.batch_settings(Defaults)
    assert (settings.batch_size, settings.max_latency, settings.max_batch_cost) == (3, 0.0, 0)
    assert settings == BatchSettings.for_model(Defaults, 3, 0.0, 0)
    with LocalStreamer(Defaults, 3, 0.0, max_batch_cost=0) as local:
        assert local.settings == settings


@pytest.mark.parametrize(
    ("arguments", "said"),
    [
        ({"batch_size": 0}, "batch_size must be a positive int, not 0"),
        ({"batch_size": 2.5}, "batch_size must be a positive int, not 2.5"),
        ({"max_latency": -1}, "max_latency must be a number of seconds >= 0, not -1"),
        ({"max_latency": float("nan")}, "max_latency must be a number of seconds >= 0, not nan"),
        ({"max_batch_cost": -1}, "max_batch_cost must be an int >= 0 (0: items only), not -1"),
        ({"timeout": -1}, "timeout must be a positive number of seconds, not -1"),
        ({"timeout": float("inf")}, "timeout must be a positive number of seconds, not inf"),
        ({"max_queue_items": -1}, "max_queue_items: Input should be greater than or equal to 0"),
    ],
)
def test_a_bad_argument_of_a_local_streamer_is_one_value_error_naming_it(
    arguments: dict[str, Any], said: str
) -> None:
    # As Streamer's arguments and a model's class attributes are: one line, before anything
    # runs (a negative max_latency was taken, a float batch_size too).
    with pytest.raises(ValueError) as raised:
        LocalStreamer(Defaults, **arguments)
    assert str(raised.value).startswith(said)
    assert "\n" not in str(raised.value)


def test_a_config_s_repr_never_shows_the_redis_password() -> None:
    url = "redis+sentinel://w:s3cret-a@h:26379/svc?sentinel_password=s3cret-b"
    shown = repr(WorkerConfig(model="tests.models:Toy", redis_url=url, workers=2))
    assert "s3cret" not in shown
    assert "redis_url='redis+sentinel://w:***@h:26379/svc?sentinel_password=***'" in shown
    assert shown.startswith("WorkerConfig(model='tests.models:Toy', ") and "workers=2" in shown
