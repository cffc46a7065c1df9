"""Reward registry, the math reward and the reward process pool."""

import asyncio
import os
import sys
import time

import pytest

from areal_jax.rewards import (
    RewardNotFoundError,
    RewardPool,
    available_rewards,
    get_reward,
    register_reward,
)
from areal_jax.rewards.math_answer import math_reward


def constant_reward(completion: str, metadata: dict) -> float:
    return float(metadata.get("value", 0.5))


def hanging_reward(completion: str, metadata: dict) -> float:
    time.sleep(600)
    return 1.0


def hanging_on_request_reward(completion: str, metadata: dict) -> float:
    if completion == "hang":
        time.sleep(600)
    return 1.0


def crashing_reward(completion: str, metadata: dict) -> float:
    os._exit(3)


def raising_reward(completion: str, metadata: dict) -> float:
    raise RuntimeError("broken reward")


def nan_reward(completion: str, metadata: dict) -> float:
    return float("nan")


def text_reward(completion: str, metadata: dict) -> float:
    return "1.0"  # a number's text, not a number


def returned_reward(completion: str, metadata: dict):
    """Returns what the completion names: None, a huge number, or a metadata key's value; or
    exits."""
    if completion == "exit":
        sys.exit(3)
    returned = {"none": None, "huge": 1e300, "list": [1.0]}
    return returned[completion] if completion in returned else metadata["gold"]


async def async_reward(completion: str, metadata: dict) -> float:
    return 1.0


def length_reward(completion: str, metadata: dict) -> float:
    return float(len(completion))


register_reward("test_length")(length_reward)


# --- registry -----------------------------------------------------------------------------


def test_builtins_and_registered_names_are_listed():
    names = available_rewards()
    assert {"math", "code", "code_fraction", "synthetic_arith", "test_length"} <= set(names)
    assert names == sorted(names)
    assert get_reward("test_length")("abc", {}) == 3.0
    assert get_reward("math") is math_reward


def test_unknown_names_and_dotted_paths_are_not_resolved():
    with pytest.raises(RewardNotFoundError, match="not registered; available: code"):
        get_reward("nope")
    for path in (f"{__name__}:constant_reward", f"{__name__}.constant_reward", "builtins:exec"):
        with pytest.raises(RewardNotFoundError, match="must be registered in config"):
            get_reward(path)


def test_registration_conflicts_are_errors():
    register_reward("test_length")(length_reward)  # same function again: fine
    with pytest.raises(ValueError, match="already registered"):
        register_reward("test_length")(constant_reward)
    with pytest.raises(ValueError, match="built-in"):
        register_reward("math")(constant_reward)


# --- math reward --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        (r"So the result is \boxed{\frac{1}{2}}.", "0.5", 1.0),
        (r"We get $\boxed{0.5}$", r"\frac{1}{2}", 1.0),
        (r"\boxed{\sqrt 2}", r"\sqrt{2}", 1.0),
        (r"\boxed{1+x^2}", "x^2+1", 1.0),
        (r"\boxed{1000}", "1,000", 1.0),
        (r"\boxed{(1, 2)}", "(1,2)", 1.0),
        (r"\boxed{3}", "4", 0.0),
        (r"It is \boxed{5} or maybe \boxed{6}", "6", 0.0),  # hedging: all boxes form a set
        (r"It is \boxed{5} and \boxed{6}", "5, 6", 1.0),
        ("The total is 12 apples. Answer: 72", "72", 1.0),
        ("I get 72 at first, then answer: 70", "72", 0.0),
        ("After simplifying we get 41", "41", 1.0),
        ("I do not know.", "41", 0.0),
    ],
)
def test_math_reward_hand_examples(completion, answer, expected):
    assert math_reward(completion, {"answer": answer}) == expected


def test_math_reward_needs_a_usable_gold_answer():
    with pytest.raises(KeyError, match="answer"):
        math_reward(r"\boxed{1}", {})
    with pytest.raises(ValueError, match="empty"):
        math_reward(r"\boxed{1}", {"answer": "  "})


# --- pool ---------------------------------------------------------------------------------


CUSTOM = {
    name: f"{__name__}:{name}"
    for name in ("constant_reward", "raising_reward", "nan_reward", "hanging_reward",
                 "hanging_on_request_reward", "crashing_reward", "text_reward",
                 "returned_reward")
}


@pytest.fixture(scope="module")
def pool():
    with RewardPool(num_workers=2, timeout_s=20.0, custom=CUSTOM) as p:
        yield p


