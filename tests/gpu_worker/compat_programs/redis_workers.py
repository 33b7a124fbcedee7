"""service_streamer's FAQ: GPU workers serving one prefix of a shared Redis."""

import os

from service_streamer import ManagedModel, run_redis_workers_forever
from text_model import TextModel


class ManagedTagModel(ManagedModel):
    def init_model(self):
        self.model = TextModel(os.environ["MODEL_TAG"])

    def predict(self, batch):
        return self.model.predict(batch)


if __name__ == "__main__":
    from multiprocessing import freeze_support

    freeze_support()
    run_redis_workers_forever(
        ManagedTagModel,
        64,
        0.1,
        worker_num=2,
        redis_broker=os.environ["REDIS_BROKER"],
        prefix=os.environ["PREFIX"],
    )
