"""Every SGLang HTTP API detail the adapter relies on, in one place (SGLang 0.5.6 – 0.5.x).

Endpoints, launch flags, request payloads and response parsing. When SGLang changes its API,
this module is what changes.
"""

from __future__ import annotations

import dataclasses
import urllib.parse
from typing import Any, Literal

from rollout.engine import FinishReason, SamplingParams

HEALTH = "/health_generate"  # 200 when ready, 503 while starting
GENERATE = "/generate"
PAUSE = "/pause_generation"
CONTINUE = "/continue_generation"
UPDATE_WEIGHTS_FROM_DISK = "/update_weights_from_disk"
ABORT = "/abort_request"
MODEL_INFO = ("/model_info", "/get_model_info")  # 0.5.23 name first, then the older one
SERVER_INFO = ("/server_info", "/get_server_info")  # the scheduler's limits among the fields
UPDATE_WEIGHT_VERSION = "/update_weight_version"


@dataclasses.dataclass(frozen=True)
class LaunchFlags:
    """Server flags the adapter sets (``python -m sglang.launch_server ...``)."""

    model_path: str
    host: str
    port: int
    weight_version: int
    tp_size: int = 1
    dp_size: int = 1
    dtype: str = "auto"
    context_length: int | None = None
    mem_fraction_static: float | None = None
    max_running_requests: int | None = None
    random_seed: int | None = None
    deterministic_inference: bool = False


HALF_DTYPES = ("bfloat16", "float16")
LOAD_FORMAT = "safetensors"  # never SGLang's auto, which falls back to pickled *.bin / *.pt


def launch_dtype(option: str, checkpoint_dtype: str | None) -> str:
    """``--dtype`` for ``engine.options.dtype`` = ``option`` and a checkpoint whose config names
    ``checkpoint_dtype``. SGLang's ``auto`` (as vLLM's) serves a float32 checkpoint, or one
    naming no dtype, in float16, where a model trained in bfloat16 can overflow (Qwen2 does):
    ``auto`` is the checkpoint's own half type, else ``bfloat16``; any other option is kept."""
    if option != "auto":
        return option
    return checkpoint_dtype if checkpoint_dtype in HALF_DTYPES else "bfloat16"


def launch_command(python: str, flags: LaunchFlags, extra_args: list[str] = ()) -> list[str]:
    """argv of an SGLang server that takes and returns token ids (no tokenizer)."""
    argv = [
        python, "-m", "sglang.launch_server",
        "--model-path", flags.model_path,
        "--host", flags.host,
        "--port", str(flags.port),
        "--skip-tokenizer-init",
        "--tp-size", str(flags.tp_size),
        "--dp-size", str(flags.dp_size),
        "--dtype", flags.dtype,
        "--weight-version", str(flags.weight_version),
        "--load-format", LOAD_FORMAT,
    ]  # fmt: skip
    optional = {
        "--context-length": flags.context_length,
        "--mem-fraction-static": flags.mem_fraction_static,
        "--max-running-requests": flags.max_running_requests,
        "--random-seed": flags.random_seed,
    }
    for flag, value in optional.items():
        if value is not None:
            argv += [flag, str(value)]
    if flags.deterministic_inference:
        argv.append("--enable-deterministic-inference")
    return argv + list(extra_args)


def generate_payload(
    input_ids: list[int], params: SamplingParams, max_new_tokens: int, rid: str
) -> dict[str, Any]:
    """``POST /generate`` body: one sequence, log-probs of the output tokens only.

    Only sampling keys SGLang knows are sent (0.5.23 rejects unknown ones with HTTP 400).
    ``no_stop_trim`` keeps a matched stop token in ``output_ids``.
    """
    sampling: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "no_stop_trim": True,
    }
    if params.stop_token_ids:
        sampling["stop_token_ids"] = list(params.stop_token_ids)
    if params.seed is not None:  # requests carry 64-bit seeds; torch's widest integer is int64
        sampling["sampling_seed"] = params.seed & (2**63 - 1)
    return {
        "input_ids": list(input_ids),
        "sampling_params": sampling,
        "return_logprob": True,
        "logprob_start_len": -1,
        "rid": rid,
    }


def interrupted_finish(token_ids: list[int], remaining: int,
                       stop_ids: set[int]) -> Literal["stop", "length"] | None:
    """The finish of an answer a pause cut short (SGLang reports ``abort``): ``stop`` when its
    last token is a stop token (SGLang decodes one more token after an abort and reports the
    abort over the stop that token makes), ``length`` when it used the whole budget, else None:
    the rest is to be resubmitted."""
    if token_ids and token_ids[-1] in stop_ids:
        return "stop"
    return "length" if len(token_ids) >= remaining else None


