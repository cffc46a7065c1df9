"""The SGLang adapter against a protocol double of SGLang's HTTP server (SGLang needs a GPU)."""

import asyncio
import json
import urllib.parse
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from _rollout_fakes import until
from _rollout_sglang_double import SGLangDouble, next_token, token_logprob

from rollout.config import EngineConfig
from rollout.engine import EngineError, SamplingParams, WeightLoadError, collect
from rollout.engines import sglang_api as api
from rollout.engines.sglang_engine import SGLangEngine, build_engine

VOCAB = 50
PROMPT = [3, 1, 4, 1, 5]


def expected_tokens(prompt: list[int], n: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        out.append(next_token(prompt + out, VOCAB))
    return out


@pytest.fixture
def model_dir(tmp_path) -> Path:
    path = tmp_path / "model"
    path.mkdir()
    config = {"vocab_size": VOCAB, "max_position_embeddings": 256}
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture
def double(model_dir):
    server = SGLangDouble(vocab_size=VOCAB, token_delay_s=0.01, model_path=str(model_dir)).start()
    yield server
    server.stop()


def attached(model_dir: Path, double: SGLangDouble) -> SGLangEngine:
    config = EngineConfig(kind="sglang", model_path=str(model_dir), options={"url": double.url})
    return build_engine(config)


def produced(double: SGLangDouble, request_id: str) -> int:
    """Tokens the double generated for the first submissions of ``request_id``'s calls."""
    quoted = urllib.parse.quote(request_id, safe="")
    return sum(n for rid, n in double.produced.items()
               if rid.startswith(f"{quoted}#") and rid.endswith(".0$"))


async def _generate(engine, prompt, params, rid="r1"):
    return await collect(engine.generate(prompt, params, rid))


def test_generate_returns_tokens_logprobs_and_versions(model_dir, double, caplog):
    stop_at = expected_tokens(PROMPT, 6)[5]

    async def scenario():
        engine = attached(model_dir, double)
        await engine.start()
        try:
            params = SamplingParams(
                max_new_tokens=20, temperature=0.7, top_p=0.9, stop_token_ids=[stop_at], seed=3
            )
            stopped = await _generate(engine, PROMPT, params)
            await _generate(engine, PROMPT, params, "r1b")
            capped = await _generate(engine, PROMPT, SamplingParams(max_new_tokens=4), "r2")
        finally:
            await engine.shutdown()
        return stopped, capped, engine.rid_tag

    stopped, capped, tag = asyncio.run(scenario())
    # top_p < 1: SGLang's log-probs may be renormalised over the nucleus; said once.
    assert sum("renormalised over the top-p" in r.getMessage() for r in caplog.records) == 1
    want = expected_tokens(PROMPT, 6)
    assert want.index(stop_at) == 5  # the stop token first appears at the end
    assert stopped.output_ids == want  # the matched stop token is kept
    assert stopped.logprobs == pytest.approx([token_logprob(t, "0") for t in want])
    assert stopped.versions == [0] * 6 and stopped.finish_reason == "stop"
    assert capped.output_ids == expected_tokens(PROMPT, 4) and capped.finish_reason == "length"
    sent = double.posts("/generate")[0]
    assert sent == {
        "input_ids": PROMPT,
        "sampling_params": {
            "max_new_tokens": 20,
            "temperature": pytest.approx(0.7),
            "top_p": pytest.approx(0.9),
            "top_k": -1,
            "no_stop_trim": True,
            "stop_token_ids": [stop_at],
            "sampling_seed": 3,
        },
        "return_logprob": True,
        "logprob_start_len": -1,
        "rid": f"r1#{tag}.0.0$",
    }


def test_an_interrupted_answer_that_ends_on_a_stop_token_is_finished():
    # SGLang decodes one more token after an abort and reports the abort over the stop that
    # token makes: resubmitted, the sequence went on past its end.
    assert api.interrupted_finish([4, 9, 7], 10, {7}) == "stop"
    assert api.interrupted_finish([4, 9], 2, {7}) == "length"
    assert api.interrupted_finish([4, 9], 5, {7}) is None
    assert api.interrupted_finish([], 5, {7}) is None


def test_unseeded_requests_get_seeds_of_their_own(model_dir, double):
    # With deterministic inference SGLang gives every unseeded request the same seed, so the
    # samples of a group came out identical.
    async def scenario():
        engine = attached(model_dir, double)
        await engine.start()
        try:
            for rid in ("a", "b"):
                await _generate(engine, PROMPT, SamplingParams(max_new_tokens=2), rid)
        finally:
            await engine.shutdown()

    asyncio.run(scenario())
    seeds = [p["sampling_params"]["sampling_seed"] for p in double.posts("/generate")]
    assert len(seeds) == 2 and seeds[0] != seeds[1] and all(0 <= s < 2**31 for s in seeds)


def _interrupted_run(engine, double, update):
    """Start a 30-token request, run ``update`` after about 10 tokens, return the result."""

    async def scenario():
        await engine.start()
        try:
            run = asyncio.create_task(_generate(engine, PROMPT, SamplingParams(max_new_tokens=30)))
            await until(lambda: produced(double, "r1") >= 8)
            outcome = None
            try:
                await update(engine)
            except WeightLoadError as e:
                outcome = e
            return await run, outcome, engine.version
        finally:
            await engine.shutdown()

    return asyncio.run(scenario())


def test_update_interrupts_and_resubmits_with_per_token_versions(model_dir, double, tmp_path):
    ckpt = tmp_path / "v1"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    engine = attached(model_dir, double)
    update = lambda e: e.update_weights(str(ckpt), 1)  # noqa: E731
    result, error, version = _interrupted_run(engine, double, update)

    assert error is None and version == 1
    # the output is exactly what an uninterrupted run gives: prompt + partial was re-read
    assert result.output_ids == expected_tokens(PROMPT, 30)
    assert result.finish_reason == "length"
    k = result.versions.index(1)
    assert 0 < k < 30 and result.versions == [0] * k + [1] * (30 - k)
    want_logprobs = [token_logprob(t, str(v)) for t, v in zip(result.output_ids, result.versions)]
    assert result.logprobs == pytest.approx(want_logprobs)
    # pause (abort) -> update with the version -> continue -> resubmission of prompt + partial
    assert [p for p, _ in double.log] == [
        "/generate", "/pause_generation", "/update_weights_from_disk", "/continue_generation",
        "/generate",
    ]  # fmt: skip
    assert double.posts("/pause_generation") == [{"mode": "abort"}]
    update = double.posts("/update_weights_from_disk")[0]
    assert (update["model_path"], update["weight_version"]) == (str(ckpt), "1")
    resubmitted = double.posts("/generate")[1]
    assert resubmitted["input_ids"] == PROMPT + result.output_ids[:k]
    assert resubmitted["sampling_params"]["max_new_tokens"] == 30 - k
    assert resubmitted["rid"] == f"r1#{engine.rid_tag}.0.1$"
    assert engine.stats()["resubmissions"] == 1


def test_failed_load_keeps_the_old_version(model_dir, double, tmp_path):
    engine = attached(model_dir, double)
    missing = str(tmp_path / "no-such-checkpoint")
    update = lambda e: e.update_weights(missing, 1)  # noqa: E731
    result, error, version = _interrupted_run(engine, double, update)

    assert isinstance(error, WeightLoadError) and "not a model directory" in str(error)
    assert version == 0 and double.weight_version == "0"
    assert result.output_ids == expected_tokens(PROMPT, 30)
    assert result.versions == [0] * 30
    assert double.posts("/continue_generation") == [{}]  # generation resumed after the failure


def test_pause_holds_requests_until_resume(model_dir, double):
    async def scenario():
        engine = attached(model_dir, double)
        await engine.start()
        try:
            run = asyncio.create_task(_generate(engine, PROMPT, SamplingParams(max_new_tokens=20)))
            await until(lambda: produced(double, "r1") >= 3)
            await engine.pause()
            await asyncio.sleep(0.15)
            held = (engine.paused, run.done(), len(double.posts("/generate")), dict(double.running))
            await engine.resume()
            return held, await run
        finally:
            await engine.shutdown()

    (paused, done, submitted, running), result = asyncio.run(scenario())
    assert paused and not done
    assert submitted == 1 and running == {}  # interrupted, not yet resubmitted
    assert result.output_ids == expected_tokens(PROMPT, 20)
    assert result.versions == [0] * 20 and result.finish_reason == "length"


def test_shutdown_aborts_in_flight_requests(model_dir, double):
    async def scenario():
        engine = attached(model_dir, double)
        await engine.start()
        run = asyncio.create_task(_generate(engine, PROMPT, SamplingParams(max_new_tokens=100)))
        await until(lambda: produced(double, "r1") >= 3)
        await engine.shutdown()
        after = await _generate(engine, PROMPT, SamplingParams(max_new_tokens=5), "late")
        return await run, after

    result, after = asyncio.run(scenario())
    assert result.finish_reason == "abort"
    assert 0 < len(result.output_ids) < 100
    assert result.output_ids == expected_tokens(PROMPT, len(result.output_ids))
    assert double.posts("/abort_request") == [{"rid": "", "abort_all": True}]
    assert (after.output_ids, after.finish_reason) == ([], "abort")


def test_cancelling_a_request_aborts_it_in_sglang(model_dir, double):
    async def scenario():
        engine = attached(model_dir, double)
        await engine.start()
        try:
            params = SamplingParams(max_new_tokens=100)
            run = asyncio.create_task(_generate(engine, PROMPT, params, "c1"))
            await until(lambda: produced(double, "c1") >= 3)
            run.cancel()
            await until(lambda: not double.running)
            return produced(double, "c1"), engine.rid_tag
        finally:
            await engine.shutdown()

    made, tag = asyncio.run(scenario())
    assert double.posts("/abort_request") == [{"rid": f"c1#{tag}.0.0$", "abort_all": False}]
    assert made < 100  # SGLang stopped generating for it


def test_attaching_adopts_the_servers_weight_version(model_dir):
    double = SGLangDouble(vocab_size=VOCAB, weight_version="7").start()

    async def scenario():
        engine = attached(model_dir, double)
        await engine.start()
        try:
            return engine.version, await _generate(engine, PROMPT, SamplingParams(max_new_tokens=2))
        finally:
            await engine.shutdown()

    try:
        version, result = asyncio.run(scenario())
    finally:
        double.stop()
    assert version == 7 and result.versions == [7, 7]


def _fake_sglang(tmp_path: Path, body: str, monkeypatch) -> None:
    """Put a ``sglang.launch_server`` module running ``body`` first on the child's path."""
    package = tmp_path / "fake" / "sglang"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "launch_server.py").write_text(body)
    tests_dir = str(Path(__file__).parent)
    path = os.pathsep.join([str(package.parent), tests_dir, os.environ.get("PYTHONPATH", "")])
    monkeypatch.setenv("PYTHONPATH", path)


