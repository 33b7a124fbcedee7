"""`gateway start`'s command line and logs: help like the other CLIs, -h, log levels,
the access log, a start-up line without credentials, and a quiet shutdown."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from broker.devserver import RedisServer, free_port
from tests.conftest import ROOT
from tests.e2e.test_gateway import gateway_process
from web_gateway.settings import GatewaySettings

DOUBLER = "tests.gateway_models:Doubler"
# broker.logs.TEXT_FORMAT, the format of `worker start`'s lines
LINE = re.compile(
    r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) \S+ \[\d+\] \S"
)


def gateway(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MICROBATCH_GATEWAY_")}
    return subprocess.run(
        [sys.executable, "-m", "web_gateway.cli", *args],
        cwd=ROOT,
        env={**clean, "PYTHONPATH": str(ROOT), "COLUMNS": "80", **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_help_is_plain_text_with_every_env_var_whole_and_h_is_help() -> None:
    shown = gateway("start", "--help")
    assert shown.returncode == 0, shown.stderr
    text = shown.stdout
    assert not re.search("[\u2500-\u257f]", text), "rich boxes"
    assert all(len(line) <= 80 for line in text.splitlines())
    lists = re.findall(r"\[env\s+var:\s+([A-Z_,\s]+?)[;\]]", text)
    names = [re.sub(r"\s+", "", name) for names in lists for name in names.split(",")]
    for option in ("MODEL", "PREFIX", "MAX_QUEUE_ITEMS", "LOG_LEVEL", "ACCESS_LOG"):
        assert f"MICROBATCH_GATEWAY_{option}" in names
    assert "REDIS_URL" in names and "MICROBATCH_GATEWAY_REDIS_URL" in names
    assert "redis://[user:password@]host:port/db" in text
    assert gateway("start", "-h").stdout == text
    assert "-h, --help" in gateway("-h").stdout


@pytest.mark.slow
def test_log_level_takes_the_five_levels_in_any_case_and_nothing_else() -> None:
    for level in ("verbose", "warn", "10"):
        for how in ("flag", "env"):
            args = ["start", "--model", DOUBLER]
            env = {}
            if how == "flag":
                args += ["--log-level", level]
            else:
                env["MICROBATCH_GATEWAY_LOG_LEVEL"] = level
            refused = gateway(*args, env=env)
            assert refused.returncode == 2, (level, how)
            assert refused.stderr.strip().splitlines() == [
                "Error: --log-level must be one of debug, info, warning, error, critical, "
                f"not {level!r}"
            ]
    # a valid level, in any case, gets past the check: the next one fails (the model)
    for level in ("DEBUG", "Warning", "critical"):
        later = gateway("start", "--model", "nope:Nope", "--log-level", level)
        assert later.returncode == 2 and "cannot import module 'nope'" in later.stderr


def run_and_log(redis_url: str, prefix: str, log: Path, *args: str, secret_query: str = "") -> None:
    """Serve DOUBLER, make a few requests (one bad, one with a payload), stop with SIGTERM."""
    env = {"MICROBATCH_GATEWAY_LOG_LEVEL": "info"}
    with gateway_process(redis_url, [DOUBLER], prefix, *args, env=env, log_path=log) as (base, _):
        bad = httpx.post(
            f"{base}/v1/models/doubler/predict{secret_query}",
            json={"inputs": [["secret-payload", 1, 2, 3]]},
        )
        assert bad.status_code == 422
        assert httpx.get(f"{base}/v2/models/doubler/versions/7").status_code == 404
        # from 127.0.0.1, a proxy trusted by default (gunicorn's FORWARDED_ALLOW_IPS)
        for forwarded in ("203.0.113.9", "not-an-ip", "1.2.3.4, <script>"):
            headers = {"X-Forwarded-For": forwarded}
            assert httpx.get(f"{base}/v2/health/live", headers=headers).status_code == 200


def test_logs_name_models_prefix_and_redis_without_password_in_one_format(
    redis_server: RedisServer, prefix: str, tmp_path: Path
) -> None:
    # the default user takes any password: the URL carries one that must not be logged
    url = f"redis://default:hunter2-secret@127.0.0.1:{redis_server.port}/0"
    log = tmp_path / "gateway.log"
    run_and_log(url, prefix, log, "--access-log", secret_query="?token=query-secret")
    text = log.read_text()
    lines = [line for line in text.splitlines() if line.strip()]
    assert lines and all(LINE.match(line) for line in lines), text
    started = [line for line in lines if "gateway serving" in line]
    assert len(started) == 1
    assert started[0].endswith(
        f"gateway serving doubler under prefix '{prefix}' from Redis "
        f"redis://default:***@127.0.0.1:{redis_server.port}/0 (access log on)"
    )
    access = [line for line in lines if " microbatch.gateway.access " in line]
    assert any('"POST /v1/models/doubler/predict HTTP/1.1" 422 ' in line for line in access)
    assert any('"GET /v2/models/doubler/versions/7 HTTP/1.1" 404 ' in line for line in access)
    # an X-Forwarded-For naming no IP address is no client's address: the peer's is logged
    live = [line for line in access if '"GET /v2/health/live ' in line]
    clients = [line.split("] ")[1].split(" ")[0] for line in live]
    assert len(clients) == 3 and clients[0] == "203.0.113.9:0", clients
    assert [client.rpartition(":")[0] for client in clients[1:]] == ["127.0.0.1"] * 2, clients
    for secret in ("hunter2-secret", "query-secret", "secret-payload"):
        assert secret not in text
    assert "Errno 9" not in text and "Error while closing socket" not in text
    assert "Traceback" not in text


def test_no_access_log_unless_asked(redis_server: RedisServer, prefix: str, tmp_path: Path) -> None:
    log = tmp_path / "gateway.log"
    run_and_log(redis_server.url, prefix, log)
    text = log.read_text()
    assert "gateway serving doubler" in text and "(access log on)" not in text
    assert "microbatch.gateway.access" not in text
    assert "Error while closing socket" not in text


@pytest.mark.parametrize("level", ["warning", "ERROR"])
def test_gunicorn_directly_reads_the_same_level(level: str, tmp_path: Path) -> None:
    code = (
        "import web_gateway.gunicorn_conf as c; "
        "print(c.loglevel, c.logconfig_dict['root']['level'])"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MICROBATCH_GATEWAY_LOG_LEVEL": level}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.stdout.split() == [level.lower(), level.upper()]
    env["MICROBATCH_GATEWAY_LOG_LEVEL"] = "loud"
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0 and "--log-level must be one of" in done.stderr


def test_settings_are_checked_once_with_one_line_naming_the_option() -> None:
    for args, env, said in (
        (["--workers", "0"], {}, "--workers: Input should be greater than or equal to 1"),
        ([], {"MICROBATCH_GATEWAY_WORKERS": "0"}, "--workers: Input should be greater than"),
        (["--port", "70000"], {}, "--port: Input should be less than or equal to 65535"),
        (["--max-timeout", "1"], {}, "--default-timeout must not exceed --max-timeout"),
        (["--max-timeout", "1e9"], {}, "--max-timeout: Input should be less than or equal"),
        (["--max-held-body-bytes", "1000"], {}, "--max-held-body-bytes must be at least --max"),
        (["--send-timeout", "0"], {}, "--send-timeout: Input should be greater than 0"),
        ([], {"REDIS_URL": "http://x"}, "--redis: the Redis URL has 'http://'"),
        ([], {"MICROBATCH_GATEWAY_LOG_FORMAT": "xml"}, "--log-format must be one of text, json"),
    ):
        refused = gateway("start", "--model", DOUBLER, *args, env=env)
        assert refused.returncode == 2, (args, env)
        (line,) = refused.stderr.strip().splitlines()
        assert line.startswith(f"Error: {said}"), line


@pytest.mark.parametrize(
    "args, env, said",
    [
        (["--keepalive-timeout", "inf"], {}, "--keepalive-timeout: Input should be less than"),
        (["--graceful-timeout", "1e308"], {}, "--graceful-timeout: Input should be less than"),
        (["--header-timeout", "inf"], {}, "--header-timeout: Input should be less than"),
        ([], {"MICROBATCH_GATEWAY_BODY_TIMEOUT": "inf"}, "--body-timeout: Input should be less"),
        # the settings without an option are named by their environment variable
        ([], {"MICROBATCH_GATEWAY_WORKERS_GRACE": "inf"}, "MICROBATCH_GATEWAY_WORKERS_GRACE: "),
        ([], {"MICROBATCH_GATEWAY_WORKERS_GRACE": "0"}, "MICROBATCH_GATEWAY_WORKERS_GRACE: "),
        ([], {"MICROBATCH_GATEWAY_RETRY_AFTER": "-1"}, "MICROBATCH_GATEWAY_RETRY_AFTER: "),
        ([], {"MICROBATCH_GATEWAY_PREPROCESS_THREADS": "0"}, "MICROBATCH_GATEWAY_PREPROCESS_"),
        (["--auth-tokens-file", "/nonexistent/tokens"], {}, "--auth-tokens-file /nonexistent/"),
        # a list that is not JSON: named, never quoted (it holds tokens)
        ([], {"MICROBATCH_GATEWAY_AUTH_TOKENS": "[tok-1, tok-2"}, "MICROBATCH_GATEWAY_AUTH_TOK"),
        # set, yet no token ("${A},${B}" with both unset): auth was off, as for an empty one
        ([], {"MICROBATCH_GATEWAY_AUTH_TOKENS": " , "}, "MICROBATCH_GATEWAY_AUTH_TOKENS holds"),
        # an empty token: one no request can send (a typo, not a token)
        ([], {"MICROBATCH_GATEWAY_AUTH_TOKENS": '["tok-1", ""]'}, "MICROBATCH_GATEWAY_AUTH_TO"),
    ],
)
def test_an_infinite_duration_or_an_env_only_setting_gives_one_line_naming_it(
    args: list[str], env: dict[str, str], said: str
) -> None:
    """inf ended in gunicorn's 'cannot convert float infinity to integer' (exit 1), or was
    taken; the env-only settings were named as options that do not exist."""
    # never a gateway on a port or a Redis of someone else's, were a value taken
    args = [*args, "--port", str(free_port())]
    env = {"REDIS_URL": f"redis://127.0.0.1:{free_port()}/0", **env}
    refused = gateway("start", "--model", DOUBLER, *args, env=env)
    assert refused.returncode == 2, refused.stderr
    (line,) = refused.stderr.strip().splitlines()
    assert line.startswith(f"Error: {said}"), line
    assert "tok-1" not in line


def test_a_port_in_use_or_an_address_not_of_this_host_gives_one_line_at_once() -> None:
    """gunicorn retried for 5 s, logged each try at ERROR and exited 1, a status the help
    does not list; `worker start --metrics-port` says it in one line with exit status 2."""
    import socket

    env = {"REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        refused = gateway("start", "--model", DOUBLER, "--port", str(port), env=env)
    assert refused.returncode == 2, refused.stderr
    (line,) = refused.stderr.strip().splitlines()
    assert line == f"Error: --port {port}: Address already in use (127.0.0.1:{port})"
    args = ["--host", "nosuch.invalid", "--port", str(free_port())]
    refused = gateway("start", "--model", DOUBLER, *args, env=env)
    assert refused.returncode == 2, refused.stderr
    (line,) = refused.stderr.strip().splitlines()
    assert line.startswith("Error: --host nosuch.invalid: "), line


def test_a_tokens_file_that_is_not_utf8_is_named_without_its_bytes(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_bytes(b"s\xe9cret-latin1-token\n")
    env = {"REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"}
    args = ["--auth-tokens-file", str(tokens), "--port", str(free_port())]
    refused = gateway("start", "--model", DOUBLER, *args, env=env)
    assert refused.returncode == 2, refused.stderr
    (line,) = refused.stderr.strip().splitlines()
    assert line == f"Error: --auth-tokens-file {tokens}: not UTF-8 text"


def test_a_tokens_file_without_a_token_is_refused_not_taken_as_auth_off(tmp_path: Path) -> None:
    """A tokens file emptied (or commented out, or a secret mounted empty) turned auth off
    without a word: every route open to anyone."""
    tokens = tmp_path / "tokens"
    tokens.write_text("# the gateway's tokens\n\n   \n#old-token\n")
    env = {"REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"}
    args = ["--auth-tokens-file", str(tokens), "--port", str(free_port())]
    refused = gateway("start", "--model", DOUBLER, *args, env=env)
    assert refused.returncode == 2, refused.stderr
    (line,) = refused.stderr.strip().splitlines()
    assert line.startswith(f"Error: --auth-tokens-file {tokens} holds no token"), line
    assert "old-token" not in line


def test_the_gateway_s_own_redis_url_wins_over_redis_url_as_the_client_s_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """gunicorn -c read REDIS_URL first and `gateway start` never read
    MICROBATCH_GATEWAY_REDIS_URL: the same environment reached two Redis servers."""
    from broker.client_settings import ClientSettings
    from web_gateway.settings import GatewaySettings

    # a bad URL in the gateway's own variable: refused, so it is the one read
    env = {"MICROBATCH_GATEWAY_REDIS_URL": "http://own", "REDIS_URL": "redis://127.0.0.1:1/0"}
    args = ["--port", str(free_port()), "--default-timeout", "30", "--max-timeout", "1"]
    refused = gateway("start", "--model", DOUBLER, *args, env=env)
    assert refused.returncode == 2
    assert refused.stderr.startswith("Error: --redis: the Redis URL has 'http://'")

    monkeypatch.setenv("REDIS_URL", "redis://shared:1/0")
    for prefix in ("MICROBATCH_GATEWAY_", "MICROBATCH_CLIENT_"):
        monkeypatch.setenv(f"{prefix}REDIS_URL", "redis://own:1/0")
    assert GatewaySettings().redis_url == ClientSettings().redis_url == "redis://own:1/0"


def test_a_misspelt_variable_of_the_prefix_is_one_warning_line() -> None:
    """MICROBATCH_GATEWAY_MAX_TIMEOT was ignored in silence (the settings ignore extras)."""
    env = {"MICROBATCH_GATEWAY_MAX_TIMEOT": "5", "MICROBATCH_GATEWAY_SERVICE_HOST": "10.96.0.8",
           "MICROBATCH_GATEWAY_PORT_8000_TCP_PORT": "8000",
           "REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"}  # fmt: skip
    assert warning_past_the_settings(env, "--port", str(free_port())) == (
        "Warning: MICROBATCH_GATEWAY_MAX_TIMEOT is not a setting of `gateway start`: ignored "
        "(did you mean MICROBATCH_GATEWAY_MAX_TIMEOUT?)"
    )


def warning_past_the_settings(env: dict[str, str], *args: str) -> str:
    """The one warning line `gateway start` prints with ``env`` before it fails to import
    its model (so past the settings: none refused)."""
    refused = gateway("start", "--model", "no_such_module:Model", *args, env=env)
    assert refused.returncode == 2
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 2 and "no_such_module" in lines[1], lines
    return lines[0]


def test_a_kubernetes_service_link_named_like_the_port_setting_is_ignored() -> None:
    """A Service named microbatch-gateway gives every pod MICROBATCH_GATEWAY_PORT=tcp://...,
    which --port read and refused: `gateway start` exited 2 ("Invalid value for '--port'"),
    and gunicorn's workers, reading the settings, failed to boot."""
    from web_gateway.settings import GatewaySettings

    link = "tcp://10.96.0.8:8000"
    env = {"MICROBATCH_GATEWAY_PORT": link, "MICROBATCH_GATEWAY_PORT_8000_TCP": link,
           "REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"}  # fmt: skip
    assert warning_past_the_settings(env) == (
        "Warning: MICROBATCH_GATEWAY_PORT holds a Kubernetes service link's address (of a "
        "Service named microbatch-gateway), not a setting: ignored"
    )
    with pytest.MonkeyPatch.context() as patch:  # what gunicorn's workers read
        patch.setenv("MICROBATCH_GATEWAY_PORT", link)
        assert GatewaySettings(model=[DOUBLER]).port == 8000