def test_pool_scores_builtin_registered_and_custom_rewards(pool):
    async def main():
        return await asyncio.gather(
            pool.score("math", r"\boxed{\frac{2}{4}}", {"answer": "1/2"}),
            pool.score("math", r"\boxed{3}", {"answer": "1/2"}),
            pool.score("synthetic_arith", "3+4=7. Answer: 7", {"answer": 7}),
            pool.score("test_length", "abcd", {}),
            pool.score("constant_reward", "", {"value": 0.75}),
            pool.score(f"{__name__}:constant_reward", "", {"value": 0.5}),
        )

    assert asyncio.run(main()) == [1.0, 0.0, 1.0, 4.0, 0.75, 0.5]
    assert (
        pool.score_sync(
            "code", "print(int(input()) + 1)", {"tests": [{"input": "1", "output": "2"}]}
        )
        == 1.0
    )


def test_pool_queues_more_calls_than_workers(pool):
    async def main():
        return await asyncio.gather(*(pool.score("test_length", "x" * n, {}) for n in range(7)))

    assert asyncio.run(main()) == [float(n) for n in range(7)]


def test_an_async_reward_is_refused_before_any_call():
    from areal_jax.rewards.registry import RewardConfigError, import_path

    with pytest.raises(RewardConfigError, match="async_reward is an async function; .* def, "
                                                "not async def"):
        import_path(f"{__name__}:async_reward")


def test_pool_rejects_unknown_reward_before_scoring(pool):
    with pytest.raises(RewardNotFoundError):
        pool.score_sync("no_such_reward", "", {})


def test_errors_score_zero_and_the_worker_keeps_serving(pool):
    errors = pool.num_errors
    assert pool.score_sync("raising_reward", "", {}) == 0.0
    assert pool.score_sync("nan_reward", "", {}) == 0.0
    assert pool.score_sync("math", r"\boxed{1}", {}) == 0.0  # missing answer
    assert pool.score_sync("text_reward", "", {}) == 0.0  # float("1.0") passed it as 1.0
    assert pool.num_errors == errors + 4
    assert pool.score_sync("test_length", "ab", {}) == 2.0
    # What went wrong is said plainly (a None was a bare TypeError of float(); 1e300 overflowed
    # the group's advantages into zeros; a KeyError named no key the data has).
    def error(completion, metadata=None):
        value, why = asyncio.run(pool.score_with_error("returned_reward", completion,
                                                       metadata or {}))
        return value, why and why.removeprefix("reward returned_reward failed: ")

    assert error("none") == (0.0, "TypeError: reward returned None, not a number (a missing "
                                  "return?)")
    assert error("huge") == (0.0, "ValueError: reward returned 1e+300, beyond ±1e+09 (the "
                                  "group's advantages would overflow): scale it down")
    assert error("list") == (0.0, "TypeError: reward returned list [1.0], not a number")
    assert error("x", {"answer": "1", "id": "7"}) == (
        0.0, "KeyError: 'gold' (metadata keys: answer, id)")
    assert error("x", {"gold": -1e9}) == (-1e9, None)  # the bound itself is a reward
    # sys.exit() in a reward ended its worker: "worker died (EOFError())", a restart
    restarts = pool.num_errors
    assert error("exit") == (0.0, "SystemExit: 3")
    assert pool.num_errors == restarts + 1 and error("x", {"gold": 2}) == (2.0, None)


def test_hung_and_crashing_workers_are_replaced():
    with RewardPool(num_workers=1, timeout_s=1.0, custom=CUSTOM) as pool:
        start = time.monotonic()
        assert pool.score_sync("hanging_reward", "", {}) == 0.0
        assert time.monotonic() - start < 5.0
        assert pool.num_timeouts == 1
        # The only worker hung; the next call must still be served.
        assert pool.score_sync("test_length", "abc", {}) == 3.0
        assert pool.score_sync("crashing_reward", "", {}) == 0.0
        assert pool.num_errors == 1
        assert pool.score_sync("test_length", "abcde", {}) == 5.0


def test_a_hung_call_does_not_block_concurrent_calls():
    async def main(pool):
        hung = asyncio.ensure_future(pool.score("hanging_reward", "", {}))
        quick = [await pool.score("test_length", "x" * n, {}) for n in range(3)]
        return quick, await hung

    with RewardPool(num_workers=2, timeout_s=2.0, custom=CUSTOM) as pool:
        assert asyncio.run(main(pool)) == ([0.0, 1.0, 2.0], 0.0)