def test_launches_sglang_waits_until_ready_and_stops_it(model_dir, tmp_path, monkeypatch):
    _fake_sglang(tmp_path, "import os\nprint('inherited:', os.environ.get("
                 "'SGLANG_RETURN_ORIGINAL_LOGPROB'), flush=True)\n"
                 "from _rollout_sglang_double import main\nmain()\n", monkeypatch)
    monkeypatch.setenv("SGLANG_DOUBLE_STARTUP_S", "0.5")  # /health_generate answers 503 first
    # exported for another RL stack: SGLang would return log-probs before the temperature
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")
    log_path = tmp_path / "sglang.log"
    options = {
        "python": sys.executable,
        "log_path": str(log_path),
        "context_length": 128,
        "tp_size": 2,
    }
    config = EngineConfig(
        kind="sglang", model_path=str(model_dir), initial_version=4, options=options
    )
    engine = build_engine(config)

    async def scenario():
        await engine.start()
        try:
            return await _generate(engine, PROMPT, SamplingParams(max_new_tokens=3))
        finally:
            await engine.shutdown()

    result = asyncio.run(scenario())
    assert result.output_ids == expected_tokens(PROMPT, 3)
    assert result.versions == [4, 4, 4]  # launched with --weight-version 4
    assert engine.max_context_len == 127  # SGLang refuses prompt + max_new_tokens >= 128
    # The checkpoint names no dtype, which SGLang's auto would serve in float16.
    assert engine.process.argv[engine.process.argv.index("--dtype") + 1] == "bfloat16"
    assert engine.process.exit_code() is not None  # stopped with the engine
    assert "inherited: None" in log_path.read_text()


