"""The JAX generation engine against transformers and the trainer's log-prob recompute."""

import asyncio
import time
import contextlib
import json
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from _hf_models import hf_greedy, hf_model, save_hf_model
from _rollout_fakes import until
from areal_jax.config import ConfigError
from areal_jax.models import ModelConfig, load_hf_model
from areal_jax.rl.logprobs import token_logprobs
from rollout.config import EngineConfig
from rollout.engine import EngineError, InvalidParamError, SamplingParams
from rollout.engines import create_engine, jax_decode, jax_engine, jax_worker
from rollout.engines.jax_engine import JaxEngineOptions
from rollout.engines.jax_sampling import filter_top_k_top_p, sample

OPTIONS = dict(num_slots=4, max_seq_len=64, decode_steps_per_call=4)
PROMPTS = [[5, 17, 3, 88, 41], list(range(20, 31)), [int(x) for x in np.arange(19) * 7 % 97]]
GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0)


@pytest.fixture(scope="module")
def ref_model():
    return hf_model("qwen2", seed=11)


@pytest.fixture(scope="module")
def model_dir(ref_model, tmp_path_factory):
    return str(save_hf_model(ref_model, tmp_path_factory.mktemp("qwen2")))


def make_engine(path, **options):
    return create_engine(EngineConfig(kind="jax", model_path=path, options={**OPTIONS, **options}))


def run(coro):
    return asyncio.run(coro)


def copy_model(model_dir, path: Path, **config) -> str:
    """``model_dir``'s weights and ``config.json`` (with ``config`` on top) in ``path``."""
    path.mkdir()
    (path / "model.safetensors").write_bytes((Path(model_dir) / "model.safetensors").read_bytes())
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **config}))
    return str(path)


async def started(path, **options):
    engine = make_engine(path, **options)
    await engine.start()
    return engine


def recompute_logprobs(path, prompt, output, temperature):
    """The trainer's recompute: one packed forward over prompt + output, then token_logprobs."""
    model, _ = load_hf_model(path)
    seq = jnp.asarray([prompt + output], jnp.int32)
    hidden, _ = model(seq, jnp.ones_like(seq), jnp.arange(seq.shape[1])[None])
    logp, _ = token_logprobs(hidden[:, len(prompt) - 1 : -1], model.head_kernel(),
                             jnp.asarray([output]), temperature)
    return np.asarray(logp[0])


def kept_by_definition(logits, top_k, top_p):
    """Sort-based reference: top-k, then the smallest top-p nucleus of the renormalised rest."""
    order = np.argsort(-logits)
    k = top_k if 1 <= top_k < len(logits) else len(logits)
    top = logits[order[:k]]
    probs = np.exp(top - top.max()) / np.exp(top - top.max()).sum()
    before = np.cumsum(probs) - probs
    keep = order[:k][(before < top_p) | (top_p >= 1)]
    return set(keep.tolist())


def test_top_k_top_p_filter_keeps_the_defined_set():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(8, 50)).astype(np.float32) * 3
    top_k = np.array([-1, 1, 5, 50, -1, 20, 7, 3], np.int32)
    top_p = np.array([0.9, 1.0, 0.5, 0.99, 1e-6, 0.3, 1.0, 0.95], np.float32)
    out = np.asarray(filter_top_k_top_p(*map(jnp.asarray, (logits, top_k, top_p))))
    for row in range(8):
        kept = set(np.flatnonzero(np.isfinite(out[row])).tolist())
        assert kept == kept_by_definition(logits[row], top_k[row], top_p[row]), row
        np.testing.assert_array_equal(out[row][list(kept)], logits[row][list(kept)])


def test_sampled_frequencies_follow_the_filtered_distribution():
    logits = np.array([2.0, 1.5, 1.4, 0.3, -0.5, -1.0, 0.9, 0.0], np.float32)
    n, temperature = 10000, 0.7
    draw = jax.jit(sample)
    rows = lambda x, dtype: jnp.full((n,), x, dtype)  # noqa: E731
    seeds, positions = jnp.zeros((n, 2), jnp.uint32), jnp.arange(n, dtype=jnp.int32)
    for top_k, top_p in [(-1, 1.0), (3, 1.0), (-1, 0.8), (4, 0.9)]:
        tokens, logprobs = draw(jnp.tile(logits, (n, 1)), rows(temperature, jnp.float32),
                                  rows(top_k, jnp.int32), rows(top_p, jnp.float32), seeds,
                                  positions)
        scaled = logits / temperature
        full = np.exp(scaled - scaled.max()) / np.exp(scaled - scaled.max()).sum()
        kept = sorted(kept_by_definition(scaled, top_k, top_p))
        expected = np.zeros_like(full)
        expected[kept] = full[kept] / full[kept].sum()
        freq = np.bincount(np.asarray(tokens), minlength=len(logits)) / n
        np.testing.assert_allclose(freq, expected, atol=0.02)
        np.testing.assert_allclose(logprobs, np.log(full)[np.asarray(tokens)], atol=1e-6)
    greedy, logp = sample(jnp.asarray(logits)[None], jnp.zeros(1), jnp.full(1, -1, jnp.int32),
                          jnp.ones(1), seeds[:1], positions[:1])
    assert int(greedy[0]) == 0
    expected = float(jax.nn.log_softmax(jnp.asarray(logits))[0])
    assert float(logp[0]) == pytest.approx(expected, abs=1e-6)


