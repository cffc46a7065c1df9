"""Weight swaps in the JAX engine: interrupt and re-prefill, keep the cache, drain, and failed
loads."""

import asyncio
import json
import shutil

import jax
import numpy as np
import pytest

from _hf_models import hf_greedy, hf_model, save_hf_model
from rollout.config import EngineConfig
from rollout.engine import SamplingParams, WeightLoadError
from rollout.engines import create_engine

OPTIONS = dict(num_slots=4, max_seq_len=256, prefill_buckets=[64], decode_steps_per_call=1)
PROMPTS = [[5, 17, 3, 88, 41], list(range(20, 31)), [int(x) for x in np.arange(19) * 7 % 97]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two weight sets of one architecture, as transformers models and checkpoint dirs."""
    old, new = hf_model("qwen2", seed=21), hf_model("qwen2", seed=22)
    root = tmp_path_factory.mktemp("swap")
    return {"old": (old, str(save_hf_model(old, root / "old"))),
            "new": (new, str(save_hf_model(new, root / "new")))}


async def started(path, version, **options):
    engine = create_engine(EngineConfig(kind="jax", model_path=path, initial_version=version,
                                        options={**OPTIONS, **options}))
    await engine.start()
    return engine


def run(coro):
    return asyncio.run(coro)


def greedy(n):
    return SamplingParams(n, temperature=0.0)


async def collect_chunks(chunks):
    ids, versions = [], []
    async for chunk in chunks:
        ids += chunk.token_ids
        versions += chunk.versions
    return ids, versions


def split_by_version(ids, versions, old_version):
    """(tokens of the old version, tokens after it); versions must not go back."""
    assert versions == sorted(versions)
    cut = versions.count(old_version)
    return ids[:cut], ids[cut:]


def test_swap_while_paused_continues_with_new_weights(models):
    (old_model, old_dir), (new_model, new_dir) = models["old"], models["new"]

    compiles = []

    def on_event(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    async def main():
        engine = await started(old_dir, 3)
        await engine.generate_full(PROMPTS[0], greedy(40), "warm-up")  # compiles what follows
        jax.monitoring.register_event_duration_secs_listener(on_event)
        try:
            chunks = engine.generate(PROMPTS[0], greedy(40), "r")
            first = await chunks.__anext__()
            await engine.pause()
            await engine.update_weights(new_dir, 4)
            state = (engine.version, engine.paused)
            await engine.resume()
            ids, versions = await collect_chunks(chunks)
        finally:
            jax.monitoring.unregister_event_duration_listener(on_event)
        after = await engine.generate_full(PROMPTS[1], greedy(12), "after")
        stats = engine.stats()
        await engine.shutdown()
        return first, ids, versions, state, after, stats

    first, ids, versions, state, after, stats = run(main())
    assert state == (4, True)
    assert compiles == []  # new weights reuse the compiled programs
    ids, versions = list(first.token_ids) + ids, list(first.versions) + versions
    before, cont = split_by_version(ids, versions, 3)
    assert len(ids) == 40 and set(versions) == {3, 4} and before and cont
    assert before == hf_greedy(old_model, PROMPTS[0], len(before))
    assert cont == hf_greedy(new_model, PROMPTS[0] + before, len(cont))
    assert after.output_ids == hf_greedy(new_model, PROMPTS[1], 12) and set(after.versions) == {4}
    assert stats["swaps"] == 1 and stats["reprefills"] == 1


LENGTHS = [240, 200, 150]


def swap_mid_generation(old_dir, new_dir, **options):
    """Greedy sequences of ``LENGTHS`` after ``PROMPTS`` on ``old_dir`` (version 0), with a swap
    to ``new_dir`` (version 1) once each has its first token: ([(ids, versions)], stats)."""

    async def main():
        engine = await started(old_dir, 0, **options)
        streams = [engine.generate(p, greedy(n), f"r{i}")
                   for i, (p, n) in enumerate(zip(PROMPTS, LENGTHS))]
        firsts = [await s.__anext__() for s in streams]
        update = asyncio.ensure_future(engine.update_weights(new_dir, 1))
        rest = await asyncio.gather(*[collect_chunks(s) for s in streams])
        await update
        stats = engine.stats()
        await engine.shutdown()
        return [(list(f.token_ids) + ids, list(f.versions) + vs)
                for f, (ids, vs) in zip(firsts, rest)], stats

    return run(main())


def test_interrupting_swap_mid_generation(models):
    """The swap lands while several sequences decode; each continues on the new weights."""
    (old_model, old_dir), (new_model, new_dir) = models["old"], models["new"]
    results, stats = swap_mid_generation(old_dir, new_dir)
    assert stats["swaps"] == 1
    assert stats["reprefills"] == sum(set(versions) == {0, 1} for _, versions in results) > 0
    for prompt, n, (ids, versions) in zip(PROMPTS, LENGTHS, results):
        before, cont = split_by_version(ids, versions, 0)
        assert len(ids) == n and before
        assert before == hf_greedy(old_model, prompt, len(before))
        assert cont == hf_greedy(new_model, prompt + before, len(cont))


def hf_greedy_on_cache(old_model, new_model, context, n):
    """Greedy tokens of ``new_model`` after ``context`` when the KV cache of all but its last
    token was computed by ``old_model`` (what a swap that keeps the cache serves)."""
    import torch

    with torch.no_grad():
        cache = old_model(torch.tensor([context[:-1]]), use_cache=True).past_key_values
        token, out = context[-1], []
        for _ in range(n):
            step = new_model(torch.tensor([[token]]), past_key_values=cache, use_cache=True)
            cache, token = step.past_key_values, int(step.logits[0, -1].argmax())
            out.append(token)
    return out


def test_keep_cache_swap_continues_on_the_old_cache(models):
    """With ``keep_cache`` the swap lands mid-generation without any re-prefill: later tokens
    come from the new weights over keys and values the old weights wrote."""
    (old_model, old_dir), (new_model, new_dir) = models["old"], models["new"]
    results, stats = swap_mid_generation(old_dir, new_dir, swap_mode="keep_cache")
    assert stats["swaps"] == 1 and stats["reprefills"] == 0
    swapped = 0
    for prompt, n, (ids, versions) in zip(PROMPTS, LENGTHS, results):
        before, cont = split_by_version(ids, versions, 0)
        assert len(ids) == n and before
        assert before == hf_greedy(old_model, prompt, len(before))
        if cont:
            swapped += 1
            assert cont == hf_greedy_on_cache(old_model, new_model, prompt + before, len(cont))
            assert cont != hf_greedy(new_model, prompt + before, len(cont))  # not re-prefilled
    assert swapped


def test_drain_swap_waits_for_running_sequences(models):
    (old_model, old_dir), (new_model, new_dir) = models["old"], models["new"]

    async def main():
        engine = await started(old_dir, 0, swap_mode="drain")
        running = asyncio.ensure_future(engine.generate_full(PROMPTS[0], greedy(200), "long"))
        while engine.stats()["running_slots"] == 0:
            await asyncio.sleep(0.001)
        await engine.update_weights(new_dir, 1)
        finished_first = running.done()
        after = await engine.generate_full(PROMPTS[1], greedy(10), "after")
        await engine.shutdown()
        return await running, finished_first, after

    long, finished_first, after = run(main())
    assert finished_first
    assert set(long.versions) == {0} and long.output_ids == hf_greedy(old_model, PROMPTS[0], 200)
    assert set(after.versions) == {1} and after.output_ids == hf_greedy(new_model, PROMPTS[1], 10)


def _truncated(src, dst):
    shutil.copytree(src, dst)
    weights = dst / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return dst


def _bad_config(src, dst, text="{not json"):
    shutil.copytree(src, dst)
    (dst / "config.json").write_text(text)
    return dst


def test_failed_loads_keep_serving_the_old_weights(models, tmp_path):
    (old_model, old_dir), (_, new_dir) = models["old"], models["new"]
    bad = {
        "truncated": (str(_truncated(new_dir, tmp_path / "truncated")), "truncated"),
        "layers": (str(save_hf_model(hf_model("qwen2", seed=5, num_hidden_layers=3),
                                     tmp_path / "l3")),
                   "num_layers is 3, the served model has 2"),
        "family": (str(save_hf_model(hf_model("qwen3", seed=5), tmp_path / "qwen3")),
                   "model_type is 'qwen3'"),
        "missing": (str(tmp_path / "nowhere"), "no config.json"),
        "config": (str(_bad_config(new_dir, tmp_path / "badcfg")), "not valid JSON"),
        # A raw AttributeError, not a failed load: the server answered UNKNOWN.
        "list": (str(_bad_config(new_dir, tmp_path / "listcfg", "[1, 2]")),
                 "must hold a JSON object"),
    }
    # A config that matches but weights of the wrong shape.
    wide = save_hf_model(hf_model("qwen2", seed=5, intermediate_size=64), tmp_path / "wide")
    cfg = json.loads((wide / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 48}))
    bad["shapes"] = (str(wide), "has shape")

    async def main():
        engine = await started(old_dir, 2)
        errors = {}
        running = asyncio.ensure_future(engine.generate_full(PROMPTS[2], greedy(120), "during"))
        for name, (path, _) in bad.items():
            try:
                await engine.update_weights(path, 3)
            except WeightLoadError as e:
                errors[name] = (str(e), engine.version)
        during = await running
        after = await engine.generate_full(PROMPTS[0], greedy(30), "after")
        await engine.shutdown()
        return errors, during, after

    errors, during, after = run(main())
    for name, (_, expected) in bad.items():
        message, version = errors[name]
        assert expected in message and version == 2, (name, message)
    assert set(during.versions) == {2}
    assert during.output_ids == hf_greedy(old_model, PROMPTS[2], 120)
    assert set(after.versions) == {2} and after.output_ids == hf_greedy(old_model, PROMPTS[0], 30)


def test_a_swap_that_fails_on_the_device_keeps_serving_the_old_weights(models, monkeypatch):
    # Placing the new weights (a device computation: it can run out of memory) ran after the
    # engine had switched its version: a failure killed the engine and left the call waiting.
    from rollout.engines import jax_decode

    (old_model, old_dir), (_, new_dir) = models["old"], models["new"]

    async def main():
        engine = await started(old_dir, 2)

        def out_of_memory(*args):
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")

        monkeypatch.setattr(jax_decode, "split_layers", out_of_memory)
        with pytest.raises(WeightLoadError, match="placing the weights of version 3 on the "
                                                  "device failed: RuntimeError: RESOURCE_EXH"):
            await engine.update_weights(new_dir, 3)
        after = await engine.generate_full(PROMPTS[0], greedy(20), "after")
        failure, version = engine.failure, engine.version
        await engine.shutdown()
        return after, failure, version

    after, failure, version = run(main())
    assert failure is None and version == 2
    assert set(after.versions) == {2} and after.output_ids == hf_greedy(old_model, PROMPTS[0], 20)


def test_commands_whose_callers_gave_up_neither_act_nor_kill_the_engine(models):
    # A Pause or UpdateWeights past its gRPC deadline cancels the command's future; the worker
    # used to apply it anyway and then fail on resolving a cancelled future, taking every
    # request and the server down with it.
    old_model, old_dir = models["old"]

    async def main():
        engine = await started(old_dir, 2)
        running = asyncio.ensure_future(engine.generate_full(PROMPTS[2], greedy(60), "during"))
        worker = engine._worker
        with worker._cond:  # the worker takes no command until both are cancelled
            for command in (worker.pause(), worker.resume(), worker.pause()):
                assert command.cancel()
        during = await running
        after = await engine.generate_full(PROMPTS[0], greedy(20), "after")
        failure, paused = engine.failure, engine.paused
        await engine.shutdown()
        return during, after, failure, paused

    during, after, failure, paused = run(main())
    assert failure is None and not paused
    assert during.output_ids == hf_greedy(old_model, PROMPTS[2], 60)
    assert after.output_ids == hf_greedy(old_model, PROMPTS[0], 20)


def test_forced_swap_to_an_older_version_continues_with_its_weights(models):
    """A trainer restored from an older checkpoint takes the engine back to its version."""
    (old_model, old_dir), (new_model, new_dir) = models["old"], models["new"]

    async def main():
        engine = await started(new_dir, 7)
        chunks = engine.generate(PROMPTS[0], greedy(40), "r")
        first = await chunks.__anext__()
        await engine.update_weights(old_dir, 3)
        ids, versions = await collect_chunks(chunks)
        version = engine.version
        await engine.shutdown()
        return list(first.token_ids) + ids, list(first.versions) + versions, version

    ids, versions, version = run(main())
    cut = versions.count(7)
    assert version == 3 and len(ids) == 40 and 0 < cut < 40
    assert versions == [7] * cut + [3] * (40 - cut)
    assert ids[:cut] == hf_greedy(new_model, PROMPTS[0], cut)
    assert ids[cut:] == hf_greedy(old_model, PROMPTS[0] + ids[:cut], 40 - cut)
