"""service_streamer's FAQ: one RedisStreamer per prefix, each answered by its own workers."""

import json
import os

from service_streamer import RedisStreamer

broker = os.environ["REDIS_BROKER"]
streamer_1 = RedisStreamer(redis_broker=broker, prefix=os.environ["PREFIX_1"])
streamer_2 = RedisStreamer(redis_broker=broker, prefix=os.environ["PREFIX_2"])

batch = ["hello redis", "one two three", "service streamer"]
output_1 = streamer_1.predict(batch)
output_2 = streamer_2.predict(batch)
futures = [streamer_1.submit([s]) for s in batch] + [streamer_2.submit([s]) for s in batch]
print(
    json.dumps(
        {"output_1": output_1, "output_2": output_2, "futures": [f.result() for f in futures]}
    )
)