def test_launch_failure_reports_the_exit_code_and_log(model_dir, tmp_path, monkeypatch):
    body = "import sys\nprint('CUDA driver not found', file=sys.stderr)\nsys.exit(3)\n"
    _fake_sglang(tmp_path, body, monkeypatch)
    options = {"python": sys.executable, "log_path": str(tmp_path / "sglang.log")}
    engine = build_engine(EngineConfig(kind="sglang", model_path=str(model_dir), options=options))
    with pytest.raises(EngineError, match=r"(?s)exited with code 3.*CUDA driver not found"):
        asyncio.run(engine.start())


def test_launch_command_sets_the_rl_flags():
    flags = api.LaunchFlags(
        model_path="/m", host="127.0.0.1", port=31000, weight_version=2, tp_size=2, dp_size=4,
        dtype="bfloat16", context_length=4096, mem_fraction_static=0.8, random_seed=1,
    )  # fmt: skip
    argv = api.launch_command("/py", flags, ["--log-level", "warning"])
    assert argv == [
        "/py", "-m", "sglang.launch_server", "--model-path", "/m", "--host", "127.0.0.1",
        "--port", "31000", "--skip-tokenizer-init", "--tp-size", "2", "--dp-size", "4",
        "--dtype", "bfloat16", "--weight-version", "2", "--load-format", "safetensors",
        "--context-length", "4096",
        "--mem-fraction-static", "0.8", "--random-seed", "1", "--log-level", "warning",
    ]  # fmt: skip


