"""LitServe with dynamic batching (max_batch_size and batch_timeout from BENCH_*).

    python -m bench.alternatives.litserve_server PORT
POST /predict with the same JSON body as every other arm.
"""

import inspect
import sys
from typing import Any

import litserve as ls

from bench.alternatives.common import (
    BATCH_SIZE,
    MAX_WAIT_S,
    BatchLog,
    decode_item,
    encode_outputs,
    load_model,
)


class API(ls.LitAPI):
    def setup(self, device: str) -> None:
        self.model = load_model()
        self.log = BatchLog()

    def decode_request(self, request):  # type: ignore[no-untyped-def]  # LitServe reads the
        # annotation to build the endpoint: none means "the JSON body"
        return decode_item(request["inputs"][0])

    def batch(self, inputs: list[Any]) -> list[Any]:
        return list(inputs)

    def predict(self, batch: list[Any]) -> list[Any]:
        self.log(len(batch))
        return list(self.model.predict(batch))

    def unbatch(self, output: list[Any]) -> list[Any]:
        return list(output)

    def encode_response(self, output: Any) -> dict[str, Any]:
        return encode_outputs([output])


def main() -> None:
    batching = {"max_batch_size": BATCH_SIZE, "batch_timeout": MAX_WAIT_S}
    # newer LitServe takes the batching settings on the LitAPI, older ones on the LitServer
    if "max_batch_size" in inspect.signature(ls.LitAPI.__init__).parameters:
        api, server_kwargs = API(**batching), {}
    else:
        api, server_kwargs = API(), batching
    server = ls.LitServer(api, accelerator="cpu", workers_per_device=1, timeout=60, **server_kwargs)
    run = {"port": int(sys.argv[1])}
    if "generate_client_file" in inspect.signature(server.run).parameters:
        run["generate_client_file"] = False
    server.run(**run, log_level="warning")


if __name__ == "__main__":
    main()
