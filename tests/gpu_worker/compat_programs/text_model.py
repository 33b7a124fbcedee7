"""The model of the service_streamer-style programs: plain Python, deterministic, batched.

Shared by every program (as service_streamer's own examples share bert_model.py), so that the
same programs run under the real service_streamer 0.1.2 and under gpu_worker.compat.
"""

import os


class TextModel:
    """Tags each sentence with its word count; records the batch sizes it was given."""

    def __init__(self, suffix=""):
        self.suffix = suffix
        self.batch_sizes = []

    def predict(self, batch):
        self.batch_sizes.append(len(batch))
        outputs = []
        for sentence in batch:
            if isinstance(sentence, list):  # a tokenized sentence: ["How", "are", "you", "?"]
                sentence = " ".join(sentence)
            if sentence == "boom":
                raise ValueError("the model refuses 'boom'")
            outputs.append(f"{len(sentence.split())}:{sentence.upper()}{self.suffix}")
        return outputs


def record(directory, **fields):
    """Write one JSON line about this worker process (for the tests to compare)."""
    import json

    if directory:
        with open(os.path.join(directory, f"worker-{os.getpid()}.json"), "w") as out:
            json.dump(fields, out)