def test_a_reward_that_keeps_hanging_is_probed_one_call_at_a_time():
    name = "hanging_on_request_reward"

    async def main(pool):
        # Twelve calls queued on one worker: two time out, the ten still waiting are not run.
        queued = await asyncio.gather(*(pool.score_with_error(name, "hang", {})
                                        for _ in range(12)))
        counts = pool.num_timeouts, pool.num_skipped
        # A probe runs alone: a call beside it is skipped at once.
        probe = asyncio.ensure_future(pool.score_with_error(name, "hang", {}))
        await asyncio.sleep(0)
        beside = await pool.score_with_error(name, "hang", {})
        await probe
        # A probe ending in time lifts it: calls run side by side again.
        recovered = await pool.score_with_error(name, "ok", {})
        after = await asyncio.gather(*(pool.score_with_error(name, "ok", {}) for _ in range(3)))
        return queued, counts, beside, recovered, after

    # timeout_s leaves a fresh worker (restarted after each timeout) time to start under load
    with RewardPool(num_workers=1, timeout_s=2.0, custom=CUSTOM, timeouts_to_probe=2) as pool:
        queued, counts, beside, recovered, after = asyncio.run(main(pool))
        assert counts == (2, 10)
        assert [value for value, _ in queued] == [0.0] * 12
        assert sum("timed out after" in error for _, error in queued) == 2
        assert sum("skipped: its last 2 calls in a row timed out" in error
                   for _, error in queued) == 10
        assert beside[0] == 0.0 and "skipped: its last 2 calls" in beside[1]
        assert pool.num_timeouts == 3 and pool.num_skipped == 11
        assert recovered == (1.0, None) and after == [(1.0, None)] * 3
        assert pool.num_skipped == 11


def test_a_reward_failing_on_many_answers_logs_its_first_failures_and_counts_the_rest(caplog):
    # Every failed call was a warning: a reward failing on a share of the answers wrote one
    # line per answer to the server's log for the whole run.
    with RewardPool(num_workers=1, timeout_s=20.0, custom=CUSTOM) as pool:
        with caplog.at_level("WARNING", logger="areal_jax.rewards.pool"):
            for _ in range(30):
                assert pool.score_sync("raising_reward", "", {}) == 0.0
            assert pool.num_errors == 30
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 6, lines
    assert all("reward raising_reward failed: RuntimeError: broken reward" in line
               for line in lines[:5])
    assert "further failures of reward raising_reward are counted" in lines[4]
    assert lines[5] == "25 more failures of reward raising_reward (30 in all)"  # at close


def test_repeated_warnings_are_counted_once_a_minute_per_kind(caplog):
    import logging

    from areal_jax.repeated_warnings import RepeatedWarnings

    now = [0.0]
    warnings = RepeatedWarnings(logging.getLogger("t"), shown_per_kind=2, count_every_s=60,
                                clock=lambda: now[0])
    with caplog.at_level("WARNING", logger="t"):
        for t in range(0, 200, 10):  # one of each kind every 10 s
            now[0] = float(t)
            warnings.warn("a", "a at %d", t)
            warnings.warn("b", "b")
        warnings.flush()
        warnings.flush()  # nothing held back: says nothing
    # At 70 s, a minute after the last full line, the six held back since; at 130 and 190 s
    # the next six each; the flushes then have nothing held back.
    assert [r.getMessage() for r in caplog.records][::2] == [
        "a at 0", "a at 10 (further a are counted, every 60 s at most)",
        "6 more a (8 in all)", "6 more a (14 in all)", "6 more a (20 in all)"]
    assert [r.getMessage() for r in caplog.records][1::2] == [
        "b", "b (further b are counted, every 60 s at most)",
        "6 more b (8 in all)", "6 more b (14 in all)", "6 more b (20 in all)"]
    # Kinds that never repeat (a message with a varying name in it) are told apart up to a
    # bound, then share one kind: the log and the counts stay bounded.
    caplog.clear()
    warnings = RepeatedWarnings(logging.getLogger("t"), shown_per_kind=1, clock=lambda: 0.0)
    with caplog.at_level("WARNING", logger="t"):
        for i in range(100):
            warnings.warn(f"kind {i}", "w %d", i)
        warnings.flush()
    assert len(caplog.records) == 22 and len(warnings._seen) == 21  # 20 kinds and the rest
    assert caplog.records[20].getMessage().startswith("w 20 (further warnings of other kinds")
    assert caplog.records[-1].getMessage() == "79 more warnings of other kinds (80 in all)"


def test_closed_pool_refuses_calls_and_stops_workers():
    pool = RewardPool(num_workers=2, timeout_s=5.0)
    processes = [w.process for w in pool._idle]
    pool.close()
    assert all(not p.is_alive() for p in processes)
    with pytest.raises(RuntimeError, match="closed"):
        pool.score_sync("test_length", "", {})


def test_pool_arguments_are_validated():
    with pytest.raises(ValueError, match="num_workers"):
        RewardPool(num_workers=0, timeout_s=1.0)
    with pytest.raises(ValueError, match="timeout_s"):
        RewardPool(num_workers=1, timeout_s=0)
    with pytest.raises(ValueError, match="timeouts_to_probe"):
        RewardPool(num_workers=1, timeout_s=1.0, timeouts_to_probe=0)
