"""Typical torch code on ThreadedStreamer and Streamer: tensors in (alone, and inside a dict),
tensors out. Prints what the model was given and what the callers got back."""

import json

import torch
from service_streamer import Streamer, ThreadedStreamer


def describe(value):
    if isinstance(value, torch.Tensor):
        return {"tensor": str(value.dtype), "shape": list(value.shape), "data": value.tolist()}
    if isinstance(value, dict):
        return {key: describe(item) for key, item in sorted(value.items())}
    if isinstance(value, (list, tuple)):
        return [describe(item) for item in value]
    if isinstance(value, (str, int, float)):  # already described
        return value
    return {"other": type(value).__name__}


class TensorModel:
    """Doubles each tensor (or each tensor of a dict); answers with tensors and what it saw."""

    def predict(self, batch):
        outputs = []
        for item in batch:
            if isinstance(item, dict):
                doubled = {key: value * 2 for key, value in item.items()}
                outputs.append({"doubled": doubled, "seen": describe(item)})
            else:
                outputs.append({"doubled": item * 2, "seen": describe(item)})
        return outputs


model = TensorModel()

if __name__ == "__main__":
    batch = [
        torch.arange(6, dtype=torch.float32).reshape(2, 3),
        torch.tensor([1, 2, 3], dtype=torch.int64),
        {"ids": torch.tensor([[101, 7592, 102]]), "mask": torch.ones(1, 3, dtype=torch.int32)},
        torch.tensor(1.5, dtype=torch.bfloat16),
    ]
    results = {}
    threaded = ThreadedStreamer(model.predict, 8, 0.01)
    results["threaded"] = describe(threaded.predict(batch))
    results["threaded_future"] = describe(threaded.submit(batch[:2]).result())
    threaded.destroy_workers()
    streamer = Streamer(model.predict, 8, 0.01, worker_num=1)
    results["streamer"] = describe(streamer.predict(batch))
    streamer.destroy_workers()
    print(json.dumps(results))
