"""service_streamer's README, "Future API": 200 submits to a ThreadedStreamer, then results."""

import json

from service_streamer import ThreadedStreamer
from text_model import TextModel

model = TextModel()
streamer = ThreadedStreamer(model.predict, 64, 0.1)

xs = []
for i in range(200):
    future = streamer.submit([["How", "are", "you", "?"], ["Fine", "."], ["Thank", "you", str(i)]])
    xs.append(future)

results = []
for future in xs:
    outputs = future.result()
    results.append(outputs)

print(json.dumps({"results": results, "batched": max(model.batch_sizes) > 1}))
streamer.destroy_workers()
