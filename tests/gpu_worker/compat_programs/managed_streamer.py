"""service_streamer's README, step 4 and "Distributed GPU worker": Streamer with a ManagedModel
on cuda_devices, and Streamer with a plain predict function; predict and the Future API."""

import json
import os

from service_streamer import ManagedModel, Streamer
from text_model import TextModel, record


class ManagedTextModel(ManagedModel):
    def init_model(self, suffix=""):
        self.model = TextModel(suffix)
        record(
            os.environ.get("RECORD_DIR"),
            gpu_id=self.gpu_id,
            visible=os.environ.get("CUDA_VISIBLE_DEVICES"),
        )

    def predict(self, batch):
        return self.model.predict(batch)


model = TextModel("~")

if __name__ == "__main__":
    batch = ["twinkle twinkle little star", "Happy birthday to you", "the answer to life"]
    streamer = Streamer(
        ManagedTextModel,
        64,
        0.1,
        worker_num=4,
        cuda_devices=(0, 1),
        model_init_kwargs={"suffix": "!"},
    )
    outputs = streamer.predict(batch)
    futures = [streamer.submit([s, s + " again"]) for s in batch * 10]
    future_outputs = [f.result() for f in futures]
    streamer.destroy_workers()

    streamer = Streamer(model.predict, 64, 0.1, worker_num=2)
    function_outputs = streamer.predict(batch)
    streamer.destroy_workers()

    print(json.dumps({"outputs": outputs, "futures": future_outputs, "function": function_outputs}))
