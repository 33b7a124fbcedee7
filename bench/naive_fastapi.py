"""The "naive" server users start from: FastAPI calling the model once per request.

    uvicorn bench.naive_fastapi:app --port 8001

One process, the model loaded at import, a plain ``def`` endpoint (FastAPI runs it in its
thread pool) with a pydantic body, one forward pass per request. bench/http_bench.py compares
the gateway with it.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from examples.mlp import MLP


class PredictRequest(BaseModel):
    inputs: list[list[float]]


model = MLP()
model.init_model()
app = FastAPI(title="naive MLP server")


@app.post("/predict")
def predict(request: PredictRequest) -> dict[str, Any]:
    outputs = model.predict(request.inputs)
    return {"outputs": [output.tolist() for output in outputs]}
