"""service_streamer 0.1.2: RedisWorker processes (run_redis_workers_forever) for RedisStreamer.

python -m bench.alternatives.ss_redis_worker HOST:PORT PREFIX
"""

from __future__ import annotations

import sys

from service_streamer import ManagedModel, run_redis_workers_forever

from bench.alternatives.common import BATCH_SIZE, MAX_WAIT_S, BatchLog, load_model


class Model(ManagedModel):
    def init_model(self) -> None:
        self.model = load_model()
        self.log = BatchLog()

    def predict(self, batch: list) -> list:
        self.log(len(batch))
        return list(self.model.predict(batch))


if __name__ == "__main__":
    run_redis_workers_forever(
        Model, BATCH_SIZE, MAX_WAIT_S, worker_num=1, redis_broker=sys.argv[1], prefix=sys.argv[2]
    )
