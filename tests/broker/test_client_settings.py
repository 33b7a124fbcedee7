"""broker.client_settings: a Streamer's knobs are one ClientSettings, read from its keyword
arguments, then a ``settings=`` object or the environment (MICROBATCH_CLIENT_*, REDIS_URL),
then the defaults."""

from __future__ import annotations

import inspect
import warnings

import pytest
import redis

from broker import DeadlineExceeded, QueueFull, Streamer
from broker.client import DEFAULT_REDIS_URL, DEFAULT_TIMEOUT_S
from broker.client_settings import ENV_PREFIX, ClientSettings, UnknownSettingWarning
from broker.devserver import RedisServer
from broker.keys import DEFAULT_PREFIX, ModelKeys
from broker.redis_url import RedisURLError
from gpu_worker import LocalStreamer
from tests.conftest import wait_until
from tests.models import Toy

# Streamer's arguments that are no setting (a pipeline's stages come with its class, as model)
NOT_SETTINGS = {"self", "name", "model", "settings", "stages"}
ENVIRONMENT = {
    "REDIS_URL": "redis://shared:6379/0",
    f"{ENV_PREFIX}PREFIX": "from-env",
    f"{ENV_PREFIX}TIMEOUT": "2.5",
    f"{ENV_PREFIX}MAX_QUEUE_ITEMS": "7",
    f"{ENV_PREFIX}MAX_QUEUE_BYTES": "4096",
    f"{ENV_PREFIX}WAIT_FOR_WORKERS": "true",
    f"{ENV_PREFIX}WORKERS_GRACE": "3",
}


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No MICROBATCH_CLIENT_* nor REDIS_URL from the environment the tests run in."""
    for name in ["REDIS_URL", *(f"{ENV_PREFIX}{field.upper()}" for field in fields())]:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def fields() -> set[str]:
    return set(ClientSettings.model_fields)


def test_every_keyword_argument_is_a_field_and_every_field_a_keyword_argument() -> None:
    arguments = set(inspect.signature(Streamer.__init__).parameters) - NOT_SETTINGS
    assert arguments == fields()


def test_the_defaults_are_todays(clean_env: pytest.MonkeyPatch) -> None:
    settings = Streamer("m").client_settings
    assert settings == ClientSettings.from_values()
    assert (settings.redis_url, settings.prefix, settings.timeout) == (
        DEFAULT_REDIS_URL,
        DEFAULT_PREFIX,
        DEFAULT_TIMEOUT_S,
    )
    assert (settings.max_queue_items, settings.max_queue_bytes) == (0, 0)
    assert (settings.wait_for_workers, settings.workers_grace) == (False, 10.0)


def test_every_field_reads_its_environment_variable(clean_env: pytest.MonkeyPatch) -> None:
    for name, value in ENVIRONMENT.items():
        clean_env.setenv(name, value)
    streamer = Streamer("m")
    assert streamer.client_settings == ClientSettings(
        redis_url="redis://shared:6379/0",
        prefix="from-env",
        timeout=2.5,
        max_queue_items=7,
        max_queue_bytes=4096,
        wait_for_workers=True,
        workers_grace=3.0,
    )
    # the attributes the client works from follow the settings
    assert streamer.redis_url == "redis://shared:6379/0"
    assert streamer.keys == ModelKeys("m", "from-env")
    assert (streamer.bound.max_items, streamer.bound.max_bytes) == (7, 4096)
    assert (streamer.timeout, streamer.wait_for_workers, streamer.workers_grace) == (2.5, True, 3)
    # a client-only Redis URL wins over the one every command shares
    clean_env.setenv(f"{ENV_PREFIX}REDIS_URL", "redis://client-only:6379/1")
    assert Streamer("m").redis_url == "redis://client-only:6379/1"


def test_an_empty_variable_counts_as_unset_as_for_the_commands(
    clean_env: pytest.MonkeyPatch,
) -> None:
    """``REDIS_URL=`` (a compose .env line left blank) made every Streamer fail with "the Redis
    URL is empty", and ``MICROBATCH_CLIENT_TIMEOUT=`` with "unable to parse", while `worker
    start` and `gateway start` took such variables as unset."""
    clean_env.setenv("REDIS_URL", "")
    clean_env.setenv(f"{ENV_PREFIX}REDIS_URL", "")
    for field in ("TIMEOUT", "PREFIX", "PRIORITY", "WAIT_FOR_WORKERS", "ENTRY_ITEMS"):
        clean_env.setenv(f"{ENV_PREFIX}{field}", "")
    assert Streamer("m").client_settings == ClientSettings.from_values()


def test_a_bad_value_from_a_variable_names_the_variable(clean_env: pytest.MonkeyPatch) -> None:
    """A bad value read from the environment says which variable held it, as the commands'
    errors do (it said ``timeout: Input should be a valid number``, naming no variable); a
    value given as an argument is not said to come from one."""
    cases = (
        (f"{ENV_PREFIX}TIMEOUT", "abc", ValueError),
        (f"{ENV_PREFIX}ENTRY_ITEMS", "0", ValueError),
        (f"{ENV_PREFIX}PRIORITY", "urgent", ValueError),
        ("REDIS_URL", "http://h:1/0", RedisURLError),
        (f"{ENV_PREFIX}REDIS_URL", "http://h:1/0", RedisURLError),
    )
    for variable, value, kind in cases:
        clean_env.setenv(variable, value)
        with pytest.raises(kind, match=rf"\(from {variable}\)$"):
            Streamer("m")
        clean_env.delenv(variable)
    clean_env.setenv(f"{ENV_PREFIX}TIMEOUT", "abc")
    with pytest.raises(ValueError) as raised:
        Streamer("m", timeout=-1)
    assert "from" not in str(raised.value), raised.value


def test_arguments_win_over_settings_and_the_environment(clean_env: pytest.MonkeyPatch) -> None:
    for name, value in ENVIRONMENT.items():
        clean_env.setenv(name, value)
    given = Streamer("m", "redis://given:1/0", "given", timeout=4.0, wait_for_workers=False)
    assert given.client_settings.redis_url == "redis://given:1/0"
    assert (given.keys.prefix, given.timeout, given.wait_for_workers) == ("given", 4.0, False)
    assert given.bound.max_items == 7  # not given: the environment's

    base = ClientSettings.from_values(prefix="base", max_queue_items=2)
    assert base.redis_url == DEFAULT_REDIS_URL and base.timeout == DEFAULT_TIMEOUT_S  # no env
    over = Streamer("m", settings=base, max_queue_items=5)
    assert over.client_settings == ClientSettings.from_values(prefix="base", max_queue_items=5)
    assert over.client_settings.redis_url == DEFAULT_REDIS_URL  # settings= replaces the env


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ({"redis_url": "http://x"}, RedisURLError, "the Redis URL has 'http://'"),
        ({"timeout": 0}, ValueError, "timeout must be a positive number of seconds, not 0"),
        ({"prefix": "a b"}, ValueError, "invalid prefix 'a b'"),
        ({"max_queue_items": -1}, ValueError, "max_queue_items: Input should be greater"),
        ({"workers_grace": 0}, ValueError, "the workers' grace period must be positive"),
        # inf: never NoWorkers, which is wait_for_workers' job; at most a year, as the gateway's
        ({"workers_grace": float("inf")}, ValueError, "workers_grace: Input should be less than"),
    ],
)
def test_a_bad_setting_is_one_value_error_at_construction(
    clean_env: pytest.MonkeyPatch, arguments: dict[str, object], error: type, message: str
) -> None:
    with pytest.raises(error) as raised:
        Streamer("m", **arguments)  # type: ignore[arg-type]
    assert str(raised.value).startswith(message)
    assert "\n" not in str(raised.value)
    # from the environment alike
    name, value = next(iter(arguments.items()))
    clean_env.setenv(f"{ENV_PREFIX}{name.upper()}", str(value))
    with pytest.raises(error, match="^" + message.split("'")[0]):
        Streamer("m")


def test_local_streamers_read_nothing_from_the_environment(clean_env: pytest.MonkeyPatch) -> None:
    for name, value in ENVIRONMENT.items():
        clean_env.setenv(name, value)
    clean_env.setenv("REDIS_URL", "not a url")
    with LocalStreamer(Toy, batch_size=2) as local:
        assert local.client_settings.timeout == DEFAULT_TIMEOUT_S
        assert local.bound.max_bytes == 0 and local.keys.prefix == "local"
        assert [output["item"] for output in local.predict([1, 2])] == [1, 2]


def test_a_misspelt_variable_is_warned_of_naming_the_setting_meant(
    clean_env: pytest.MonkeyPatch,
) -> None:
    clean_env.setenv(f"{ENV_PREFIX}TIMOUT", "3")
    clean_env.setenv(f"{ENV_PREFIX}REDIS", "redis://elsewhere:6379/0")
    clean_env.setenv(f"{ENV_PREFIX}SERVICE_HOST", "10.0.0.1")  # a Kubernetes service link
    with pytest.warns(UnknownSettingWarning) as caught:
        streamer = Streamer("m")
    messages = sorted(str(warning.message) for warning in caught)
    assert messages == [
        f"{ENV_PREFIX}REDIS is not a setting of microbatch's client: ignored "
        f"(did you mean {ENV_PREFIX}REDIS_URL?)",
        f"{ENV_PREFIX}TIMOUT is not a setting of microbatch's client: ignored "
        f"(did you mean {ENV_PREFIX}TIMEOUT?)",
    ]
    assert streamer.client_settings.timeout == DEFAULT_TIMEOUT_S
    assert {warning.filename for warning in caught} == {__file__}  # the caller's line, not ours
    streamer.close()


def test_variables_are_checked_ignoring_case_as_they_are_read(
    clean_env: pytest.MonkeyPatch,
) -> None:
    """The client reads its variables ignoring case: MICROBATCH_CLIENT_Timeout set the timeout
    and was warned of as ignored, and a misspelt one in lower case was not warned of."""
    clean_env.setenv(f"{ENV_PREFIX}Timeout", "7")
    clean_env.setenv(ENV_PREFIX.lower() + "prefx", "p")
    with pytest.warns(UnknownSettingWarning) as caught:
        settings = ClientSettings()
    assert [str(warning.message) for warning in caught] == [
        f"{ENV_PREFIX.lower()}prefx is not a setting of microbatch's client: ignored "
        f"(did you mean {ENV_PREFIX}PREFIX?)",
    ]
    assert settings.timeout == 7


def test_settings_that_read_no_environment_warn_of_none_of_it(
    clean_env: pytest.MonkeyPatch,
) -> None:
    clean_env.setenv(f"{ENV_PREFIX}TIMOUT", "3")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ClientSettings.from_values(timeout=2)
        with LocalStreamer(Toy, batch_size=2) as local:
            assert [output["item"] for output in local.predict([1])] == [1]


def test_a_streamer_set_up_by_the_environment_alone_uses_it(
    clean_env: pytest.MonkeyPatch, redis_server: RedisServer, prefix: str
) -> None:
    clean_env.setenv("REDIS_URL", redis_server.url)
    clean_env.setenv(f"{ENV_PREFIX}PREFIX", prefix)
    clean_env.setenv(f"{ENV_PREFIX}MAX_QUEUE_ITEMS", "2")
    clean_env.setenv(f"{ENV_PREFIX}TIMEOUT", "1")
    clean_env.setenv(f"{ENV_PREFIX}WAIT_FOR_WORKERS", "1")  # no worker runs here
    stream = ModelKeys("toy", prefix).stream
    client = redis.Redis.from_url(redis_server.url)
    with Streamer("toy") as streamer:
        with pytest.raises(QueueFull, match="bound of 2 items"):
            streamer.predict([1, 2, 3])
        waiting = streamer.submit([1])
        wait_until(lambda: client.xlen(stream) == 1, 30, "the item queued under the prefix")
        assert isinstance(waiting.exception(timeout=30), DeadlineExceeded)
    client.close()


@pytest.mark.parametrize(
    "url",
    [
        "redis://app:s3cret@127.0.0.1:6379/0",
        "redis+sentinel://app:s3cret@127.0.0.1:26379/mymaster?sentinel_password=s3cret",
    ],
)
def test_printing_settings_never_shows_a_password(url: str) -> None:
    settings = ClientSettings.from_values(redis_url=url)
    for text in (repr(settings), str(settings)):
        assert "s3cret" not in text
        assert "app:***@127.0.0.1" in text
    assert settings.redis_url == url  # what connects keeps it


def test_a_streamer_s_repr_names_its_model_and_redis_without_the_password() -> None:
    streamer = Streamer("mlp", "redis://app:s3cret@127.0.0.1:6379/0", prefix="tenant")
    said = "Streamer('mlp', redis_url='redis://app:***@127.0.0.1:6379/0', prefix='tenant')"
    assert repr(streamer) == said
    with LocalStreamer(Toy, batch_size=2) as local:
        assert repr(local) == "LocalStreamer(Toy, batch_size=2, max_latency=0)"