@dataclasses.dataclass(frozen=True)
class GenerateOutput:
    """What one ``/generate`` answer says about the tokens it produced."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    weight_version: int | None  # None when absent or not an integer
    message: str = ""


def parse_version(value: Any) -> int | None:
    """SGLang's ``weight_version`` string as an int, or None (e.g. "default")."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def parse_generate_response(body: Any) -> GenerateOutput:
    """Tokens and log-probs from ``meta_info.output_token_logprobs`` triples.

    Each triple is ``[logprob, token_id, text_or_null]``, one per generated token; the token ids
    are taken from it rather than ``output_ids``, which SGLang may trim of a matched stop token.
    """
    if isinstance(body, list):
        if len(body) != 1:
            raise ValueError(f"expected one /generate result, got {len(body)}")
        body = body[0]
    if not isinstance(body, dict) or not isinstance(body.get("meta_info"), dict):
        raise ValueError(f"/generate answer has no meta_info: {str(body)[:200]}")
    meta = body["meta_info"]
    triples = meta.get("output_token_logprobs") or []
    finish = meta.get("finish_reason") or {}
    kind = finish.get("type") if isinstance(finish, dict) else None
    if kind not in ("stop", "length", "abort"):
        raise ValueError(f"/generate answer has finish_reason {finish!r}")
    return GenerateOutput(
        token_ids=[int(t[1]) for t in triples],
        logprobs=[float(t[0]) for t in triples],
        finish_reason=kind,
        weight_version=parse_version(meta.get("weight_version")),
        message=str(finish.get("message", "")),
    )


def request_rid(request_id: str, engine: str, call: int, attempt: int) -> str:
    """SGLang ``rid`` of one submission of a request:
    ``<quoted id>#<engine>.<call>.<attempt>$``.

    ``call`` numbers the adapter's generate calls: clients may reuse a request id (two streams,
    or a group's sample ``q/0`` and a single request ``q/0``), and one's abort must not end the
    other. ``engine`` (hex digits, random per adapter) keeps two adapters on one SGLang, or an
    adapter restarted while its predecessor's requests still run, from sending the same rid: an
    SGLang 0.5.6 overwrites the earlier request's state (its caller waits for ever), 0.5.23
    refuses the later one. SGLang aborts every request whose rid starts with the rid it is
    given, so no rid may prefix another: ``$`` ends each one and appears nowhere else (the
    request id is percent-quoted).
    """
    return f"{urllib.parse.quote(request_id, safe='')}#{engine}.{call}.{attempt}$"


PAUSE_PAYLOAD = {"mode": "abort"}  # running requests return at once with finish_reason abort
CONTINUE_PAYLOAD: dict = {}
ABORT_ALL_PAYLOAD = {"rid": "", "abort_all": True}


def abort_payload(rid: str) -> dict[str, Any]:
    return {"rid": rid, "abort_all": False}


def weight_version_payload(version: int) -> dict[str, Any]:
    """``POST /update_weight_version`` body (its ``abort_all_requests`` defaults to true)."""
    return {"new_version": str(version), "abort_all_requests": False}


def request_limit(server_info: dict) -> int | None:
    """The longest prompt + ``max_new_tokens`` SGLang serves whole, from ``/server_info``:
    its scheduler refuses (HTTP 400) an input of ``max_req_input_len`` tokens or more and cuts
    ``max_new_tokens`` to ``max_req_len - input - 1``, where ``max_req_len =
    max_req_input_len + 5``; below ``max_req_input_len`` in all, a request and every
    resubmission of it (prompt + the output so far) is taken whole. None when it says nothing."""
    value = server_info.get("max_req_input_len")
    if isinstance(value, int) and not isinstance(value, bool) and value > 1:
        return value - 1
    return None


def update_weights_payload(path: str, version: int) -> dict[str, Any]:
    """``POST /update_weights_from_disk`` body; requests are already aborted by the pause.
    Safetensors only (``LOAD_FORMAT``): a directory that also holds pickled weights
    (``*.bin``, ``*.pt``) never has them read."""
    return {"model_path": path, "load_format": LOAD_FORMAT, "weight_version": str(version),
            "abort_all_requests": False}


def update_succeeded(status: int, body: Any) -> tuple[bool, str]:
    """``(ok, message)`` of an update answer.

    A failure does not mean the old weights are intact: SGLang records the new path before
    loading, and a load that fails part-way "rolls back" from that new path.
    """
    message = body.get("message", "") if isinstance(body, dict) else str(body or "")
    ok = status == 200 and isinstance(body, dict) and bool(body.get("success"))
    return ok, message or f"HTTP {status}"
