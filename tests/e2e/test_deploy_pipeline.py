"""The pipeline's compose files: docker-compose.pipeline.yml (and its -cpu variant) on top of
docker-compose.yml, validated as tests/e2e/test_deploy.py validates the others: docker-compose
1.29 interpolates them, the Compose Specification's schema checks them, and the commands of the
interpolated config run here as local processes (redis with the ACL users, the functions, one
worker per stage, the gateway) and serve a real request through the pipeline."""

from __future__ import annotations

import importlib.util
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from broker.devserver import free_port
from examples.pipeline_demo import in_process
from examples.pipelines import Sentiment
from gpu_worker.pipeline import load_pipeline
from tests.e2e.test_deploy import (
    BIN,
    CPU_FILES,
    PASSWORD_VARS,
    ROOT,
    LocalStack,
    acl_refusals,
    compose,
    compose_config,
    dockerfile_entrypoint,
    http,
    seconds,
    service_env,
    wait_until,
)

PIPELINE_FILES = ["docker-compose.yml", "docker-compose.pipeline.yml"]
PIPELINE_CPU_FILES = [*CPU_FILES, "docker-compose.pipeline.yml", "docker-compose.pipeline-cpu.yml"]
TEXTS = ["The soup was delicious and the staff were lovely.", "My laptop crashed twice today."]


def stage_services(services: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The services that start (no profile) and run a stage: ``--stage`` in their command."""
    return {
        name: service
        for name, service in services.items()
        if "--stage" in (service.get("command") or []) and not service.get("profiles")
    }


def option(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


@pytest.mark.parametrize(
    "files", [PIPELINE_FILES, PIPELINE_CPU_FILES], ids=["pipeline", "pipeline-cpu"]
)
def test_the_pipeline_compose_files_are_valid_and_env_example_holds_their_defaults(
    files: list[str], tmp_path: Path
) -> None:
    empty = tmp_path / "empty.env"
    empty.touch()
    merged = compose(files, "config", env_file=str(empty))
    assert merged == compose(files, "config", env_file=str(ROOT / ".env.example"))
    (tmp_path / "merged.yml").write_text(merged)
    done = subprocess.run(
        [str(BIN / "check-jsonschema"), "--builtin-schema", "vendor.compose-spec",
         *(str(ROOT / name) for name in files), str(tmp_path / "merged.yml")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize(
    "files", [PIPELINE_FILES, PIPELINE_CPU_FILES], ids=["pipeline", "pipeline-cpu"]
)
def test_every_stage_of_the_served_pipeline_has_one_worker_service(
    files: list[str], tmp_path: Path
) -> None:
    services = compose_config(files, {}, tmp_path)["services"]
    gateway = services["gateway"]["command"]
    served = [gateway[i + 1] for i, arg in enumerate(gateway) if arg == "--model"]
    assert served[0] == "examples.mlp:MLP"  # the plain model of docker-compose.yml stays
    pipeline = load_pipeline(served[1])
    stages = stage_services(services)
    by_stage = {option(s["command"], "--stage"): s for s in stages.values()}
    assert len(by_stage) == len(stages)
    assert set(by_stage) == {stage.name for stage in pipeline.stages}  # type: ignore[union-attr]
    for name, service in stages.items():
        command = service["command"]
        assert option(command, "--model") == served[1]
        assert option(command, "--prefix") == option(gateway, "--prefix")
        assert service["build"]["args"]["EXTRAS"] == "worker,examples"
        assert "entrypoint" not in service and service["image"].endswith("-examples")
        assert service["environment"]["REDIS_URL"].startswith("redis://default-worker:")
        for dependency in ("redis", "functions"):
            assert dependency in service["depends_on"], name
        graceful = float(service["environment"]["MICROBATCH_WORKER_GRACEFUL_TIMEOUT"])
        assert seconds(service["stop_grace_period"]) > graceful
        assert service["environment"]["MICROBATCH_WORKER_METRICS_PORT"] == "9100"
    assert services["gateway"]["build"]["args"]["EXTRAS"] == "gateway,examples"
    # the embedder on the GPU where there is one; the head, one small product per batch, on
    # the CPU
    gpu = "--cuda" in by_stage["embedder"]["command"]
    assert gpu == (files == PIPELINE_FILES)
    assert ("deploy" in by_stage["embedder"]) == gpu
    assert "--cuda" not in by_stage["classifier"]["command"]
    assert "deploy" not in by_stage["classifier"]
    if not gpu:
        assert services["pipeline-embedder"]["profiles"] == ["gpu"]
        assert by_stage["classifier"]["image"] == by_stage["embedder"]["image"]


@pytest.fixture(scope="module")
def pipeline_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """redis, the functions, a worker per stage and a gateway, run from the commands of the
    CPU pipeline compose files (images' entrypoints + compose options), each as its ACL user."""
    tmp_path = tmp_path_factory.mktemp("pipeline-stack")
    passwords = {name: uuid.uuid4().hex for name in PASSWORD_VARS}
    env = {**passwords, "MICROBATCH_GATEWAY_WORKERS": "1"}
    services = compose_config(PIPELINE_CPU_FILES, env, tmp_path)["services"]
    local = LocalStack(tmp_path, services)
    processes = local.processes
    redis_port, admin = local.start_redis(passwords)
    try:
        wait_until(admin.ping, "redis-server", processes, 10)
        done = local.load_functions(redis_port)
        assert done.returncode == 0, done.stderr
        for name, service in stage_services(services).items():
            worker_env = service_env(service, redis_port)
            worker_env["MICROBATCH_WORKER_METRICS_PORT"] = str(free_port())
            local.start(name, [*dockerfile_entrypoint("Dockerfile.worker"), *service["command"]],
                        worker_env)  # fmt: skip
        base, _ = local.start_gateway(redis_port)
        for stage in ("embedder", "classifier"):
            keys = Sentiment.keys(stage, "default")
            wait_until(lambda keys=keys: admin.exists(keys.consumers) == 1,
                       f"a worker of stage {stage}", processes, 240)  # fmt: skip
        wait_until(lambda: http(f"{base}/v2/models/sentiment/ready", timeout=2)[0] == 200,
                   "the gateway to see the pipeline's workers", processes, 60)  # fmt: skip
        yield {"base": base, "admin": admin}
    except BaseException:
        local.dump_logs()
        raise
    finally:
        local.stop(30)
        admin.close()


@pytest.mark.slow  # the real embedder and head, loaded by two workers
@pytest.mark.skipif(
    not importlib.util.find_spec("sentence_transformers"),
    reason="pip install 'microbatch[examples]'",
)
def test_the_pipeline_compose_commands_serve_a_request_with_acl_users(
    pipeline_stack: dict[str, Any],
) -> None:
    status, body = http(
        f"{pipeline_stack['base']}/v1/models/sentiment/predict", {"inputs": TEXTS}, timeout=120
    )
    assert status == 200, body
    expected = in_process(Sentiment, TEXTS)
    assert [answer["label"] for answer in body["outputs"]] == [e["label"] for e in expected]
    for answer, reference in zip(body["outputs"], expected, strict=True):
        np.testing.assert_allclose(answer["scores"], reference["scores"], atol=1e-4)
    # every side (the stage workers forwarding to the next stage's stream among them) stayed
    # within its ACL user's rights
    assert not acl_refusals(pipeline_stack["admin"])