def test_greedy_matches_transformers_alone_and_amid_other_requests(ref_model, model_dir):
    lengths = [16, 23, 9]
    expected = [hf_greedy(ref_model, p, n) for p, n in zip(PROMPTS, lengths)]

    async def main():
        engine = await started(model_dir)
        alone = [await engine.generate_full(p, SamplingParams(n, temperature=0.0), f"a{i}")
                 for i, (p, n) in enumerate(zip(PROMPTS, lengths))]
        company = [engine.generate_full([7] * (3 + 4 * i), SamplingParams(5 + 6 * i, seed=i),
                                        f"c{i}") for i in range(3)]
        mine = [engine.generate_full(p, SamplingParams(n, temperature=0.0), f"b{i}")
                for i, (p, n) in enumerate(zip(PROMPTS, lengths))]
        together = await asyncio.gather(*company[:2], *mine, company[2])
        await engine.shutdown()
        return alone, together[2:5]

    alone, together = run(main())
    for exp, a, t, n in zip(expected, alone, together, lengths):
        assert a.output_ids == exp and t.output_ids == exp
        # Company packs the prefill into a longer row: log-probs agree to rounding.
        np.testing.assert_allclose(a.logprobs, t.logprobs, atol=1e-5, rtol=0)
        assert a.finish_reason == t.finish_reason == "length" and len(a.output_ids) == n
        assert a.versions == [0] * n


@pytest.mark.parametrize("temperature,top_p,top_k",
                         [(0.7, 0.8, -1), (1.3, 1.0, 12), (0.0, 1.0, -1)])
def test_logprobs_equal_trainer_recompute(model_dir, temperature, top_p, top_k):
    params = SamplingParams(24, temperature=temperature, top_p=top_p, top_k=top_k, seed=5)

    async def main():
        engine = await started(model_dir)
        result = await engine.generate_full(PROMPTS[1], params, "r")
        await engine.shutdown()
        return result

    result = run(main())
    expected = recompute_logprobs(model_dir, PROMPTS[1], result.output_ids, temperature or 1.0)
    np.testing.assert_allclose(result.logprobs, expected, atol=1e-5, rtol=0)
    assert max(result.logprobs) <= 0


def test_tiny_temperatures_decode_greedily_with_finite_logprobs(model_dir):
    # 1e-30 used to overflow logits / temperature: inf and -inf log-probs from prefill and decode
    async def main():
        engine = await started(model_dir)
        runs = [await engine.generate_full(PROMPTS[0], SamplingParams(8, temperature=t, seed=1),
                                           f"t{i}") for i, t in enumerate([0.0, 1e-30, 1e-7])]
        await engine.shutdown()
        return runs

    greedy, *tiny = run(main())
    assert np.isfinite(greedy.logprobs).all()
    for result in tiny:
        assert result.output_ids == greedy.output_ids
        assert result.logprobs == greedy.logprobs


def test_log_probs_at_small_temperatures_are_never_positive(model_dir):
    # Compiled, logits / T rounded differently in the maximum and the normaliser: +0.05 at
    # T = 2e-6 on this model, which a trainer's check of the groups rejects as not a log-prob.
    async def main():
        engine = await started(model_dir)
        runs = [await engine.generate_full(PROMPTS[i % 2], SamplingParams(16, temperature=t,
                                                                          seed=i), f"t{i}")
                for i, t in enumerate([2e-6, 1e-5, 1e-3, 2e-6])]
        await engine.shutdown()
        return runs

    for result in run(main()):
        assert np.isfinite(result.logprobs).all() and max(result.logprobs) <= 0.0


