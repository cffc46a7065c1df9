"""A protocol double of SGLang's HTTP server, following /work/shared/reference/sglang-http-api.md.

A real HTTP server on 127.0.0.1 (stdlib only, so it also runs as a stand-in
``python -m sglang.launch_server`` through ``main``). Generation is deterministic: the next
token is a function of the whole context, so a request resubmitted with prompt + partial output
continues exactly as an uninterrupted one would; its log-prob is
``-(weight_version + 1) - token / 1000``, so tests can tell which weights produced a token.
Tokens come out ``token_delay_s`` apart, slow enough for a pause to interrupt.

Behaviour taken from the reference: ``/health_generate`` is 503 while starting; ``/generate``
rejects unknown sampling keys with 400 and answers ``meta_info.output_token_logprobs`` triples,
``finish_reason`` dicts and ``weight_version``; a matched stop token is trimmed from
``output_ids`` unless ``no_stop_trim``; ``/pause_generation {"mode": "abort"}`` makes running
requests return HTTP 200 with their partial output and finish type ``abort`` and answers once
they all have (SGLang waits for its model-update lock to drain), and new requests (health
checks included) block until ``/continue_generation``; ``/model_info`` reports the version and
the path of the last successful load; ``/abort_request`` aborts every request whose rid starts
with the given one.

Upstream behaviours an adapter must survive, also followed: ``pause_drains=False`` is an older
SGLang whose pause returns at once, the interrupted answers being built only after
``/continue_generation`` (so they report the post-swap version). ``/update_weights_from_disk``
answers 400 for a path without ``config.json`` without touching the weights, but a checkpoint
that fails part-way (here: one holding a file ``CORRUPT``) leaves the weights partly updated
(``weights`` says ``partial:<path>``) while the version stays. ``version_while_paused=False`` is
SGLang 0.5.6 / 0.5.6.post1, whose update sent while paused loads the weights but keeps the old
``weight_version`` (``/update_weight_version`` sets it). ``/server_info`` reports
``max_req_input_len`` (``None``: no such field); a request of that many input tokens or more
is refused with 400, and ``max_new_tokens`` is cut to ``max_req_input_len + 4 - input``. A rid
already running is refused with 400 (SGLang 0.5.23).
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SAMPLING_KEYS = {
    "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids",
    "ignore_eos", "n", "skip_special_tokens", "no_stop_trim", "sampling_seed",
}  # fmt: skip


def next_token(context: list[int], vocab_size: int) -> int:
    return (sum(context) * 7 + len(context) * 3 + 1) % vocab_size


def token_logprob(token: int, version: str) -> float:
    return -(int(version) + 1) - token / 1000


class SGLangDouble:
    """The double's state and behaviour; ``start()`` serves it over HTTP."""

    def __init__(
        self,
        vocab_size: int = 50,
        token_delay_s: float = 0.01,
        startup_s: float = 0.0,
        weight_version: str = "0",
        eos_id: int | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        model_path: str = "/models/initial",
        pause_drains: bool = True,
        version_while_paused: bool = True,
        max_req_input_len: int | None = None,
    ):
        self.vocab_size = vocab_size
        self.token_delay_s = token_delay_s
        self.eos_id = eos_id
        self.weight_version = weight_version
        self.model_path = model_path  # of the last successful load, as /model_info reports
        self.weights = model_path  # what the weights really are
        self.pause_drains = pause_drains
        self.version_while_paused = version_while_paused
        self.max_req_input_len = max_req_input_len
        self.ready_at = time.monotonic() + startup_s
        self.cond = threading.Condition()
        self.paused = False
        self.running: dict[str, str | bool] = {}  # rid -> False, or the version at its abort
        self.produced: dict[str, int] = {}  # rid -> tokens generated so far
        self.log: list[tuple[str, dict]] = []  # (path, payload) of every POST, in order
        self.server = ThreadingHTTPServer((host, port), _handler(self))
        self.server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> SGLangDouble:
        self._thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        with self.cond:
            self.paused = False
            for rid in self.running:
                self.running[rid] = self.weight_version
            self.cond.notify_all()
        self.server.shutdown()
        self.server.server_close()

    def posts(self, path: str) -> list[dict]:
        return [payload for p, payload in self.log if p == path]

    # endpoints -------------------------------------------------------------------------------

    def _wait_unpaused(self) -> None:
        with self.cond:
            self.cond.wait_for(lambda: not self.paused)

    def health(self) -> tuple[int, dict]:
        if time.monotonic() < self.ready_at:
            return 503, {"message": "starting"}
        self._wait_unpaused()
        return 200, {}

    def generate(self, body: dict) -> tuple[int, dict]:
        params = body.get("sampling_params", {})
        unknown = set(params) - SAMPLING_KEYS
        if unknown:
            return 400, {"error": {"message": f"unknown sampling params {sorted(unknown)}"}}
        if not isinstance(body.get("input_ids"), list) or not body["input_ids"]:
            return 400, {"error": {"message": "input_ids required"}}
        rid = body.get("rid") or f"auto-{len(self.log)}"
        limit = self.max_req_input_len
        if limit is not None and len(body["input_ids"]) >= limit:
            return 400, {"error": {"message": f"input length {len(body['input_ids'])} reaches "
                                              f"max_req_input_len {limit}"}}
        if limit is not None:  # the scheduler's cut of max_new_tokens
            params = {**params, "max_new_tokens": min(params.get("max_new_tokens", 128),
                                                      limit + 4 - len(body["input_ids"]))}
        with self.cond:
            self.cond.wait_for(lambda: not self.paused)
            if rid in self.running:
                return 400, {"error": {"message": f"Duplicate request ID detected: {rid}"}}
            self.running[rid] = False
        context = list(body["input_ids"])
        try:
            return 200, self._run(rid, context, params, body.get("return_logprob", False))
        finally:
            with self.cond:
                self.running.pop(rid, None)
                self.cond.notify_all()

    def _run(self, rid: str, context: list[int], params: dict, return_logprob: bool) -> dict:
        """Decode until stop, length or abort; the answer is built before the request ends."""
        stops = set(params.get("stop_token_ids") or ()) | ({self.eos_id} - {None})
        out, triples, finish = [], [], None
        while finish is None:
            with self.cond:
                # running[rid]: False, or the weight version when it was aborted (the weights
                # the one token it still decodes comes from)
                aborted = self.running[rid]
                version = aborted or self.weight_version
                if aborted and not self.pause_drains:  # the answer is built after the swap
                    self.cond.wait_for(lambda: not self.paused)
            if aborted and not out:
                finish = {"type": "abort", "message": "Abort before prefill"}
                break
            time.sleep(self.token_delay_s)
            token = next_token(context + out, self.vocab_size)
            out.append(token)
            self.produced[rid] = len(out)
            triples.append([token_logprob(token, version), token, None])
            if aborted:  # as SGLang: a running request decodes one more token after an abort,
                # and its finish check sees the abort before any stop that token makes
                finish = {"type": "abort", "message": "Abort in running batch"}
            elif token in stops:
                finish = {"type": "stop", "matched": token}
            elif len(out) >= params.get("max_new_tokens", 128):
                finish = {"type": "length", "length": len(out)}
        output_ids = list(out)
        if finish["type"] == "stop" and not params.get("no_stop_trim"):
            output_ids = output_ids[:-1]
        meta = {
            "id": rid,
            "prompt_tokens": len(context),
            "completion_tokens": len(out),
            "cached_tokens": 0,
            "weight_version": self.weight_version,
            "finish_reason": finish,
        }
        if return_logprob:
            meta["output_token_logprobs"] = triples
        return {"output_ids": output_ids, "meta_info": meta}

    def pause(self, body: dict) -> tuple[int, dict]:
        """Abort mode returns once every running request has returned its partial output."""
        with self.cond:
            self.paused = True
            if body.get("mode", "abort") == "abort":
                for rid in self.running:
                    self.running[rid] = self.weight_version
                if self.pause_drains:
                    self.cond.wait_for(lambda: not self.running)
        return 200, {"message": "Generation paused successfully."}

    def continue_(self, body: dict) -> tuple[int, dict]:
        with self.cond:
            self.paused = False
            self.cond.notify_all()
        return 200, {"message": "Generation continued successfully."}

    def abort(self, body: dict) -> tuple[int, dict]:
        with self.cond:
            for rid in self.running:
                if body.get("abort_all") or rid.startswith(body.get("rid", "")):
                    self.running[rid] = self.weight_version
        return 200, {}

    def update_weights(self, body: dict) -> tuple[int, dict]:
        path = body.get("model_path", "")
        if not os.path.isfile(os.path.join(path, "config.json")):
            message = f"Failed to get weights iterator: {path} is not a model directory."
            return 400, {"success": False, "message": message, "num_paused_requests": 0}
        if os.path.isfile(os.path.join(path, "CORRUPT")):
            with self.cond:
                self.weights = f"partial:{path}"
            message = "Failed to update weights: corrupt shard.\nRolling back to original weights."
            return 400, {"success": False, "message": message, "num_paused_requests": 0}
        with self.cond:
            self.model_path = self.weights = path
            takes_version = self.version_while_paused or not self.paused
            if body.get("weight_version") is not None and takes_version:
                self.weight_version = body["weight_version"]
        message = "Succeeded to update model weights."
        return 200, {"success": True, "message": message, "num_paused_requests": 0}

    def update_weight_version(self, body: dict) -> tuple[int, dict]:
        with self.cond:
            self.weight_version = body["new_version"]
            if body.get("abort_all_requests", True):
                for rid in self.running:
                    self.running[rid] = self.weight_version
        return 200, {"success": True, "new_version": body["new_version"]}

    def server_info(self) -> tuple[int, dict]:
        info = {"weight_version": self.weight_version}
        if self.max_req_input_len is not None:
            info["max_req_input_len"] = self.max_req_input_len
        return 200, info

    def model_info(self) -> tuple[int, dict]:
        return 200, {
            "model_path": self.model_path,
            "tokenizer_path": None,
            "is_generation": True,
            "weight_version": self.weight_version,
        }


