"""Redis URLs: every accepted form parses into its typed description; malformed ones fail with
one clear line that never shows a password."""

from __future__ import annotations

from pathlib import Path

import pytest

from broker import Streamer
from broker.logs import redact_url
from broker.redis_url import (
    Address,
    ClusterURL,
    DirectURL,
    RedisURLError,
    SentinelURL,
    describe,
    parse,
)

SECRET = "s3cr3t-Pw"


def test_direct_urls_keep_redis_py_s_reading() -> None:
    plain = parse("redis://127.0.0.1:6379/0")
    assert plain == DirectURL("redis://127.0.0.1:6379/0", False, Address("127.0.0.1", 6379),
                              None, 0, None, None)  # fmt: skip
    tls = parse(f"rediss://app:{SECRET}%40x@cache.example:6380/2?ssl_cert_reqs=none")
    assert isinstance(tls, DirectURL) and tls.tls and tls.db == 2
    assert (tls.username, tls.password) == ("app", SECRET + "@x")  # percent-decoded
    assert tls.address == Address("cache.example", 6380)
    unix = parse("unix:///run/redis.sock?db=3")
    assert isinstance(unix, DirectURL)
    assert (unix.address, unix.path, unix.db) == (None, "/run/redis.sock", 3)
    assert parse("redis://[::1]:7000").address == Address("::1", 7000)  # type: ignore[union-attr]
    assert parse("redis://h").address == Address("h", 6379)  # type: ignore[union-attr]
    assert parse(" REDIS://h:1/4 ").db == 4  # scheme in any case, blanks around


def test_a_sentinel_url_names_the_sentinels_the_service_and_the_db() -> None:
    url = (
        f"redis+sentinel://app:{SECRET}@s1:26380,s2,[fd00::3]:5000/my%20master/3"
        f"?sentinel_username=watch&sentinel_password={SECRET}2&socket_timeout=2.5"
    )
    parsed = parse(url)
    assert isinstance(parsed, SentinelURL)
    assert parsed.sentinels == (Address("s1", 26380), Address("s2", 26379),
                                Address("fd00::3", 5000))  # fmt: skip
    assert (parsed.service, parsed.db, parsed.tls) == ("my master", 3, False)
    assert (parsed.username, parsed.password) == ("app", SECRET)
    assert (parsed.sentinel_username, parsed.sentinel_password) == ("watch", SECRET + "2")
    assert parsed.options == {"socket_timeout": 2.5}
    assert parsed.master_kwargs() == {
        "db": 3, "socket_timeout": 2.5, "username": "app", "password": SECRET,
    }  # fmt: skip
    assert parsed.sentinel_kwargs() == {
        "socket_timeout": 2.5, "username": "watch", "password": SECRET + "2",
    }  # fmt: skip
    assert str(parsed.sentinels[2]) == "[fd00::3]:5000"
    assert describe(parsed) == (
        "service 'my master' (db 3) via sentinels s1:26380,s2:26379,[fd00::3]:5000"
    )
    assert SECRET not in repr(parsed)


def test_defaults_and_tls_of_a_sentinel_url(tmp_path: Path) -> None:
    parsed = parse("redis+sentinel://s1/mymaster")
    assert isinstance(parsed, SentinelURL)
    assert parsed.sentinels == (Address("s1", 26379),) and parsed.db == 0
    assert (parsed.username, parsed.password, parsed.sentinel_password) == (None, None, None)
    assert parsed.master_kwargs() == {"db": 0} and parsed.sentinel_kwargs() == {}
    ca = tmp_path / "ca.pem"
    ca.write_text("")
    tls = parse(f"rediss+sentinel://:pw@s1:1,s2:2/m/1?ssl_ca_certs={ca}&ssl_cert_reqs=required")
    assert isinstance(tls, SentinelURL) and tls.tls
    assert (tls.username, tls.password) == (None, "pw")
    assert tls.master_kwargs()["ssl"] is True
    assert tls.sentinel_kwargs() == {
        "ssl": True, "ssl_ca_certs": str(ca), "ssl_cert_reqs": "required",
    }  # fmt: skip
    assert parse("redis+sentinel://s1/m/").db == 0  # a trailing slash is no db
    assert parse(parse("redis+sentinel://s1/m")) == parse("redis+sentinel://s1/m")


