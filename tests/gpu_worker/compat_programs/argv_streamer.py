"""A program that parses its command line at module level (a required option), then serves a
predict function with Streamer: the spawned workers import this module again and must see the
program's own arguments to get past argparse."""

import argparse
import json

from service_streamer import Streamer
from text_model import TextModel

parser = argparse.ArgumentParser()
parser.add_argument("--suffix", required=True)
args = parser.parse_args()
model = TextModel(args.suffix)

if __name__ == "__main__":
    streamer = Streamer(model.predict, 8, 0.05, worker_num=1)
    outputs = streamer.predict(["hello world", "the arguments reach the workers"])
    streamer.destroy_workers()
    print(json.dumps({"outputs": outputs}))