@pytest.mark.parametrize("option, named, launched", [
    ("auto", "float32", "bfloat16"),  # SGLang's auto: float16, where bf16-trained models overflow
    ("auto", None, "bfloat16"),  # SGLang takes a config naming none for float32
    ("auto", "bfloat16", "bfloat16"),
    ("auto", "float16", "float16"),
    ("float32", "float32", "float32"),  # a choice is kept
    ("float16", "bfloat16", "float16"),
])
def test_auto_dtype_never_means_float16_for_a_float32_checkpoint(tmp_path, option, named,
                                                                   launched, caplog):
    from rollout.engines.sglang_engine import _served_dtype

    config = {"vocab_size": VOCAB, "max_position_embeddings": 256}
    key = "torch_dtype" if named == "float32" else "dtype"  # transformers 4 and 5 spellings
    (tmp_path / "config.json").write_text(json.dumps({**config, key: named} if named else config))
    assert api.launch_dtype(option, named) == launched
    assert _served_dtype(str(tmp_path), option) == launched
    warned = any("SGLang would serve this" in r.getMessage() for r in caplog.records)
    assert warned == (option == "auto" and launched != named)


def test_generate_response_parsing():
    body = {
        "output_ids": [5],
        "meta_info": {
            "finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
            "weight_version": "default",
            "output_token_logprobs": [[-0.5, 5, None], [-0.25, 9, None]],
        },
    }
    out = api.parse_generate_response([body])
    assert (out.token_ids, out.logprobs, out.finish_reason) == ([5, 9], [-0.5, -0.25], "abort")
    assert out.weight_version is None and out.message == "Abort in waiting queue"
    with pytest.raises(ValueError, match="no meta_info"):
        api.parse_generate_response({"output_ids": []})
    with pytest.raises(ValueError, match="finish_reason"):
        api.parse_generate_response({"meta_info": {"finish_reason": None}})


def test_an_unreachable_server_fails_the_engine_for_good(model_dir, double):
    async def scenario():
        engine = attached(model_dir, double)
        await engine.start()
        before = engine.failure
        double.stop()
        try:
            with pytest.raises(EngineError, match="SGLang does not answer: GET .*/model_info"):
                await _generate(engine, PROMPT, SamplingParams(max_new_tokens=2))
            failure = engine.failure
            with pytest.raises(EngineError) as again:
                await _generate(engine, PROMPT, SamplingParams(max_new_tokens=2), "r2")
        finally:
            await engine.shutdown()
        return before, failure, again.value

    before, failure, again = asyncio.run(scenario())
    assert before is None and failure is again


def test_a_launched_server_that_exits_fails_the_engine(model_dir, tmp_path, monkeypatch):
    _fake_sglang(tmp_path, "from _rollout_sglang_double import main\nmain()\n", monkeypatch)
    options = {"python": sys.executable, "log_path": str(tmp_path / "sglang.log")}
    engine = build_engine(EngineConfig(kind="sglang", model_path=str(model_dir), options=options))

    async def scenario():
        await engine.start()
        try:
            assert engine.failure is None
            os.kill(engine.process.pid, signal.SIGKILL)
            await until(lambda: engine.failure is not None)
            with pytest.raises(EngineError, match="exited with code -9"):
                await _generate(engine, PROMPT, SamplingParams(max_new_tokens=2))
        finally:
            await engine.shutdown()

    asyncio.run(scenario())