def test_a_cluster_url_names_any_nodes_of_the_cluster(tmp_path: Path) -> None:
    parsed = parse(f"redis+cluster://app:{SECRET}@n1:7000,n2,[fd00::5]:7001/0?socket_timeout=2")
    assert isinstance(parsed, ClusterURL)
    assert parsed.nodes == (Address("n1", 7000), Address("n2", 6379), Address("fd00::5", 7001))
    assert (parsed.username, parsed.password, parsed.db, parsed.tls) == ("app", SECRET, 0, False)
    assert parsed.node_kwargs() == {"socket_timeout": 2.0, "username": "app", "password": SECRET}
    assert describe(parsed) == "cluster via n1:7000,n2:6379,[fd00::5]:7001"
    assert SECRET not in repr(parsed)
    (tmp_path / "ca.pem").write_text("")
    tls = parse(f"rediss+cluster://:pw@n1?ssl_ca_certs={tmp_path / 'ca.pem'}")
    assert isinstance(tls, ClusterURL) and tls.tls and tls.node_kwargs()["ssl"] is True
    assert parse("redis+cluster://n1/") == parse("redis+cluster://n1")


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("", "empty"),
        ("127.0.0.1:6379", "no scheme"),
        ("http://h:1/0", "'http://'"),
        ("redis-sentinel://s1/m", "'redis-sentinel://'"),
        ("redis://h/abc", "database number"),
        ("redis://h:port/0", "port"),
        ("redis://h:99999/0", "port"),
        ("redis://h/0?socket_timeout=soon", "socket_timeout"),
        ("redis://h/0?colour=blue", "unknown option 'colour'"),
        ("rediss://h/0?ssl_ca_cert=/ca.pem", "unknown option 'ssl_ca_cert'"),
        ("unix:///run/redis.sock?colour=blue", "unknown option 'colour'"),
        # redis-py's pool option: its connections refused it at each connect
        ("redis://h/0?max_connections=10", "unknown option 'max_connections'"),
        ("redis://h/0?ssl_ca_certs=/ca.pem", "use rediss:// for TLS"),
        ("unix:///run/redis.sock?ssl_cert_reqs=none", "use rediss:// for TLS"),
        ("unix://", "socket's path"),
        ("redis+sentinel:///m", "names no sentinel"),
        ("redis+sentinel://s1:26379", "names no service"),
        ("redis+sentinel://s1:26379/", "names no service"),
        ("redis+sentinel://s1/m/x", "db (after the service) must be a number"),
        ("redis+sentinel://s1/m/0/extra", "/<service> or /<service>/<db>"),
        ("redis+sentinel://s1//0", "names no service"),
        ("redis+sentinel://s1,,s2/m", "sentinel address 2 is empty"),
        ("redis+sentinel://s1:0/m", "sentinel address 1 (s1) has a bad port"),
        ("redis+sentinel://s1,s2:70000/m", "sentinel address 2 (s2) has a bad port"),
        ("redis+sentinel://:1/m", "has no host"),
        ("redis+sentinel://[::1/m", "malformed"),
        ("redis+sentinel://[nothost]:1/m", "no IPv6 address"),
        ("redis+sentinel://fd00::1/m", "IPv6 addresses in [ ]"),
        ("redis+sentinel://s1/m?db=2", "db in its path"),
        ("redis+sentinel://s1/m?colour=blue", "unknown option 'colour'"),
        ("redis+sentinel://s1/m?socket_timeout=soon", "option socket_timeout has a bad value"),
        ("redis+sentinel://s1/m?ssl_ca_certs=/ca.pem", "use rediss+sentinel://"),
        ("redis+sentinel://s1/m?=x", "malformed"),
        ("redis+sentinel://s1/m#frag", "fragment"),
        ("redis+cluster://", "names no node"),
        ("redis+cluster://n1/1", "database 0 only"),
        ("redis+cluster://n1/0/x", "database 0 only"),
        ("redis+cluster://n1,,n2", "node address 2 is empty"),
        ("redis+cluster://n1:0", "node address 1 (n1) has a bad port"),
        ("redis+cluster://n1?db=0", "db as /0"),
        ("redis+cluster://n1?sentinel_password=x", "unknown option 'sentinel_password'"),
        ("redis+cluster://n1?ssl_ca_certs=/ca.pem", "use rediss+cluster://"),
    ],
)
def test_malformed_urls_fail_in_one_line(url: str, says: str) -> None:
    with pytest.raises(RedisURLError, match=None) as caught:
        parse(url)
    message = str(caught.value)
    assert says in message
    assert "\n" not in message
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize("option", ["ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_ca_path"])
def test_a_tls_url_naming_a_missing_file_fails_at_once(tmp_path: Path, option: str) -> None:
    # redis-py would find out at each connect, as "No such file or directory", unnamed.
    missing = tmp_path / "gone.pem"
    for url in [f"rediss://u:{SECRET}@h:6380/0", f"rediss+sentinel://u:{SECRET}@s1/m",
                f"rediss+cluster://u:{SECRET}@n1"]:  # fmt: skip
        with pytest.raises(RedisURLError) as caught:
            parse(f"{url}?ssl_cert_reqs=required&{option}={missing}")
        assert str(caught.value) == (
            f"the Redis URL's {option} names no readable "
            f"{'directory' if option == 'ssl_ca_path' else 'file'}: {missing}"
        )
        assert SECRET not in str(caught.value)
    with pytest.raises(ValueError, match=f"{option} names no readable"):
        Streamer("m", redis_url=f"rediss://h:6380/0?{option}={missing}")
    present = tmp_path if option == "ssl_ca_path" else Path(__file__)
    assert parse(f"rediss://h:6380/0?{option}={present}").tls  # type: ignore[union-attr]
    with pytest.raises(RedisURLError, match="use rediss:// for TLS"):
        parse(f"redis://h:6379/0?{option}={missing}")  # not TLS: refused, never read


