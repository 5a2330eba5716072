"""``recsys-serve LOCATION``: an HTTP server that scores raw rows with the model a training job
publishes at LOCATION (a path or ``s3://...`` URL), following it as it is republished
(``follow.py``).

Built on Starlette (routing, requests, responses) served by uvicorn: see docs/online.md for the
choice. Endpoints:

- ``POST /score``: rows as JSON (``{"rows": [{column: value, ...}, ...]}``, optional
  ``"activation"``) or as an Arrow IPC stream (content type
  ``application/vnd.apache.arrow.stream``; ``?activation=`` in the query). The answer is JSON
  ``{"scores": [[...], ...], "outputs": [...], "step", "content_hash", "sequence"}`` (one list
  per row, one score per output), or an Arrow IPC stream (one column per output, the model in
  ``X-Model-*`` headers) when the request accepts ``application/vnd.apache.arrow.stream``.
  Rows the model cannot read are a 400 with the scorer's ``DataError`` message (the column and
  row it names); no model yet is a 503.
- ``GET /health``: 200 when a model is served, else 503; the follower's last error either way.
- ``GET /model``: what is served (step, content hash, window, window time, sequence,
  published/loaded times, base and applied deltas) and the follower's state.

Scoring runs in the threadpool, off the event loop, so health and model requests (and the
follower's polling thread) are answered while a large request scores. SIGTERM: uvicorn stops
accepting connections, lets in-flight requests finish (up to ``--graceful-s``), and the process
exits 0.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import pyarrow as pa
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from recsys_trainer.data.errors import DataError
from recsys_trainer.serving.runtime.follow import Follower, NoModelError, Served

logger = logging.getLogger(__name__)

ARROW_STREAM = "application/vnd.apache.arrow.stream"
OPTIONS_ENV = "RECSYS_SERVE_OPTIONS"
"""How ``--workers N`` (N > 1) hands the options to each worker process's app factory."""


class BadRequest(ValueError):
    """A request body that is not what ``/score`` reads; a 400 with this message."""


def _error(status: int, error: str, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"error": error, "message": message, **extra}, status_code=status)


def _rows_of(body: bytes, content_type: str, query_activation: str | None,
             ) -> tuple[Any, str | None]:
    """The rows and the activation a ``/score`` body asks for."""
    if content_type == ARROW_STREAM:
        try:
            with pa.ipc.open_stream(pa.py_buffer(body)) as reader:
                table = reader.read_all()
        except (pa.ArrowInvalid, OSError) as e:
            raise BadRequest(f"the body is not an Arrow IPC stream ({e}).") from None
        return table, query_activation
    if content_type not in ("application/json", ""):
        raise BadRequest(f"content type {content_type!r} is not read: send JSON "
                         f"(application/json) or an Arrow IPC stream ({ARROW_STREAM}).")
    try:
        payload = json.loads(body)
    except (UnicodeDecodeError, ValueError) as e:
        raise BadRequest(f"the body is not JSON ({e}).") from None
    if not isinstance(payload, dict) or not isinstance(payload.get("rows"), list):
        raise BadRequest('the body must be a JSON object {"rows": [{column: value, ...}, ...]}.')
    rows = payload["rows"]
    bad = next((i for i, r in enumerate(rows) if not isinstance(r, dict)), None)
    if bad is not None:
        raise BadRequest(f"row {bad} is not a JSON object (rows are {{column: value}} objects).")
    activation = payload.get("activation", query_activation)
    if activation is not None and not isinstance(activation, str):
        raise BadRequest("'activation' must be 'sigmoid' or 'none'.")
    return rows, activation


def _score(follower: Follower, body: bytes, content_type: str, activation: str | None,
           ) -> tuple[np.ndarray, Served]:
    """Decode and score (in the threadpool: both can take a while)."""
    rows, act = _rows_of(body, content_type, activation)
    scores, served = follower.score_with_model(rows, activation=act)
    return scores.reshape(len(scores), len(served.scorer.output_names)), served


def _finite_lists(scores: np.ndarray) -> list[list[float | None]]:
    if np.isfinite(scores).all():
        return scores.tolist()  # type: ignore[no-any-return]
    return [[v if math.isfinite(v) else None for v in row] for row in scores.tolist()]


def _model_headers(served: Served) -> dict[str, str]:
    return {"X-Model-Step": str(served.step), "X-Model-Content-Hash": served.content_hash,
            "X-Model-Sequence": str(served.sequence)}