def test_a_load_failing_part_way_reloads_the_served_checkpoint(model_dir, double, tmp_path):
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text("{}")
    (corrupt / "CORRUPT").write_text("")
    engine = attached(model_dir, double)
    result, error, version = _interrupted_run(engine, double, lambda e: e.update_weights(
        str(corrupt), 1))

    assert isinstance(error, WeightLoadError) and "corrupt shard" in str(error)
    assert version == 0 and double.weight_version == "0"
    assert double.weights == str(model_dir)  # not left partly updated
    loads = [(p["model_path"], p["weight_version"], p["load_format"])
             for p in double.posts("/update_weights_from_disk")]  # never pickles: safetensors
    assert loads == [(str(corrupt), "1", "safetensors"), (str(model_dir), "0", "safetensors")]
    assert result.output_ids == expected_tokens(PROMPT, 30) and result.versions == [0] * 30


def test_a_failed_reload_fails_the_engine_rather_than_serve_unknown_weights(
    model_dir, double, tmp_path
):
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text("{}")
    (corrupt / "CORRUPT").write_text("")

    async def scenario():
        engine = attached(model_dir, double)
        await engine.start()
        (model_dir / "config.json").unlink()  # the served checkpoint is gone
        try:
            with pytest.raises(EngineError) as err:
                await engine.update_weights(str(corrupt), 1)
            return err.value, engine.failure, engine.version
        finally:
            await engine.shutdown()

    error, failure, version = asyncio.run(scenario())
    assert not isinstance(error, WeightLoadError) and error is failure
    assert "may be partly updated" in str(failure) and version == 0


def test_interrupted_answers_keep_their_version_when_pause_returns_early(model_dir, tmp_path):
    double = SGLangDouble(vocab_size=VOCAB, model_path=str(model_dir), pause_drains=False).start()
    ckpt = tmp_path / "v1"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    try:
        engine = attached(model_dir, double)
        result, error, _ = _interrupted_run(engine, double, lambda e: e.update_weights(
            str(ckpt), 1))
    finally:
        double.stop()
    assert error is None and result.output_ids == expected_tokens(PROMPT, 30)
    k = result.versions.index(1)
    assert k >= 8 and result.versions == [0] * k + [1] * (30 - k)
    want_logprobs = [token_logprob(t, str(v)) for t, v in zip(result.output_ids, result.versions)]
    assert result.logprobs == pytest.approx(want_logprobs)


def test_aborting_one_request_spares_those_whose_id_it_prefixes(model_dir, double):
    async def scenario():
        engine = attached(model_dir, double)
        await engine.start()
        try:
            params = SamplingParams(max_new_tokens=40)
            short = asyncio.create_task(_generate(engine, PROMPT, params, "x/1"))
            long = asyncio.create_task(_generate(engine, PROMPT, params, "x/10"))
            # Another client's request with the same id (ids are unique per stream only): it
            # had the same rid, and the cancel aborted it too.
            twin = asyncio.create_task(_generate(engine, PROMPT, params, "x/1"))
            await until(lambda: min(produced(double, "x/1"), produced(double, "x/10")) >= 3)
            short.cancel()
            return await long, await twin, engine.rid_tag
        finally:
            await engine.shutdown()

    long, twin, tag = asyncio.run(scenario())
    assert double.posts("/abort_request") == [{"rid": f"x%2F1#{tag}.0.0$", "abort_all": False}]
    assert long.finish_reason == "length" and twin.finish_reason == "length"
    assert long.output_ids == twin.output_ids == expected_tokens(PROMPT, 40)


def test_a_forced_update_to_an_older_version_tags_later_tokens_with_it(model_dir, tmp_path):
    double = SGLangDouble(vocab_size=VOCAB, weight_version="5").start()
    ckpt = tmp_path / "v2"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    try:
        engine = attached(model_dir, double)
        result, error, version = _interrupted_run(engine, double, lambda e: e.update_weights(
            str(ckpt), 2))
    finally:
        double.stop()
    assert error is None and version == 2
    k = result.versions.index(2)
    assert 0 < k < 30 and result.versions == [5] * k + [2] * (30 - k)
    assert result.output_ids == expected_tokens(PROMPT, 30)


