"""service_streamer 0.1.2: ThreadedStreamer inside Flask (its README's web example).

python -m bench.alternatives.ss_flask PORT
"""

from __future__ import annotations

import sys

from flask import Flask, jsonify, request
from service_streamer import ThreadedStreamer

from bench.alternatives.common import (
    BATCH_SIZE,
    MAX_WAIT_S,
    BatchLog,
    decode_body,
    encode_outputs,
    load_model,
)

model = load_model()
log = BatchLog()


def predict(batch: list) -> list:
    log(len(batch))
    return list(model.predict(batch))


streamer = ThreadedStreamer(predict, batch_size=BATCH_SIZE, max_latency=MAX_WAIT_S)
app = Flask(__name__)


@app.route("/predict", methods=["POST"])
def serve() -> object:
    return jsonify(encode_outputs(streamer.predict(decode_body(request.get_data()))))


if __name__ == "__main__":
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    app.run(host="127.0.0.1", port=int(sys.argv[1]), threaded=True, debug=False)
