"""service_streamer's README, step 3: a Flask app whose model is batched by ThreadedStreamer."""

import os

from flask import Flask, jsonify, request
from service_streamer import ThreadedStreamer
from text_model import TextModel

app = Flask(__name__)
model = TextModel()
streamer = ThreadedStreamer(model.predict, batch_size=64, max_latency=0.1)


@app.route("/naive", methods=["GET", "POST"])
def naive_predict():
    inputs = request.args.getlist("s") if request.method == "GET" else request.form.getlist("s")
    outputs = model.predict(inputs)
    return jsonify(outputs)


@app.route("/stream", methods=["POST"])
def stream_predict():
    inputs = request.form.getlist("s")
    outputs = streamer.predict(inputs)
    return jsonify(outputs)


@app.route("/batches", methods=["GET"])
def batches():
    return jsonify(max(model.batch_sizes or [0]))


if __name__ == "__main__":
    app.run(port=int(os.environ["PORT"]), debug=False, threaded=True)