def test_request_ids_never_prefix_one_another():
    rids = [api.request_rid(i, e, c, a) for i in ["a", "a/1", "a/10", "a#1", "a$", "a%"]
            for e in ("0a1b2c3d", "0a1b2c3e") for c in (0, 1, 10) for a in (0, 1, 10)]
    assert len(set(rids)) == len(rids)
    assert not any(x != y and y.startswith(x) for x in rids for y in rids)


def _checkpoint(tmp_path, name: str) -> Path:
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text("{}")
    return path


def test_an_sglang_that_ignores_the_version_of_a_paused_update_is_given_it(model_dir, tmp_path):
    # SGLang 0.5.6 and 0.5.6.post1 load weights sent while paused but keep the old
    # weight_version: every later token would carry version 0.
    double = SGLangDouble(vocab_size=VOCAB, model_path=str(model_dir),
                          version_while_paused=False).start()
    try:
        engine = attached(model_dir, double)
        result, error, version = _interrupted_run(
            engine, double, lambda e: e.update_weights(str(_checkpoint(tmp_path, "v1")), 1))
    finally:
        double.stop()
    assert error is None and version == 1 and double.weight_version == "1"
    assert double.posts("/update_weight_version") == [
        {"new_version": "1", "abort_all_requests": False}]
    k = result.versions.index(1)
    assert 0 < k < 30 and result.versions == [0] * k + [1] * (30 - k)


def test_an_sglang_that_keeps_reporting_the_old_version_fails_the_engine(model_dir, tmp_path):
    class NoVersionEndpoint(SGLangDouble):
        def update_weight_version(self, body):
            return 404, {"detail": "Not Found"}

    double = NoVersionEndpoint(vocab_size=VOCAB, model_path=str(model_dir),
                               version_while_paused=False).start()

    async def scenario():
        engine = attached(model_dir, double)
        await engine.start()
        try:
            with pytest.raises(EngineError, match=r"reports weight_version .*0\.5\.6\.post2"):
                await engine.update_weights(str(_checkpoint(tmp_path, "v1")), 1)
            return engine.failure
        finally:
            await engine.shutdown()

    try:
        assert isinstance(asyncio.run(scenario()), EngineError)
    finally:
        double.stop()


def test_the_context_served_is_what_sglangs_scheduler_takes_whole(model_dir, tmp_path):
    # The model's config allows 255 tokens, SGLang's scheduler refuses inputs of 40 or more
    # and cuts max_new_tokens to 44 - input: a request within the reported limit, interrupted
    # by an update near its end, still gets every token it asked for.
    double = SGLangDouble(vocab_size=VOCAB, model_path=str(model_dir), token_delay_s=0.05,
                          max_req_input_len=40).start()  # the update comes 0.4 s before its end
    ckpt = _checkpoint(tmp_path, "v1")

    async def scenario():
        engine = attached(model_dir, double)
        await engine.start()
        try:
            limit = engine.max_context_len
            new = limit - len(PROMPT)
            run = asyncio.create_task(_generate(engine, PROMPT, SamplingParams(max_new_tokens=new)))
            await until(lambda: produced(double, "r1") >= new - 8)
            await engine.update_weights(str(ckpt), 1)
            return limit, new, await run
        finally:
            await engine.shutdown()

    try:
        limit, new, result = asyncio.run(scenario())
    finally:
        double.stop()
    assert limit == 39
    assert result.finish_reason == "length" and result.output_ids == expected_tokens(PROMPT, new)
    assert len(double.posts("/generate")) == 2  # resubmitted after the update, and taken


def test_two_adapters_on_one_sglang_never_send_the_same_rid(model_dir, double):
    async def scenario():
        engines = [attached(model_dir, double), attached(model_dir, double)]
        for engine in engines:
            await engine.start()
        try:
            params = SamplingParams(max_new_tokens=20)
            return await asyncio.gather(*(_generate(e, PROMPT, params, "same") for e in engines))
        finally:
            for engine in engines:
                await engine.shutdown()

    results = asyncio.run(scenario())
    assert [r.finish_reason for r in results] == ["length", "length"]
    rids = [post["rid"] for post in double.posts("/generate")]
    assert len(rids) == 2 and len(set(rids)) == 2


