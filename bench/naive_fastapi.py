"""The "naive" server users start from: FastAPI calling the model once per request.

    uvicorn bench.naive_fastapi:app --port 8001

One process, the model loaded at import, a plain ``def`` endpoint (FastAPI runs it in its
thread pool) with a pydantic body, one forward pass per request. bench/http_bench.py compares
the gateway with it; the harness (python -m bench) runs it from its own virtualenv with
BENCH_MODEL (default ``examples.mlp:MLP``) and BENCH_TORCH_THREADS set.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from fastapi import FastAPI
from pydantic import BaseModel

from gpu_worker import load_model_class


class PredictRequest(BaseModel):
    inputs: list[list[float]]


if "BENCH_TORCH_THREADS" in os.environ:
    import torch

    torch.set_num_threads(int(os.environ["BENCH_TORCH_THREADS"]))
model = load_model_class(os.environ.get("BENCH_MODEL", "examples.mlp:MLP"))()
model.init_model()
app = FastAPI(title="naive model server")


@app.post("/predict")
def predict(request: PredictRequest) -> dict[str, Any]:
    outputs = model.predict(request.inputs)
    return {"outputs": [np.asarray(output).tolist() for output in outputs]}
