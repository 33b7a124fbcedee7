"""TLS (rediss://) end to end, as docs/deployment.md sets it up: a redis-server with a tls-port
and a certificate of a local CA, each side logged in as its own ACL user."""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import pytest

from broker import Streamer, acl, functions
from broker.devserver import RedisServer, free_port
from tests.conftest import worker_process
from tests.gpu_worker.test_devices import run_worker_cli

# Passwords with the characters a URL must percent-encode (docs/deployment.md).
PASSWORDS = {"GATEWAY": "g@te:w/ay%pw?#", "WORKER": "w0rker-s3cret"}


@dataclass
class TLSRedis:
    """A redis-server that also listens with TLS, and the files its clients need."""

    server: RedisServer
    tls_port: int
    ca: Path  # the CA that signed the server's certificate
    other_ca: Path  # a CA that did not

    def url(self, role: str, ca: Path | None = None) -> str:
        """The rediss:// URL of the prefix's ``role`` user (the prefix is ``tls``)."""
        password = quote(PASSWORDS[role], safe="")
        return (
            f"rediss://tls-{role.lower()}:{password}@localhost:{self.tls_port}/0"
            f"?ssl_cert_reqs=required&ssl_ca_certs={ca or self.ca}"
        )


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def make_ca(path: Path, name: str) -> tuple[Path, Path]:
    key, cert = path / f"{name}.key", path / f"{name}.pem"
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
            str(cert), "-days", "2", "-subj", f"/CN={name}")  # fmt: skip
    return key, cert


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TLSRedis]:
    path = tmp_path_factory.mktemp("tls")
    ca_key, ca = make_ca(path, "ca")
    _, other_ca = make_ca(path, "other-ca")
    key, csr, cert = path / "server.key", path / "server.csr", path / "server.pem"
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr),
            "-subj", "/CN=localhost")  # fmt: skip
    (path / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
            "-CAcreateserial", "-out", str(cert), "-days", "2", "-extfile",
            str(path / "san.ext"))  # fmt: skip
    tls_port = free_port()
    config = {"tls-port": str(tls_port), "tls-cert-file": str(cert), "tls-key-file": str(key),
              "tls-ca-cert-file": str(ca), "tls-auth-clients": "no"}  # fmt: skip
    with RedisServer(config) as server:  # the plain port is the test's own (default user)
        admin = server.client()
        admin.execute_command(*functions.LOAD_COMMAND)  # the operator's job
        env = {f"PW_{role}": password for role, password in PASSWORDS.items()}
        lines, _ = acl.render(["tls"], password_env="PW_{ROLE}", environ=env)
        for line in lines:  # a selector in parentheses is one rule
            admin.execute_command("ACL", "SETUSER", *re.findall(r"\([^)]*\)|\S+", line)[1:])
        admin.close()
        yield TLSRedis(server, tls_port, ca, other_ca)


def test_workers_and_callers_serve_over_tls_as_their_acl_users(tls_redis: TLSRedis) -> None:
    admin = tls_redis.server.client()
    admin.acl_log_reset()
    with (
        worker_process(tls_redis.url("WORKER"), "tests.models:Toy", "tls"),
        Streamer("toy", redis_url=tls_redis.url("GATEWAY"), prefix="tls") as streamer,
    ):
        assert streamer.predict([{"x": 1}, {"x": 2}])[1]["item"] == {"x": 2}
    assert admin.acl_log() == []  # nothing refused to either user
    admin.close()


def test_a_worker_given_the_wrong_ca_stops_at_once_in_one_line(tls_redis: TLSRedis) -> None:
    """A certificate that fails verification will not pass it later: the worker waited out
    --redis-wait (60 s) as for a Redis still starting."""
    url = tls_redis.url("WORKER", ca=tls_redis.other_ca)
    started = time.monotonic()
    result = run_worker_cli("--model", "tests.models:Toy", "--redis", url, "--prefix", "tls",
                            env={"MICROBATCH_WORKER_REDIS_WAIT": "40"})  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert time.monotonic() - started < 30
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(
        f"Error: Redis at rediss://tls-worker:***@localhost:{tls_redis.tls_port}/0?"
    )
    assert "presented a TLS certificate that failed verification" in line
    assert "CERTIFICATE_VERIFY_FAILED" in line and PASSWORDS["WORKER"] not in line