def test_an_sglang_without_model_info_keeps_its_loaded_weights_serving(model_dir, tmp_path):
    # A server behind a proxy that does not pass /model_info: the version cannot be checked,
    # which is no reason to fail an engine whose load succeeded.
    class NoModelInfo(SGLangDouble):
        def model_info(self):
            return 404, {"detail": "Not Found"}

    double = NoModelInfo(vocab_size=VOCAB, model_path=str(model_dir)).start()

    async def scenario():
        engine = attached(model_dir, double)
        await engine.start()
        try:
            await engine.update_weights(str(_checkpoint(tmp_path, "v1")), 1)
            return engine.version, engine.failure
        finally:
            await engine.shutdown()

    try:
        assert asyncio.run(scenario()) == (1, None)
    finally:
        double.stop()


def _served(double: SGLangDouble, engine: SGLangEngine, scenario):
    """``await scenario(engine)`` on the started ``engine``; then the engine shuts down and
    ``double`` stops, whatever happened."""
    async def run():
        await engine.start()
        try:
            return await scenario(engine)
        finally:
            await engine.shutdown()

    try:
        return asyncio.run(run())
    finally:
        double.stop()


def _true_versions(result) -> list[int]:
    """The version whose weights produced each token, read from its log-prob."""
    return [round(-lp - t / 1000) - 1 for t, lp in zip(result.output_ids, result.logprobs)]


@pytest.mark.parametrize("pause_drains", [True, False])
def test_a_request_that_reached_sglang_after_a_pause_began_carries_the_version_it_ran_under(
        model_dir, tmp_path, pause_drains):
    # Sent at version 0, it reached SGLang once the swap to 1 had begun (held there, or run
    # after it), and ran under 1 until the swap to 2 cut it: its tokens were labelled 0.
    double = SGLangDouble(vocab_size=VOCAB, token_delay_s=0.01, model_path=str(model_dir),
                          pause_drains=pause_drains).start()
    v1, v2 = _checkpoint(tmp_path, "v1"), _checkpoint(tmp_path, "v2")

    async def scenario(engine):
        send = engine._generate_client._request

        def late(method, path, payload, timeout):  # the network holds the request a while
            if (payload or {}).get("rid", "").endswith(".0$"):
                time.sleep(0.3)
            return send(method, path, payload, timeout)

        engine._generate_client._request = late
        run = asyncio.create_task(_generate(engine, PROMPT, SamplingParams(max_new_tokens=60)))
        await asyncio.sleep(0.05)
        await engine.update_weights(str(v1), 1)
        await until(lambda: produced(double, "r1") >= 8)
        await engine.update_weights(str(v2), 2)
        return await run

    result = _served(double, attached(model_dir, double), scenario)
    assert result.output_ids == expected_tokens(PROMPT, 60)
    assert result.versions == _true_versions(result)
    k = result.versions.index(2)
    assert result.versions == [1] * k + [2] * (60 - k) and k >= 8


def test_a_pause_does_not_wait_behind_generate_calls_queued_for_a_connection(model_dir,
                                                                             tmp_path):
    # One pool served every call: with all its connections taken by /generate calls, the pause
    # of an update waited until queued ones had been sent and run to their end.
    double = SGLangDouble(vocab_size=VOCAB, token_delay_s=0.01, model_path=str(model_dir)).start()
    v1 = _checkpoint(tmp_path, "v1")

    async def scenario(engine):
        params = SamplingParams(max_new_tokens=100)
        runs = [asyncio.create_task(_generate(engine, PROMPT, params, f"q{i}"))
                for i in range(4)]  # two run, two wait for a connection
        await until(lambda: produced(double, "q0") >= 5 and produced(double, "q1") >= 5)
        await engine.update_weights(str(v1), 1)
        return await asyncio.gather(*runs)

    engine = build_engine(EngineConfig(kind="sglang", model_path=str(model_dir),
                                       options={"url": double.url, "max_connections": 2}))
    results = _served(double, engine, scenario)
    for result in results:
        assert result.output_ids == expected_tokens(PROMPT, 100)
        assert result.versions == _true_versions(result)
    # The two running were cut by the update, not run to their end under version 0.
    assert all(0 < r.versions.index(1) < 100 for r in results[:2])


def test_a_seed_beyond_int64_is_folded_into_it_for_sglang():
    # A request's seed is 64-bit (unsigned on the wire); SGLang holds seeds in int64 tensors.
    payload = api.generate_payload([1], SamplingParams(max_new_tokens=1, seed=2**64 - 1), 1, "r")
    assert payload["sampling_params"]["sampling_seed"] == 2**63 - 1
    small = api.generate_payload([1], SamplingParams(max_new_tokens=1, seed=7), 1, "r")
    assert small["sampling_params"]["sampling_seed"] == 7