def test_top_k_one_is_greedy_and_filters_change_samples(model_dir):
    async def main():
        engine = await started(model_dir)

        def run_one(**kw):
            return engine.generate_full(PROMPTS[0], SamplingParams(20, **kw), "r")

        greedy = await run_one(temperature=0.0)
        top1 = await run_one(temperature=1.5, top_k=1, seed=3)
        tight = await run_one(temperature=1.5, top_p=1e-6, seed=4)
        free = await run_one(temperature=1.5, seed=3)
        await engine.shutdown()
        return greedy, top1, tight, free

    greedy, top1, tight, free = run(main())
    assert top1.output_ids == greedy.output_ids == tight.output_ids
    assert free.output_ids != greedy.output_ids
    # The log-prob is that of the temperature-scaled distribution, not of the filtered one.
    np.testing.assert_allclose(
        top1.logprobs, recompute_logprobs(model_dir, PROMPTS[0], top1.output_ids, 1.5), atol=1e-5
    )
    assert all(lp < -1e-3 for lp in top1.logprobs)


def test_stop_ids_and_max_new_tokens(model_dir, tmp_path):
    async def generate(path, params):
        engine = await started(path)
        result = await engine.generate_full(PROMPTS[2], params, "r")
        await engine.shutdown()
        return result

    full = run(generate(model_dir, SamplingParams(30, temperature=0.0)))
    assert full.finish_reason == "length" and len(full.output_ids) == 30
    stop = full.output_ids[6]
    cut = full.output_ids.index(stop) + 1
    stopped = run(generate(model_dir, SamplingParams(30, temperature=0.0, stop_token_ids=(stop,))))
    assert stopped.finish_reason == "stop"
    assert stopped.output_ids == full.output_ids[:cut] and stopped.output_ids[-1] == stop
    one = run(generate(model_dir, SamplingParams(1, temperature=0.0)))
    assert one.output_ids == full.output_ids[:1] and one.finish_reason == "length"

    # The model's end-of-sequence id stops generation too.
    eos = full.output_ids[9]
    eos_dir = copy_model(model_dir, tmp_path / "with_eos", eos_token_id=[96, eos])
    ended = run(generate(eos_dir, SamplingParams(30, temperature=0.0)))
    assert ended.finish_reason == "stop"
    assert ended.output_ids == full.output_ids[: full.output_ids.index(eos) + 1]


def test_end_ids_only_in_generation_config_stop_generation_as_in_transformers(
        ref_model, model_dir, tmp_path):
    """Llama 3 Instruct lists ``<|eot_id|>`` as an end id in ``generation_config.json`` only;
    transformers stops on it, and so must the engine."""
    full = hf_greedy(ref_model, PROMPTS[2], 30)
    eot = full[9]
    path = copy_model(model_dir, tmp_path / "eot", eos_token_id=96)
    (Path(path) / "generation_config.json").write_text(json.dumps({"eos_token_id": [96, eot]}))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = hf_greedy(hf, PROMPTS[2], 30)
    assert expected == full[: full.index(eot) + 1]

    async def main():
        engine = await started(path)
        try:
            return await engine.generate_full(PROMPTS[2], SamplingParams(30, temperature=0.0), "r")
        finally:
            await engine.shutdown()

    ended = run(main())
    assert (ended.finish_reason, ended.output_ids) == ("stop", expected)
    # Ids the model cannot emit are named, as in config.json.
    (Path(path) / "generation_config.json").write_text(json.dumps({"eos_token_id": [eot, 97]}))
    with pytest.raises(ConfigError, match=r"engine.model_path: .*generation_config.json: "
                                          r"eos_token_id must hold .* below vocab_size 97"):
        make_engine(path)
    # One that is there but no file (a directory, a FIFO): its end ids were lost unseen.
    (Path(path) / "generation_config.json").unlink()
    (Path(path) / "generation_config.json").mkdir()
    with pytest.raises(ConfigError, match=r"generation_config.json is not a regular file"):
        make_engine(path)


def test_seeded_sampling_does_not_depend_on_batch_company(model_dir):
    params = SamplingParams(20, temperature=0.9, top_p=0.95, seed=1234)

    async def main():
        engine = await started(model_dir)
        alone = await engine.generate_full(PROMPTS[1], params, "alone")
        others = [engine.generate_full(p, SamplingParams(12, temperature=1.0), f"o{i}")
                  for i, p in enumerate(PROMPTS)]
        busy = engine.generate_full(PROMPTS[1], params, "busy")
        results = await asyncio.gather(*others[:2], busy, others[2])
        reseeded = await engine.generate_full(
            PROMPTS[1], SamplingParams(20, temperature=0.9, top_p=0.95, seed=99), "other")
        await engine.shutdown()
        return alone, results[2], reseeded

    alone, busy, reseeded = run(main())
    assert alone.output_ids == busy.output_ids
    # Company changes the attention window (a longer cache slice), hence the summation order:
    # log-probs agree to rounding, not bit for bit.
    np.testing.assert_allclose(alone.logprobs, busy.logprobs, atol=1e-5, rtol=0)
    assert reseeded.output_ids != alone.output_ids