def create_app(follower: Follower, *, start_follower: bool = True,
               max_body_bytes: int = 64 << 20) -> Starlette:
    """The ASGI app serving ``follower`` (started and stopped with the app when
    ``start_follower``)."""

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if start_follower:
            follower.start()
        try:
            yield
        finally:
            if start_follower:
                await run_in_threadpool(follower.stop)

    async def score(request: Request) -> Response:
        content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        # Refused before it is read where the client says its size; a body without one (chunked)
        # is read in pieces and refused once it passes the limit, never held whole first.
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_body_bytes:
            return _error(413, "TooLarge", f"the body is {declared} bytes; at most "
                          f"{max_body_bytes} are read (--max-body-mb).")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body_bytes:
                return _error(413, "TooLarge", f"the body is over {max_body_bytes} bytes; at "
                              f"most {max_body_bytes} are read (--max-body-mb).")
            chunks.append(chunk)
        body = b"".join(chunks)
        try:
            scores, served = await run_in_threadpool(
                _score, follower, body, content_type, request.query_params.get("activation"))
        except BadRequest as e:
            return _error(415 if "content type" in str(e) else 400, "BadRequest", str(e))
        except DataError as e:
            return _error(400, "DataError", str(e), column=e.column, row=e.row)
        except NoModelError as e:
            return _error(503, "NoModel", str(e))
        except ValueError as e:  # e.g. an unknown activation
            return _error(400, "BadRequest", str(e))
        names = list(served.scorer.output_names)
        if ARROW_STREAM in request.headers.get("accept", ""):
            table = pa.table({n: pa.array(scores[:, i]) for i, n in enumerate(names)})
            sink = pa.BufferOutputStream()
            with pa.ipc.new_stream(sink, table.schema) as writer:
                writer.write_table(table)
            return Response(sink.getvalue().to_pybytes(), media_type=ARROW_STREAM,
                            headers=_model_headers(served))
        return JSONResponse({"scores": _finite_lists(scores), "outputs": names,
                             "step": served.step, "content_hash": served.content_hash,
                             "sequence": served.sequence}, headers=_model_headers(served))

    def state() -> dict[str, Any]:
        error = follower.last_error
        return {"location": follower.location, "poll_s": follower.poll_s,
                "last_poll": follower.last_poll, "swaps": follower.swaps,
                "last_error": None if error is None else error.to_json()}

    async def health(request: Request) -> Response:
        served = follower.served
        stalled = follower.stalled_s()
        status = "stalled" if stalled is not None else "no model" if served is None else "ok"
        body: dict[str, Any] = {"status": status, **state()}
        if stalled is not None:
            # /score still answers with the last model; health says it is no longer followed.
            body["stalled_s"] = round(stalled, 1)
        if served is not None:
            body.update(step=served.step, content_hash=served.content_hash,
                        sequence=served.sequence, window=served.window,
                        window_time=served.window_time, loaded_at=served.loaded_at)
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    async def model(request: Request) -> Response:
        served = follower.served
        if served is None:
            return JSONResponse({"error": "NoModel", "message": "no model is served yet.",
                                 **state()}, status_code=503)
        return JSONResponse({**served.to_json(), "now": time.time(), **state()})

    return Starlette(routes=[Route("/score", score, methods=["POST"]),
                             Route("/health", health, methods=["GET"]),
                             Route("/model", model, methods=["GET"])],
                     lifespan=lifespan)


def app_from_env() -> Starlette:
    """The app factory each worker process of ``--workers N`` calls (options in
    ``RECSYS_SERVE_OPTIONS``)."""
    opts = json.loads(os.environ[OPTIONS_ENV])
    _setup_logging(opts["log_level"])  # a worker is a fresh interpreter
    return create_app(Follower(opts["location"], poll_s=opts["poll_s"], verify=opts["verify"]),
                      max_body_bytes=opts["max_body_bytes"])


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s [%(process)d] "
                        "%(name)s: %(message)s")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="recsys-serve",
        description="Score raw rows over HTTP with the model published at LOCATION, following "
                    "it as the training job republishes it (docs/online.md).")
    p.add_argument("location", metavar="LOCATION",
                   help="the published location: a directory or a URL such as s3://bucket/prefix")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8080, help="port (default: %(default)s)")
    p.add_argument("--poll-s", type=float, default=2.0,
                   help="seconds between polls of the pointer (default: %(default)s)")
    p.add_argument("--workers", type=int, default=1,
                   help="server processes, each with its own follower and model copy "
                        "(default: %(default)s)")
    p.add_argument("--graceful-s", type=float, default=30.0,
                   help="on SIGTERM, seconds in-flight requests get to finish (default: %(default)s)")
    p.add_argument("--max-body-mb", type=float, default=64.0,
                   help="largest /score body read (default: %(default)s)")
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="do not check artifacts' sha256 against their manifests on load")
    p.add_argument("--access-log", action="store_true", help="log every request")
    p.add_argument("--log-level", default="info", help="default: %(default)s")
    args = p.parse_args(argv)
    if args.poll_s <= 0:
        p.error("--poll-s must be > 0")
    if args.workers < 1:
        p.error("--workers must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    import uvicorn

    args = parse_args(argv)
    _setup_logging(args.log_level)
    # uvicorn handles SIGTERM (stop accepting, finish in-flight requests, run the shutdown) and
    # then re-raises it to the handler that was there before it: this one, so that a graceful
    # stop exits 0 rather than dying of the signal.
    signal.signal(signal.SIGTERM, lambda sig, frame: None)
    common: dict[str, Any] = {
        "host": args.host, "port": args.port, "log_config": None,
        "log_level": args.log_level.lower(), "access_log": args.access_log,
        "timeout_graceful_shutdown": max(1, math.ceil(args.graceful_s))}
    max_body = int(args.max_body_mb * (1 << 20))
    logger.info("recsys-serve: following %s, polling every %.1f s, on http://%s:%d",
                args.location, args.poll_s, args.host, args.port)
    if args.workers == 1:
        follower = Follower(args.location, poll_s=args.poll_s, verify=args.verify)
        uvicorn.run(create_app(follower, max_body_bytes=max_body), **common)
    else:
        os.environ[OPTIONS_ENV] = json.dumps({
            "location": args.location, "poll_s": args.poll_s, "verify": args.verify,
            "max_body_bytes": max_body, "log_level": args.log_level})
        uvicorn.run("recsys_trainer.serving.runtime.server:app_from_env", factory=True,
                    workers=args.workers, **common)
    return 0


__all__ = ["ARROW_STREAM", "BadRequest", "OPTIONS_ENV", "app_from_env", "create_app", "main",
           "parse_args"]


if __name__ == "__main__":
    sys.exit(main())
