"""Only configured rewards are callable: built-ins, registered names and custom rewards."""

import pytest

from areal_jax.config import ConfigError
from areal_jax.rewards import (
    RewardConfigError,
    RewardNotFoundError,
    RewardPool,
    check_reward,
    get_reward,
)


def echo_reward(completion: str, metadata: dict) -> float:
    return float(len(completion))


NOT_A_FUNCTION = 3


@pytest.fixture(scope="module")
def pool():
    with RewardPool(num_workers=1, timeout_s=20.0, custom={"echo": f"{__name__}:echo_reward"}) as p:
        yield p


def test_pool_refuses_dotted_paths_that_are_not_configured(pool, tmp_path):
    marker = tmp_path / "ran"
    payload = f"open({str(marker)!r}, 'w').close()"
    for name in ("builtins:exec", "os:system", "builtins.exec", f"{__name__}:NOT_A_FUNCTION"):
        with pytest.raises(RewardNotFoundError, match="not configured for this pool"):
            pool.score_sync(name, payload, {})
    assert not marker.exists()
    assert pool.num_scored == 0
    assert pool.score_sync("echo", "abc", {}) == 3.0


def test_reward_names_are_builtins_and_custom_names(pool):
    assert {"math", "code", "code_fraction", "synthetic_arith", "echo"} <= pool.reward_names
    assert isinstance(pool.reward_names, frozenset)
    dotted = {name for name in pool.reward_names if ":" in name or "." in name}
    assert dotted == {f"{__name__}:echo_reward"}  # only the configured path


def test_a_custom_path_is_also_usable_as_its_own_name():
    path = f"{__name__}:echo_reward"
    with RewardPool(num_workers=1, timeout_s=20.0, custom={path: path}) as pool:
        assert path in pool.reward_names
        assert pool.score_sync(path, "abcd", {}) == 4.0


def test_broken_custom_reward_shows_the_real_error_at_construction():
    with pytest.raises(RewardConfigError, match="No module named 'no_such_pkg'"):
        RewardPool(num_workers=1, timeout_s=1.0, custom={"x": "no_such_pkg.module:fn"})
    with pytest.raises(RewardConfigError, match="has no attribute 'missing'"):
        RewardPool(num_workers=1, timeout_s=1.0, custom={"x": f"{__name__}:missing"})
    with pytest.raises(RewardConfigError, match="not a function"):
        RewardPool(num_workers=1, timeout_s=1.0, custom={"x": f"{__name__}:NOT_A_FUNCTION"})
    with pytest.raises(RewardConfigError, match="built-in"):
        RewardPool(num_workers=1, timeout_s=1.0, custom={"math": f"{__name__}:echo_reward"})


def test_import_errors_raised_inside_the_module_are_reported(tmp_path, monkeypatch):
    (tmp_path / "broken_reward_mod.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RewardConfigError, match="No module named 'no_such_dependency_xyz'"):
        check_reward("mine", {"mine": "broken_reward_mod:fn"})


def test_check_reward_accepts_only_usable_names():
    path = f"{__name__}:echo_reward"
    check_reward("math")
    check_reward("echo", {"echo": path})
    check_reward(path, {"echo": path})  # a configured path names itself
    check_reward(path, {path: path})
    with pytest.raises(RewardConfigError, match="must be registered in config"):
        check_reward(path)
    with pytest.raises(RewardConfigError, match="must be registered in config"):
        check_reward("os:system", {"echo": path})
    with pytest.raises(RewardConfigError, match="not registered; available"):
        check_reward("nope")
    assert issubclass(RewardConfigError, ConfigError)


def test_get_reward_never_imports_a_path():
    with pytest.raises(RewardNotFoundError, match="must be registered in config"):
        get_reward("os:system")
    assert get_reward("code").__name__ == "code_reward"
    # A path written with a dot where its colon goes says how to write it.
    with pytest.raises(RewardNotFoundError, match=r"a path names the function after a colon: "
                                                  r"'my_project.rewards:score'"):
        get_reward("my_project.rewards.score")
    with pytest.raises(RewardNotFoundError, match=r"or 'my_project.rewards:<function>' where "
                                                  r"my_project.rewards is the module"):
        get_reward("my_project.rewards")