def test_no_recompiles_as_requests_come_and_go(model_dir):
    compiles = []

    def on_event(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    async def wave(engine, lengths, tag):
        params = [SamplingParams(3 + n % 7, temperature=0.5 * (i % 3), top_k=(i % 4) * 5 - 1,
                                 seed=i) for i, n in enumerate(lengths)]
        await asyncio.gather(*[engine.generate_full(list(range(1, n + 1)), p, f"{tag}{i}")
                               for i, (n, p) in enumerate(zip(lengths, params))])

    async def main():
        engine = await started(model_dir)
        # Each prefill layout (16, 32 and 64 tokens in one row; 64 as four rows of 16: four
        # contexts of 10) and each decode window (16, 32, 64) at each batch size (1, 2, 4).
        for n in (3, 10, 20, 50):
            for k in (1, 2, 4):
                await wave(engine, [n] * k, f"warm{n}x{k}")
        warm_calls = engine.stats()["prefill_calls"]
        jax.monitoring.register_event_duration_secs_listener(on_event)
        try:
            await wave(engine, [1, 9, 15, 17, 31, 33, 40, 56, 2, 12], "w")
            await wave(engine, [5, 25, 45], "x")
        finally:
            jax.monitoring.unregister_event_duration_listener(on_event)
        stats = engine.stats()
        await engine.shutdown()
        return stats, stats["prefill_calls"] - warm_calls

    stats, prefill_calls = run(main())
    assert compiles == []
    # Requests admitted together share a prefill call: fewer calls than the 13 requests.
    assert prefill_calls < 13 and stats["running_slots"] == 0


def test_precompile_leaves_nothing_to_compile_and_serves_the_same_tokens(ref_model, model_dir):
    traced = []

    def on_event(event, duration, **kwargs):
        if event == "/jax/core/compile/jaxpr_trace_duration":
            traced.append(kwargs.get("fun_name"))
            threads.append(threading.current_thread().name)

    threads = []
    # Shapes of their own (no other test uses them), so nothing here is compiled already.
    options = dict(num_slots=3, max_seq_len=48, decode_steps_per_call=3, precompile=True,
                   compile_threads=4)
    lengths = [16, 23, 9]
    expected = [hf_greedy(ref_model, p, n) for p, n in zip(PROMPTS, lengths)]

    async def main():
        jax.monitoring.register_event_duration_secs_listener(on_event)
        try:
            engine = await started(model_dir, **options)
            # Each program traced once, on its compile thread: the run after it only runs.
            o = engine.options
            layouts = jax_worker.prefill_layouts(o.prefill_buckets)
            assert traced.count("prefill") == sum(map(len, layouts.values())) == 3
            assert traced.count("decode") == len(o.prefill_buckets) * len(o.batch_buckets) == 6
            assert {t for f, t in zip(traced, threads) if f in ("prefill", "decode")} <= {
                f"jax-engine-compile_{i}" for i in range(4)}
            traced.clear()
            company = [engine.generate_full([7] * (2 + 9 * i), SamplingParams(4 + 5 * i, seed=i),
                                            f"c{i}") for i in range(3)]
            mine = [engine.generate_full(p, SamplingParams(n, temperature=0.0), f"b{i}")
                    for i, (p, n) in enumerate(zip(PROMPTS, lengths))]
            out = await asyncio.gather(*company[:2], *mine, company[2])
            await engine.generate_full(list(range(1, 41)), SamplingParams(8, seed=5), "long")
        finally:
            jax.monitoring.unregister_event_duration_listener(on_event)
        await engine.shutdown()
        return out[2:5]

    together = run(main())
    assert traced == []  # every program a request met was compiled at start
    assert [t.output_ids for t in together] == expected  # the empty calls wrote nothing read


def test_pause_holds_tokens_until_resume(model_dir):
    async def main():
        engine = await started(model_dir)
        await engine.pause()
        await engine.pause()
        assert engine.paused
        chunks = engine.generate(PROMPTS[0], GREEDY, "r")
        first = asyncio.ensure_future(chunks.__anext__())
        await asyncio.sleep(0.5)
        waited = not first.done()
        await engine.resume()
        await engine.resume()
        ids = list((await first).token_ids)
        async for chunk in chunks:
            ids += chunk.token_ids
        await engine.shutdown()
        return waited, ids

    waited, ids = run(main())
    assert waited
    assert len(ids) == 16


def test_paused_reports_the_workers_state_and_paused_engines_drop_given_up_requests(model_dir):
    # A resume whose caller gave up before the worker took it never takes effect; the engine
    # said "not paused" while it held every request. And requests cancelled while paused were
    # kept (each with a vocabulary-sized row) until the resume.
    async def main():
        engine = await started(model_dir)
        worker = engine._worker
        with worker._cond:  # both commands queue before the worker can take either
            pause = asyncio.ensure_future(engine.pause())
            resume = asyncio.ensure_future(engine.resume())
            await asyncio.sleep(0.01)
            resume.cancel()
            await asyncio.sleep(0.01)
        await pause
        paused_after_cancelled_resume = engine.paused
        given_up = [asyncio.ensure_future(engine.generate_full(p, GREEDY, f"g{i}"))
                    for i, p in enumerate(PROMPTS * 4)]
        await until(lambda: engine.stats()["queued_requests"] == len(given_up))
        for task in given_up:
            task.cancel()
        await until(lambda: engine.stats()["queued_requests"] == 0)
        still_paused = engine.paused
        await engine.resume()
        served = await engine.generate_full(PROMPTS[0], GREEDY, "after")
        await engine.shutdown()
        return paused_after_cancelled_resume, still_paused, engine.paused, served

    paused_after_cancelled_resume, still_paused, after_shutdown, served = run(main())
    assert paused_after_cancelled_resume and still_paused
    assert len(served.output_ids) == 16 and not after_shutdown


def test_a_cancelled_running_request_frees_its_slot(model_dir):
    # What a server does for a request its client withdrew: the generating sequence stops,
    # its slot is free, and the engine serves the next request.
    async def main():
        engine = await started(model_dir, max_seq_len=256, prefill_buckets=[256],
                               decode_steps_per_call=1)
        task = asyncio.ensure_future(engine.generate_full(
            PROMPTS[0], SamplingParams(240, temperature=0.0), "long"))
        await until(lambda: engine.stats()["tokens_generated"] >= 2)
        task.cancel()
        await until(lambda: engine.stats()["running_slots"] == 0)
        stopped_at = engine.stats()["decode_rows"]  # one row per step of the one sequence
        served = await engine.generate_full(PROMPTS[1], GREEDY, "after")
        await engine.shutdown()
        return stopped_at, served

    stopped_at, served = run(main())
    assert stopped_at < 240 and len(served.output_ids) == 16


def test_shutdown_aborts_in_flight_requests(model_dir):
    async def main():
        engine = await started(model_dir, max_seq_len=256, prefill_buckets=[256],
                               decode_steps_per_call=1)
        long = SamplingParams(240, temperature=0.0)
        reference = await engine.generate_full(PROMPTS[0], long, "ref")
        chunks = engine.generate(PROMPTS[0], long, "r")
        got = [await chunks.__anext__()]
        await engine.pause()
        queued = asyncio.ensure_future(engine.generate_full(PROMPTS[1], GREEDY, "q"))
        await asyncio.sleep(0.05)
        await engine.shutdown()
        got += [c async for c in chunks]
        late = await engine.generate_full(PROMPTS[1], GREEDY, "late")
        return reference, got, await queued, late

    reference, got, queued, late = run(main())
    ids = [t for c in got for t in c.token_ids]
    assert got[-1].finish_reason == "abort" and all(c.finish_reason is None for c in got[:-1])
    assert 0 < len(ids) < 240 and ids == reference.output_ids[: len(ids)]
    assert queued.finish_reason == "abort" and queued.output_ids == []
    assert late.finish_reason == "abort"


def test_a_dead_worker_fails_the_engine_for_good(model_dir, monkeypatch):
    from rollout.engines import jax_decode

    def broken_decode(*args, **kwargs):
        raise RuntimeError("device lost")

    async def main():
        engine = await started(model_dir)
        healthy = engine.failure
        monkeypatch.setattr(jax_decode, "decode", broken_decode)
        with pytest.raises(EngineError, match="device lost"):
            await engine.generate_full(PROMPTS[0], GREEDY, "a")
        failure = engine.failure
        with pytest.raises(EngineError) as later:
            await engine.generate_full(PROMPTS[1], GREEDY, "b")
        await engine.shutdown()
        return healthy, failure, later.value

    healthy, failure, later = run(main())
    assert healthy is None
    assert "JAX engine failed: RuntimeError: device lost" in str(failure) and later is failure


def test_a_top_k_beyond_int32_samples_from_every_token_and_harms_no_other_request(model_dir):
    # It overflowed the engine's int32 sampling fields on the worker thread, which failed the
    # engine for good, and every request with it.
    async def main():
        engine = await started(model_dir)
        beside = asyncio.ensure_future(engine.generate_full(PROMPTS[1], SamplingParams(20), "g"))
        huge = await engine.generate_full(
            PROMPTS[0], SamplingParams(20, temperature=1.0, top_k=2**31, seed=5), "k")
        every = await engine.generate_full(
            PROMPTS[0], SamplingParams(20, temperature=1.0, top_k=-1, seed=5), "a")
        greedy = await beside
        failure = engine.failure
        await engine.shutdown()
        return huge, every, greedy, failure

    huge, every, greedy, failure = run(main())
    assert failure is None and len(greedy.output_ids) == 20
    assert huge.output_ids == every.output_ids  # same seed: the same tokens
    np.testing.assert_allclose(huge.logprobs, every.logprobs, atol=1e-5)  # batch company apart


def test_a_start_that_fails_can_be_retried_and_a_shut_down_engine_aborts(model_dir, monkeypatch):
    # A start failing in its compile (an out-of-memory on a GPU) left a worker that never ran:
    # a second start returned at once, then generate and shutdown waited for ever. An engine
    # shut down before its start could be started again, its worker thread outliving shutdown.
    from rollout.engines import jax_worker

    compile_all = jax_worker.DecodeWorker.precompile

    def failing(self, threads):
        raise RuntimeError("RESOURCE_EXHAUSTED: simulated out of memory while compiling")

    async def main():
        engine = make_engine(model_dir, precompile=True)
        monkeypatch.setattr(jax_worker.DecodeWorker, "precompile", failing)
        with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED"):
            await engine.start()
        monkeypatch.setattr(jax_worker.DecodeWorker, "precompile", compile_all)
        await asyncio.wait_for(engine.start(), 120)
        served = await asyncio.wait_for(engine.generate_full(PROMPTS[0], GREEDY, "a"), 60)
        await asyncio.wait_for(engine.shutdown(), 60)
        closed = make_engine(model_dir)
        await closed.shutdown()
        aborted = await closed.generate_full(PROMPTS[0], GREEDY, "b")
        with pytest.raises(EngineError, match="shut down"):
            await closed.start()
        return served, aborted

    served, aborted = run(main())
    assert len(served.output_ids) == GREEDY.max_new_tokens
    assert aborted.finish_reason == "abort" and aborted.output_ids == []


def test_an_engine_shut_down_while_it_starts_does_not_start(model_dir, monkeypatch):
    # Its start went on after the shutdown: a decode thread ran on an engine that said it was
    # shut down.
    from rollout.engines import jax_worker

    def slow(self, threads):
        time.sleep(0.5)
        return 0

    monkeypatch.setattr(jax_worker.DecodeWorker, "precompile", slow)

    async def main():
        engine = make_engine(model_dir, precompile=True)
        starting = asyncio.ensure_future(engine.start())
        await asyncio.sleep(0.1)
        await engine.shutdown()
        with pytest.raises(EngineError, match="shut down while it started"):
            await starting
        return engine._worker

    assert run(main()) is None


def test_closing_the_stream_frees_the_slot(model_dir):
    async def main():
        engine = await started(model_dir, num_slots=1, prefill_buckets=[64],
                               decode_steps_per_call=1)
        stream = engine.generate(PROMPTS[0], SamplingParams(50, temperature=0.0), "a")
        async with contextlib.aclosing(stream) as chunks:
            await chunks.__anext__()
        done = await asyncio.wait_for(engine.generate_full(PROMPTS[1], GREEDY, "b"), timeout=60)
        stats = engine.stats()
        await engine.shutdown()
        return done, stats

    done, stats = run(main())
    assert done.finish_reason == "length" and len(done.output_ids) == 16
    assert stats["running_slots"] == 0 and stats["queued_requests"] == 0
    assert stats["tokens_generated"] >= 17


def test_invalid_requests_name_the_field(model_dir):
    async def first_error(prompt, params):
        engine = await started(model_dir)
        try:
            await engine.generate_full(prompt, params, "bad")
        except InvalidParamError as e:
            return e.field
        finally:
            await engine.shutdown()

    assert run(first_error([1, 200], GREEDY)) == "prompt_ids[1]"
    assert run(first_error([], GREEDY)) == "prompt_ids"
    assert run(first_error([1] * 50, GREEDY)) == "max_new_tokens"
    assert run(first_error([1], SamplingParams(4, stop_token_ids=(97,)))) == "stop_token_ids[0]"
    with pytest.raises(EngineError, match="not been started"):
        run(make_engine(model_dir).generate_full([1], GREEDY, "x"))


@pytest.mark.parametrize("options,key", [
    ({"num_slot": 4}, "engine.options.num_slot"),
    ({"num_slots": 0}, "engine.options.num_slots"),
    ({"max_seq_len": 1024}, "engine.options.max_seq_len"),
    ({"prefill_buckets": [16, 128]}, "engine.options.prefill_buckets[1]"),
    ({"swap_mode": "later"}, "engine.options.swap_mode"),
    ({"batch_buckets": [2, 5]}, "engine.options.batch_buckets[1]"),
    ({"batch_buckets": []}, "engine.options.batch_buckets"),
    ({"dtype": "float8"}, "engine.options.dtype"),
    ({"precompile": "yes"}, "engine.options.precompile"),
    ({"compile_threads": 0}, "engine.options.compile_threads"),
])
def test_bad_options_name_the_key(model_dir, options, key):
    with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
        make_engine(model_dir, **options)


def test_option_defaults(model_dir):
    engine = create_engine(EngineConfig(kind="jax", model_path=model_dir))
    o = engine.options
    assert (o.num_slots, o.decode_steps_per_call) == (8, 8)
    assert (o.swap_mode, o.dtype, o.seed, o.precompile) == ("interrupt", "float32", 0, False)
    assert o.max_seq_len == engine.max_context_len == 256  # the model's max positions
    assert o.prefill_buckets == [16, 32, 64, 128, 256]
    assert o.batch_buckets == [2, 4, 8]
    assert engine.vocab_size == 97


def test_unset_dtype_and_decode_steps_follow_the_backend(monkeypatch):
    """Unset, the dtype and the decode steps per call are fp32 and 8 on a CPU, bf16 and 32 on
    an accelerator; set, they stay as given."""
    cfg = ModelConfig.from_hf_dict({"model_type": "qwen2", "vocab_size": 97, "hidden_size": 16,
                                    "intermediate_size": 32, "num_hidden_layers": 1,
                                    "num_attention_heads": 2, "num_key_value_heads": 1,
                                    "max_position_embeddings": 64})
    unset, given = JaxEngineOptions(), JaxEngineOptions(decode_steps_per_call=4, dtype="float32")
    picked = {}
    for backend in ("cpu", "gpu"):
        monkeypatch.setattr(jax_engine.jax, "default_backend", lambda b=backend: b)
        o = unset.resolved(cfg)
        picked[backend] = (o.dtype, o.decode_steps_per_call)
        assert (given.resolved(cfg).dtype, given.resolved(cfg).decode_steps_per_call) == (
            "float32", 4)
    assert picked == {"cpu": ("float32", 8), "gpu": ("bfloat16", 32)}


def test_decode_calls_compute_only_the_live_batch(ref_model, model_dir):
    """A request decoding alone costs one row per call, not ``num_slots``; one running
    beside two finished ones costs the smallest bucket that holds it; outputs stay greedy HF."""
    long = SamplingParams(max_new_tokens=40, temperature=0.0)

    async def main():
        engine = await started(model_dir, batch_buckets=[1, 2])
        alone = await engine.generate_full(PROMPTS[0], long, "alone")
        alone_stats = engine.stats()
        short = [engine.generate_full(p, SamplingParams(2, temperature=0.0), f"s{i}")
                 for i, p in enumerate(PROMPTS[1:])]
        results = await asyncio.gather(engine.generate_full(PROMPTS[0], long, "mixed"), *short)
        stats = engine.stats()
        await engine.shutdown()
        return alone, alone_stats, results[0], stats

    alone, alone_stats, mixed, stats = run(main())
    assert alone_stats["decode_rows"] == alone_stats["decode_calls"]
    calls = stats["decode_calls"] - alone_stats["decode_calls"]
    rows = stats["decode_rows"] - alone_stats["decode_rows"]
    # The first call holds three live slots (bucket 4), the last ones one (bucket 1).
    assert calls + 3 <= rows < 4 * calls
    want = hf_greedy(ref_model, PROMPTS[0], 40)
    assert alone.output_ids == mixed.output_ids == want


def test_decoding_starts_before_the_prefill_is_read_back(ref_model, model_dir, monkeypatch):
    """An admission costs the device its prefill, not a round trip through the host: the first
    decode call is dispatched right behind the prefill, from the slot state it left on the
    device, and the prefill's tokens are read back while that call runs. Outputs stay greedy
    HF, for a request admitted alone and for two admitted beside a running one."""
    events = []

    def recorded(name, fn):
        def call(*args, **kwargs):
            out = fn(*args, **kwargs)
            if threading.current_thread().name == "jax-engine-worker":
                events.append(name)
            return out
        return call

    monkeypatch.setattr(jax_decode, "prefill", recorded("prefill", jax_decode.prefill))
    monkeypatch.setattr(jax_decode, "decode", recorded("decode", jax_decode.decode))
    monkeypatch.setattr(jax_worker.jax, "device_get", recorded("read", jax.device_get))

    async def main():
        engine = await started(model_dir)
        alone = await engine.generate_full(PROMPTS[0], GREEDY, "alone")
        first = list(events)
        before = engine.stats()["decode_calls"]
        running = asyncio.ensure_future(
            engine.generate_full(PROMPTS[1], SamplingParams(40, temperature=0.0), "running"))
        while engine.stats()["decode_calls"] < before + 2:  # it decodes before the others come
            await asyncio.sleep(0.01)
        joined = await asyncio.gather(*[
            engine.generate_full(p, GREEDY, f"joined{i}") for i, p in enumerate(PROMPTS[::2])])
        await running
        await engine.shutdown()
        return alone, first, joined

    alone, first, joined = run(main())
    assert first[:3] == ["prefill", "decode", "read"] and first.count("prefill") == 1
    # Every prefill is followed by a decode call before anything is read back.
    prefills = [i for i, e in enumerate(events) if e == "prefill"]
    assert len(prefills) >= 2 and all(events[i + 1] == "decode" for i in prefills)
    assert alone.output_ids == hf_greedy(ref_model, PROMPTS[0], 16)
    assert [r.output_ids for r in joined] == [hf_greedy(ref_model, p, 16) for p in PROMPTS[::2]]


def test_short_contexts_prefill_in_narrow_rows(ref_model, model_dir, monkeypatch):
    """Contexts admitted together are laid out in the narrowest rows that hold them (four of
    at most 16 tokens: four rows of 16, not one row of 64), attention kept within each; the
    tokens stay greedy HF and the log-probs those of each request prefilled alone."""
    assert jax_worker.prefill_layouts([16, 32, 64, 128, 256, 512, 1024]) == {
        16: [16], 32: [32], 64: [16, 64], 128: [32, 128], 256: [16, 64, 256],
        512: [32, 128, 512], 1024: [64, 256, 1024]}
    shapes = []
    prefill = jax_decode.prefill

    def recorded(*args):
        shapes.append(args[5].shape)  # the tokens' rows
        return prefill(*args)

    monkeypatch.setattr(jax_decode, "prefill", recorded)
    prompts = [PROMPTS[0], PROMPTS[1], list(range(40, 54)), list(range(60, 69))]  # 5-14 tokens

    async def main():
        engine = await started(model_dir)
        alone = [await engine.generate_full(p, GREEDY, f"a{i}") for i, p in enumerate(prompts)]
        await engine.pause()  # the four queue, then are admitted in one round
        together = [asyncio.ensure_future(engine.generate_full(p, GREEDY, f"t{i}"))
                    for i, p in enumerate(prompts)]
        await asyncio.sleep(0.2)
        await engine.resume()
        together = await asyncio.gather(*together)
        await engine.shutdown()
        return alone, together

    alone, together = run(main())
    assert shapes[:4] == [(1, 16)] * 4 and shapes[4:] == [(4, 16)]  # 39 tokens in rows of 16
    for p, a, t in zip(prompts, alone, together):
        assert a.output_ids == t.output_ids == hf_greedy(ref_model, p, 16)
        np.testing.assert_allclose(a.logprobs, t.logprobs, atol=1e-5, rtol=0)


def test_requests_ending_at_their_prefill_token_beside_a_running_one(ref_model, model_dir):
    """A request whose first token ends it (its only token; or a stop id), admitted while
    another decodes, gets that token alone and frees its slot; the request decoding beside it
    goes on unchanged."""
    first = hf_greedy(ref_model, PROMPTS[2], 1)[0]

    async def main():
        engine = await started(model_dir)
        running = asyncio.ensure_future(
            engine.generate_full(PROMPTS[1], SamplingParams(40, temperature=0.0), "running"))
        while engine.stats()["decode_calls"] < 2:  # decoding before the others come
            await asyncio.sleep(0.01)
        one, stopped = await asyncio.gather(
            engine.generate_full(PROMPTS[0], SamplingParams(1, temperature=0.0), "one"),
            engine.generate_full(PROMPTS[2], SamplingParams(
                16, temperature=0.0, stop_token_ids=(first,)), "stopped"))
        result = await running
        stats = engine.stats()
        await engine.shutdown()
        return one, stopped, result, stats

    one, stopped, result, stats = run(main())
    assert (one.output_ids, one.finish_reason) == (hf_greedy(ref_model, PROMPTS[0], 1), "length")
    assert (stopped.output_ids, stopped.finish_reason) == ([first], "stop")
    assert result.output_ids == hf_greedy(ref_model, PROMPTS[1], 40)
    assert stats["running_slots"] == 0