@pytest.mark.parametrize(
    "url",
    [
        f"redis://user:{SECRET}",  # no host: the password reads as a port
        f"redis+sentinel://user:{SECRET}/m",
        f"redis+sentinel://user:{SECRET}@s1:x/m",
        f"redis+cluster://user:{SECRET}@n1:x",
        f"redis+cluster://user:{SECRET}",
        f"redis+sentinel://user:a/{SECRET}@s1/m",  # an unencoded '/' in the password
        f"redis://user:a#{SECRET}@h/0",
        f"rediss://user:a?{SECRET}@h/0",
        f"redis+sentinel://s1/m?sentinel_password={SECRET}&socket_timeout=x",
        f"redis+sentinel://s1/m?sentinel_pasword={SECRET}",  # a misspelt option
        f"redis://:{SECRET}@h:port/0",
    ],
)
def test_errors_never_show_a_password(url: str) -> None:
    with pytest.raises(RedisURLError) as caught:
        parse(url)
    assert SECRET not in str(caught.value)


def test_logs_show_sentinel_urls_without_their_passwords() -> None:
    url = f"redis+sentinel://app:{SECRET}@s1,s2/m/0?sentinel_password={SECRET}&socket_timeout=1"
    shown = redact_url(url)
    assert SECRET not in shown
    assert shown == "redis+sentinel://app:***@s1,s2/m/0?sentinel_password=***&socket_timeout=1"


def test_a_direct_url_keeps_every_option_redis_py_takes() -> None:
    # The options redis-py's connections take, whatever their name, as redis-py reads them.
    url = "redis://h/0?socket_timeout=2&client_name=app&health_check_interval=5&password=pw"
    assert parse(url).password == "pw"  # type: ignore[union-attr]
    assert parse("rediss://h/0?ssl_cert_reqs=none&ssl_check_hostname=false").tls
    assert parse("unix:///run/redis.sock?db=2&socket_timeout=1").db == 2


def test_a_streamer_refuses_an_unknown_option_when_made() -> None:
    # It was taken, and every call then failed with redis-py's TypeError about a keyword.
    with pytest.raises(RedisURLError, match="unknown option 'colour'"):
        Streamer("m", redis_url=f"redis://:{SECRET}@h:6379/0?colour=blue")