def _handler(double: SGLangDouble):
    posts = {
        "/generate": double.generate,
        "/pause_generation": double.pause,
        "/continue_generation": double.continue_,
        "/abort_request": double.abort,
        "/update_weights_from_disk": double.update_weights,
        "/update_weight_version": double.update_weight_version,
    }
    gets = {"/health_generate": double.health, "/model_info": double.model_info,
            "/server_info": double.server_info}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def _answer(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            route = gets.get(self.path)
            self._answer(*(route() if route else (404, {"detail": "Not Found"})))

        def do_POST(self):
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            route = posts.get(self.path)
            if route is None:
                self._answer(404, {"detail": "Not Found"})
                return
            with double.cond:
                double.log.append((self.path, body))
            self._answer(*route(body))

    return Handler


def main(argv: list[str] | None = None) -> None:
    """Serve the double with SGLang's launch flags (as ``sglang.launch_server`` would)."""
    parser = argparse.ArgumentParser(prog="sglang.launch_server")
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--skip-tokenizer-init", action="store_true", required=True)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--dp-size", type=int, default=1)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--weight-version", default="default")
    parser.add_argument("--load-format", choices=["auto", "pt", "safetensors"], default="auto")
    parser.add_argument("--context-length", type=int)
    parser.add_argument("--mem-fraction-static", type=float)
    parser.add_argument("--max-running-requests", type=int)
    parser.add_argument("--random-seed", type=int)
    parser.add_argument("--enable-deterministic-inference", action="store_true")
    args = parser.parse_args(argv)
    startup_s = float(os.environ.get("SGLANG_DOUBLE_STARTUP_S", "0.3"))
    double = SGLangDouble(
        startup_s=startup_s,
        weight_version=args.weight_version,
        host=args.host,
        port=args.port,
        model_path=args.model_path,
    )
    double.server.serve_forever()


if __name__ == "__main__":
    main()