def test_a_flag_turns_off_what_its_variable_turned_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """MICROBATCH_GATEWAY_WAIT_FOR_WORKERS=true (the scale-to-zero overlay's) had no flag to
    undo it on one gateway's command line, unlike --access-log's --no-access-log."""
    import typer

    from web_gateway.cli import app

    start = typer.main.get_command(app).commands["start"]  # type: ignore[attr-defined]
    for variable in ("MICROBATCH_GATEWAY_WAIT_FOR_WORKERS", "MICROBATCH_GATEWAY_ACCESS_LOG"):
        monkeypatch.setenv(variable, "true")
    args = ["--model", DOUBLER, "--no-wait-for-workers", "--no-access-log"]
    params = start.make_context("start", args).params
    assert params["wait_for_workers"] is False and params["access_log"] is False
    params = start.make_context("start", ["--model", DOUBLER]).params
    assert params["wait_for_workers"] is True and params["access_log"] is True


def test_printing_gateway_settings_never_shows_a_password() -> None:
    settings = GatewaySettings(redis_url="redis://app:s3cret@127.0.0.1:6379/0")
    assert "s3cret" not in repr(settings)
    assert "app:***@127.0.0.1" in str(settings)


def test_gunicorn_directly_warns_of_a_misspelt_variable_as_gateway_start_does() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MICROBATCH_GATEWAY_WORKRS": "4"}
    done = subprocess.run(
        [sys.executable, "-c", "import web_gateway.gunicorn_conf"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == (
        "Warning: MICROBATCH_GATEWAY_WORKRS is not a setting of `gunicorn -c`: ignored "
        "(did you mean MICROBATCH_GATEWAY_WORKERS?)"
    )


@pytest.mark.parametrize("separator", [" ", ",", ", ", "\n"])
def test_the_model_variable_is_split_as_gateway_start_splits_it(
    separator: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`gateway start` took MICROBATCH_GATEWAY_MODEL space-separated, as the docs say, but
    gunicorn -c (and create_app) read one model path 'a:A b:B', and every worker failed to boot."""
    import typer

    from web_gateway.cli import app

    models = ["tests.gateway_models:Doubler", "examples.mlp:MLP"]
    monkeypatch.setenv("MICROBATCH_GATEWAY_MODEL", separator.join(models))
    assert GatewaySettings().model == models
    start = typer.main.get_command(app).commands["start"]  # type: ignore[attr-defined]
    assert GatewaySettings(model=start.make_context("start", []).params["model"]).model == models
