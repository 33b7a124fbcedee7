"""End-to-end demo: Redis, one `worker start` process serving the MLP, and a Streamer client.

    python -m examples.demo        (or `make demo`, which also sets everything up)

Uses the Redis at $REDIS_URL when one answers there, else starts a private redis-server on a
free port and stops it afterwards. Requests go through Redis to the worker process and back; the
answers are checked against the model called directly in this process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from concurrent.futures import wait
from contextlib import ExitStack, suppress

import numpy as np
import redis

from broker import ModelKeys, Streamer
from broker.connections import sync_client
from broker.devserver import RedisServer
from examples.mlp import MLP


def redis_answers(url: str) -> bool:
    """True if a Redis server answers PING at ``url`` within a second."""
    client = sync_client(url, socket_connect_timeout=1, socket_timeout=1)
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError, ValueError):
        return False
    finally:
        client.close()


def worker_command() -> list[str]:
    """The `worker` console script of this interpreter's environment (or its module)."""
    script = os.path.join(os.path.dirname(sys.executable), "worker")
    return [script] if os.access(script, os.X_OK) else [sys.executable, "-m", "gpu_worker.cli"]


def delete_keys(url: str, keys: ModelKeys) -> None:
    """Remove what the demo left in a shared Redis (replies and heartbeats expire by themselves)."""
    with sync_client(url) as client:
        client.delete(keys.stream, keys.dead_letters, keys.consumers, keys.cancelled)


def stop_worker(process: subprocess.Popen[bytes]) -> int:
    """SIGTERM the worker's supervisor (it forwards to its children), then kill any straggler."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        with suppress(subprocess.TimeoutExpired):
            process.wait(timeout=30)
    with suppress(ProcessLookupError):  # the worker has its own process group: leave nothing
        os.killpg(process.pid, signal.SIGKILL)
    return process.wait()


def main() -> int:
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # keep order with logs
    with ExitStack() as cleanup:
        # 1. Redis: the one at $REDIS_URL if it answers, else a private one.
        prefix = f"demo-{uuid.uuid4().hex[:8]}"  # our own keys, whatever else shares this Redis
        url = os.environ.get("REDIS_URL", "")
        if url and redis_answers(url):
            print(f"Using the Redis at REDIS_URL={url}")
            cleanup.callback(delete_keys, url, ModelKeys("mlp", prefix))
        else:
            server = cleanup.enter_context(RedisServer())
            url = server.url
            print(f"Started a private redis-server at {url}")

        # 2. A worker process serving examples.mlp:MLP on the CPU.
        args = ["start", "--model", "examples.mlp:MLP", "--redis", url, "--prefix", prefix]
        print("Starting: worker", " ".join(args))
        worker = subprocess.Popen(worker_command() + args, start_new_session=True)
        cleanup.callback(stop_worker, worker)

        # 3. Real requests through Redis (the first waits while the worker loads torch:
        #    wait_for_workers, since loading may take longer than the 10 s NoWorkers grace).
        rng = np.random.default_rng(0)
        inputs = [rng.standard_normal(256).astype(np.float32) for _ in range(4)]
        with Streamer("mlp", redis_url=url, prefix=prefix, wait_for_workers=True) as streamer:
            future = streamer.submit(inputs, timeout=60)
            while not wait([future], timeout=0.5).done:
                if worker.poll() is not None:
                    raise SystemExit(f"the worker exited with code {worker.returncode}")
            outputs = future.result()
        print(f"Sent {len(inputs)} requests of 256 floats; each answer is 16 floats:")
        for index, output in enumerate(outputs):
            print(f"  [{index}]", np.array2string(np.round(output, 3), max_line_width=200))

        # 4. The same inputs through the model called directly, in this process.
        model = MLP()
        model.init_model()
        expected = model.predict(inputs)
        same = all(np.allclose(a, b, atol=1e-5) for a, b in zip(outputs, expected, strict=True))
        print("Matches MLP called directly (allclose):", same)

        # 5. Stop the worker gracefully (ExitStack also stops it, and Redis, on errors).
        code = stop_worker(worker)
        print(f"Worker stopped (exit code {code}).")
        return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
