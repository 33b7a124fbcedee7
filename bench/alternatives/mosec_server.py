"""mosec with dynamic batching (max batch BENCH_BATCH_SIZE, max wait BENCH_MAX_WAIT_MS).

    python -m bench.alternatives.mosec_server --port PORT --timeout 60000
POST /inference with the same JSON body as every other arm.
"""

from __future__ import annotations

from typing import Any

from mosec import Server, Worker

from bench.alternatives.common import (
    BATCH_SIZE,
    MAX_WAIT_S,
    BatchLog,
    decode_item,
    encode_outputs,
    load_model,
)


class Inference(Worker):
    def __init__(self) -> None:
        super().__init__()
        self.model = load_model()
        self.log = BatchLog()

    def forward(self, data: list[Any]) -> list[Any]:
        # one request per entry (each with one item, like every arm's payload)
        items = [decode_item(request["inputs"][0]) for request in data]
        self.log(len(items))
        return [encode_outputs([output]) for output in self.model.predict(items)]


if __name__ == "__main__":
    server = Server()
    server.append_worker(
        Inference, num=1, max_batch_size=BATCH_SIZE, max_wait_time=max(1, int(MAX_WAIT_S * 1000))
    )
    server.run()
