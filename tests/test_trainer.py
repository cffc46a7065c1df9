"""The public Trainer: learning signal, SFT, proximal modes, KL reference, exports, errors."""

import dataclasses
import json
import logging
from types import SimpleNamespace
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from areal_jax.compilation import CompileMeter
from areal_jax.config import ConfigError, from_dict
from areal_jax.models import load_hf_model
from areal_jax.rl import AdvantageConfig, LossConfig, MicroBatchConfig
from areal_jax.trainer import Trainer, TrainerConfig, list_exports, prune_exports
from areal_jax.trainer.programs import compiler_options
from areal_jax.trajectory import Trajectory, TrajectoryGroup

from _hf_models import hf_logits, hf_model, save_hf_model
from _trainer_kit import (
    assert_params_close, host_params, model_params, one_device_mesh, set_on_policy, tiny_model,
    toy_groups,
)  # fmt: skip

MICRO = MicroBatchConfig(token_budget=64, row_buckets=(64,))
# Rows of 32, 64 or 256 tokens: the 30-token trajectories of ``_thirty_token_trajs`` pack into
# rows of 32, one per row.
LADDER = MicroBatchConfig(token_budget=256, row_buckets=(32, 64, 256))


def _thirty_token_trajs(n: int, reward_period: int = 3) -> list[Trajectory]:
    """``n`` trajectories of 4 prompt + 26 output tokens, rewards ``i % reward_period``."""
    return [Trajectory([1, 2, 3, 4], list(range(5, 31)), np.zeros(26), np.zeros(26),
                       reward=float(i % reward_period)) for i in range(n)]


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=7)


def _trainer(model, **kw):
    kw = {"lr": 1e-2, "ppo_n_minibatches": 1, "micro_batch": MICRO, **kw}
    return Trainer(TrainerConfig(**kw), mesh=one_device_mesh(), model=model)


def test_ppo_raises_logprob_of_rewarded_responses_and_lowers_the_others(model):
    trainer = _trainer(model, ppo_n_minibatches=2)
    prompt = [3, 14, 15, 92]
    good = [[65, 35, 89], [79, 32, 38, 46]]
    bad = [[26, 43, 38], [83, 27, 95, 2]]

    def batch():
        outs = [(o, 1.0) for o in good] + [(o, -1.0) for o in bad]
        trajs = [Trajectory(prompt, o, np.zeros(len(o)), np.full(len(o), trainer.version), reward=r)
                 for o, r in outs]
        groups = [TrajectoryGroup("p", trajs)]
        set_on_policy(trainer, groups)
        return groups

    def seq_logp(groups):
        return [float(t.behav_logprobs.sum()) for t in groups[0].trajectories]

    first = batch()
    start = seq_logp(first)
    trainer.train_on_batch(first)
    for _ in range(3):
        trainer.train_on_batch(batch())
    end = seq_logp(batch())
    assert trainer.version == 4
    for i in range(2):
        assert end[i] > start[i] + 1.0, (start, end)  # rewarded: more likely
        assert end[2 + i] < start[2 + i] - 1.0, (start, end)  # penalised: less likely


def test_later_batches_reuse_the_shapes_already_compiled(model):
    """Six sequences of 30 tokens pack as six rows of 32; four would take four rows, a new
    shape, unless the six-row shape (1.5x the area) is reused."""
    micro = MicroBatchConfig(token_budget=256, row_buckets=(32, 256))

    def groups(n):
        trajs = _thirty_token_trajs(n, reward_period=2)
        return [TrajectoryGroup("p", trajs)]

    new_shapes = {}
    for tolerance in (1.5, 1.0):
        trainer = _trainer(model, micro_batch=dataclasses.replace(micro, reuse_tolerance=tolerance))
        steps = [trainer.train_on_batch(groups(n)) for n in (6, 4, 6)]
        new_shapes[tolerance] = [m["packing/new_shapes"] for m in steps]
        assert [m["packing/micro_batches"] for m in steps] == [1.0, 1.0, 1.0]
    assert new_shapes == {1.5: [1.0, 0.0, 0.0], 1.0: [1.0, 1.0, 0.0]}
    # Seven sequences (210 tokens) in a budget of 128 tokens per micro-batch: two of them.
    small = _trainer(model, micro_batch=dataclasses.replace(micro, token_budget=128))
    assert small.train_on_batch(groups(7))["packing/micro_batches"] == 2.0


def test_shapes_compiled_ahead_spare_later_steps_their_compilation(model):
    """Batches of 4, 6 and 8 sequences of 30 tokens need 4, 6 and 8 rows of 32. After the
    first step the trainer compiles the next rungs (6 and 8 rows) in the background, so the
    later steps compile nothing; the updates are those of a trainer that compiles in the step."""
    micro = LADDER
    meter = CompileMeter()

    def groups(n):
        trajs = _thirty_token_trajs(n)
        return [TrajectoryGroup("p", trajs)]

    runs = {}
    for ahead in (False, True):  # the step-independent programs compile in the first run
        trainer = _trainer(model, micro_batch=micro, compile_ahead=ahead,
                           compile_ahead_in="thread")
        new, step_programs, losses = [], [], []
        for n in (4, 6, 8):
            meter.take()
            metrics = trainer.train_on_batch(groups(n))
            step_programs.append(sum(meter.take()[1:]))  # compiled or loaded
            new.append(metrics["packing/new_shapes"])
            losses.append(metrics["loss"])
            assert trainer.wait_compiled_ahead(120)
        runs[ahead] = new, step_programs, losses, host_params(trainer)
        trainer.close()
    assert runs[False][0] == [1.0, 1.0, 1.0] and runs[True][0] == [1.0, 0.0, 0.0]
    # A new shape: its log-prob forward and accumulation (and programs of the batch size).
    assert min(runs[False][1][1:]) >= 2
    assert runs[True][1][1:] == [0, 0]
    np.testing.assert_allclose(runs[True][2], runs[False][2], rtol=1e-6)
    assert_params_close(runs[True][3], runs[False][3], atol=1e-6)


def test_a_sketched_batch_compiles_its_shapes_before_the_first_step(model):
    """Told the token counts of a batch to come, the trainer compiles its shape (then the
    shapes next to it) while it waits: the first step of such a batch compiles no shape."""
    micro = LADDER
    trajs = _thirty_token_trajs(6)
    meter = CompileMeter()
    programs, new = {}, {}
    for sketch in (True, False):
        jax.clear_caches()
        trainer = _trainer(model, micro_batch=micro, compile_ahead_in="thread")
        if sketch:  # six sequences of 30 tokens: six rows of 32, then the neighbours
            queued = trainer.compile_ahead_for([[30] * 6])
            assert queued[0] == (6, 32) and (8, 32) in queued
        assert trainer.wait_compiled_ahead(300)  # as while the rollout servers start
        meter.take()
        new[sketch] = trainer.train_on_batch([TrajectoryGroup("p", trajs)])["packing/new_shapes"]
        programs[sketch] = sum(meter.take()[1:])
        with pytest.raises(ValueError, match=r"sketches\[1\]: every trajectory needs >= 2"):
            trainer.compile_ahead_for([[30], [1, 30]])
        trainer.close()
    assert new == {True: 0.0, False: 1.0}
    assert programs[False] - programs[True] == 2  # the shape's log-prob forward, accumulation
    assert _trainer(model, micro_batch=micro, compile_ahead=False).compile_ahead_for(
        [[30] * 6]) == []
    # A guess the packing refuses (here: 6 x 60 padded tokens in one fixed micro-batch, over the
    # budget of 256) is skipped, and the sketches after it are still queued.
    fixed = dataclasses.replace(micro, mode="fixed", num_micro_batches=1)
    trainer = _trainer(model, micro_batch=fixed)
    queued = trainer.compile_ahead_for([[60] * 6, [30] * 4])
    assert queued[0] == (4, 32) and (6, 64) not in queued  # the second sketch's shape first
    trainer.close()


def test_an_accelerator_trainer_compiles_its_sketched_shapes_on_several_threads_at_once(
        model, monkeypatch, caplog):
    """On an accelerator the trainer compiles ahead on ``compile_ahead_threads`` threads as
    soon as jobs are queued: the sketch's shapes compile side by side, and the step then
    compiles nothing and updates as a trainer that compiled in the step."""
    import areal_jax.trainer.trainer as trainer_module

    trajs = _thirty_token_trajs(6)
    meter = CompileMeter()
    new, programs, params = {}, {}, {}
    for ahead in (False, True):
        jax.clear_caches()
        if not ahead:
            trainer = _trainer(model, micro_batch=LADDER, compile_ahead=False)
        else:
            with monkeypatch.context() as m:  # the steps still run on the CPU mesh
                m.setattr(trainer_module, "mesh_platform", lambda mesh: "gpu")
                trainer = _trainer(model, micro_batch=LADDER, compile_ahead_threads=3)
            with caplog.at_level(logging.INFO, logger="areal_jax.trainer"):
                assert len(trainer.compile_ahead_for([[30] * 6])) >= 3
                assert trainer.wait_compiled_ahead(300)  # no idle window needed: not fitted
            threads = {r.threadName for r in caplog.records if " ahead in " in r.getMessage()}
            assert len(threads) >= 2 and threads <= {f"compile-ahead-{i}" for i in range(3)}
        meter.take()
        new[ahead] = trainer.train_on_batch([TrajectoryGroup("p", trajs)])["packing/new_shapes"]
        programs[ahead] = sum(meter.take()[1:])
        params[ahead] = host_params(trainer)
        trainer.close()
    assert new == {True: 0.0, False: 1.0}
    # compiled ahead: the update's two programs, the shape's log-prob forward and accumulation
    assert programs[False] - programs[True] == 4
    assert_params_close(params[True], params[False], atol=0)
    with pytest.raises(ConfigError, match="compile_ahead_threads must be >= 1, got 0"):
        TrainerConfig(compile_ahead_threads=0)


def test_the_first_step_finds_its_update_compiled_ahead(model):
    """The gradient zeros and the optimiser update do not depend on the batch: they compile
    while the trainer first waits, and the first step compiles only its shape's programs."""
    micro = LADDER
    trajs = _thirty_token_trajs(4)
    meter = CompileMeter()
    programs, params = {}, {}
    for ahead in (True, False):
        jax.clear_caches()
        trainer = _trainer(model, micro_batch=micro, compile_ahead=ahead,
                           compile_ahead_in="thread")
        assert trainer.wait_compiled_ahead(120)  # as while waiting for the first batch
        meter.take()
        trainer.train_on_batch([TrajectoryGroup("p", trajs)])
        programs[ahead] = sum(meter.take()[1:])
        params[ahead] = host_params(trainer)
        trainer.close()
    assert programs[False] - programs[True] == 2
    assert_params_close(params[True], params[False], atol=0)


def test_the_first_checkpoint_finds_its_checksum_program_compiled_ahead(model, tmp_path):
    micro = LADDER
    trajs = _thirty_token_trajs(4)
    meter = CompileMeter()
    programs = {}
    for ahead in (True, False):
        jax.clear_caches()  # the checksum program is module-wide: compile it anew each time
        trainer = _trainer(model, micro_batch=micro, compile_ahead=ahead,
                           compile_ahead_in="thread", run_dir=str(tmp_path / str(ahead)),
                           checkpoint_async=False)
        trainer.train_on_batch([TrajectoryGroup("p", trajs)])
        assert trainer.wait_compiled_ahead(120)
        meter.take()
        trainer.save()
        programs[ahead] = sum(meter.take()[1:])
        trainer.close()
    assert programs == {True: 0, False: 1}


def test_sft_lowers_the_loss(model):
    trainer = _trainer(model, lr=3e-3)
    examples = [([5, 6, 7], [8, 9, 10, 11]), ([20, 21], [22, 23, 24]), ([1], [2, 3, 4, 5, 6])]
    steps = [trainer.sft_on_batch(examples) for _ in range(6)]
    losses = [m["loss"] for m in steps]
    assert losses[0] == pytest.approx(_nll(model, examples), rel=1e-5)
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < 0.7 * losses[0]
    assert trainer.version == 6
    # the shapes each step compiled: the first step's, then none (the same batch each time)
    assert [m["packing/new_shapes"] for m in steps] == [1.0] + [0.0] * 5


def test_a_step_whose_loss_is_not_finite_stops_training(model):
    # SFT ran all its steps at loss NaN (ids past the embedding) and exported the result.
    from areal_jax.trainer.trainer import TrainingDivergedError

    trainer = _trainer(model, lr=1e30)
    examples = [([5, 6, 7], [8, 9, 10, 11]), ([20, 21], [22, 23, 24])]
    with pytest.raises(TrainingDivergedError, match=r"the step to version \d+ gave (loss|grad_norm) "
                                                    r"(nan|inf).*nothing of that step was"):
        for _ in range(5):
            trainer.sft_on_batch(examples)


def test_sft_steps_count_the_shapes_they_compile(model):
    trainer = _trainer(model, micro_batch=MicroBatchConfig(token_budget=256,
                                                           row_buckets=(32, 64, 256)))
    short, long = [([1, 2], [3] * 20)] * 3, [([1] * 10, [2] * 90)]
    counts = [trainer.sft_on_batch(b)["packing/new_shapes"] for b in (short, long, short, long)]
    assert counts == [1.0, 1.0, 0.0, 0.0]


def _nll(model, examples):
    """Token-mean cross-entropy of the responses, computed by an unpacked forward."""
    import jax
    import jax.numpy as jnp

    total, count = 0.0, 0
    for prompt, response in examples:
        tokens = jnp.asarray([prompt + response])
        logits = model.forward_logits(tokens, jnp.ones_like(tokens), jnp.arange(tokens.shape[1])[None])
        logp = np.asarray(jax.nn.log_softmax(logits[0]))
        for k, tok in enumerate(response):
            total -= logp[len(prompt) - 1 + k, tok]
            count += 1
    return total / count


def test_loglinear_proximal_equals_recompute_on_fresh_data(model):
    # Fresh tokens (version = trainer version) give alpha = 0: both modes use pi_behav.
    results = []
    for mode in ("recompute", "loglinear"):
        trainer = _trainer(model, ppo_n_minibatches=2, loss=LossConfig(prox_logp=mode))
        groups = toy_groups(seed=11, n_groups=2, group_size=3)
        set_on_policy(trainer, groups)
        m = trainer.train_on_batch(groups)
        results.append((m, host_params(trainer)))
    (m_rec, p_rec), (m_lin, p_lin) = results
    assert m_lin["loss"] == pytest.approx(m_rec["loss"], abs=1e-6)
    assert m_lin["ppo/approx_kl"] == pytest.approx(m_rec["ppo/approx_kl"], abs=1e-7)
    assert m_rec["ppo/approx_kl"] > 0  # the second minibatch ran on moved parameters
    assert_params_close(p_lin, p_rec, atol=1e-5)


def test_kl_to_the_frozen_initial_policy(model):
    adv = AdvantageConfig(kl_beta=0.5, kl_estimator="k1")
    trainer = _trainer(model, advantage=adv)
    groups = toy_groups(seed=12, n_groups=2, group_size=2)
    trajs = [t for g in groups for t in g.trajectories]
    set_on_policy(trainer, groups)
    initial = [t.behav_logprobs.copy() for t in trajs]
    assert trainer.train_on_batch(groups)["kl_ref/mean"] == pytest.approx(0.0, abs=1e-6)
    set_on_policy(trainer, groups)
    m = trainer.train_on_batch(groups)
    expected = np.mean(np.concatenate([t.behav_logprobs - ref for t, ref in zip(trajs, initial)]))
    assert abs(expected) > 1e-3
    assert m["kl_ref/mean"] == pytest.approx(expected, rel=1e-4)


def test_an_export_in_use_is_not_pruned_and_a_linked_copy_outlives_pruning(tmp_path):
    from areal_jax.trainer.publish import export_in_use, link_newest_export, remove_restart_copies

    exports = tmp_path / "exports"
    for v in range(4):
        (exports / f"v{v:06d}").mkdir(parents=True)
        (exports / f"v{v:06d}" / "model.safetensors").write_bytes(bytes([v]) * 64)
    with export_in_use(exports / "v000001"):  # a server loading it
        assert prune_exports(exports, keep=2) == [exports / "v000000"]
        assert (exports / "v000001").is_dir()
    assert prune_exports(exports, keep=2) == [exports / "v000001"]  # once the load is over
    with pytest.raises(FileNotFoundError, match="v000001 is gone"):
        with export_in_use(exports / "v000001"):
            pass

    version, copy = link_newest_export(exports, "server0")
    assert (version, copy) == (3, exports / ".restart-server0")
    same = (copy / "model.safetensors").stat().st_ino
    assert same == (exports / "v000003" / "model.safetensors").stat().st_ino  # a link, no copy
    (exports / "v000004").mkdir()
    (exports / "v000005").mkdir()
    prune_exports(exports, keep=2)
    assert not (exports / "v000003").exists()
    assert (copy / "model.safetensors").read_bytes() == bytes([3]) * 64
    assert list_exports(exports) == [(4, exports / "v000004"), (5, exports / "v000005")]
    assert not list(exports.glob(".pruned-*"))  # pruned exports are renamed, then deleted
    assert link_newest_export(exports, "server0") == (5, copy)  # its previous copy replaced
    assert not (copy / "model.safetensors").exists()
    remove_restart_copies(exports)
    assert not copy.exists()
    (tmp_path / "no_exports").mkdir()
    assert link_newest_export(tmp_path / "no_exports", "server0") is None


def test_pruning_keeps_the_newest_exports_and_the_multiples_of_keep_every(tmp_path):
    for v in range(10):
        (tmp_path / f"v{v:06d}").mkdir()
    (tmp_path / "v000003.tmp").mkdir()  # not an export: never listed, never pruned
    doomed = prune_exports(tmp_path, keep=2, protect=tmp_path / "v000005", keep_every=4)
    assert sorted(p.name for p in doomed) == ["v000001", "v000002", "v000003", "v000006",
                                              "v000007"]
    assert [v for v, _ in list_exports(tmp_path)] == [0, 4, 5, 8, 9]
    assert prune_exports(tmp_path, keep=1) == [tmp_path / f"v{v:06d}" for v in (0, 4, 5, 8)]
    assert (tmp_path / "v000003.tmp").is_dir()
    with pytest.raises(ConfigError, match="export_keep must be >= 2, got 1: with 1, writing "
                                          "the next export removes the one the servers serve"):
        TrainerConfig(export_keep=1)
    with pytest.raises(ConfigError, match="export_keep_every must be >= 0"):
        TrainerConfig(export_keep_every=-1)


def test_a_minibatch_without_trained_tokens_makes_no_update(model):
    # Split into two minibatches, one holding only a trajectory whose tokens a workflow
    # inserted: AdamW used to step on its zero gradients (momentum, weight decay, schedule).
    good, inserted = toy_groups(seed=5, n_groups=1, group_size=2)[0].trajectories
    inserted.output_mask = np.zeros(len(inserted.output_ids), np.int32)
    split = _trainer(model, ppo_n_minibatches=2)
    whole = _trainer(model, ppo_n_minibatches=1)  # the same gradient in one update
    for trainer in (split, whole):
        trainer.train_on_batch([TrajectoryGroup("g", [good, inserted])])
    assert_params_close(host_params(split), host_params(whole), atol=1e-6)


def test_a_resumed_run_discards_the_exports_of_versions_past_its_checkpoint(tmp_path):
    from areal_jax.trainer.publish import discard_exports_after

    for v in (2, 4, 6, 7):
        (tmp_path / f"v{v:06d}").mkdir()
    (tmp_path / ".v000008.tmp-k1ll3d").mkdir()  # an export a killed run was writing
    assert discard_exports_after(tmp_path, 4) == [tmp_path / "v000006", tmp_path / "v000007"]
    assert [v for v, _ in list_exports(tmp_path)] == [2, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v000002", "v000004"]
    assert discard_exports_after(tmp_path / "none", 0) == []


def test_publish_exports_what_transformers_loads_and_prunes_old_versions(tmp_path):
    ref = hf_model("qwen2", seed=5)
    src = save_hf_model(ref, tmp_path / "src")
    (src / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    cfg = TrainerConfig(model_path=str(src), run_dir=str(tmp_path / "run"), lr=1e-2,
                        export_keep=2, micro_batch=MICRO)
    trainer = Trainer(cfg, mesh=one_device_mesh())
    paths = []
    for _ in range(3):
        trainer.sft_on_batch([([1, 2, 3], [4, 5, 6, 7])])
        paths.append(trainer.publish(trainer.version))
    exports = tmp_path / "run" / "exports"
    assert paths[-1] == exports / "v000003"
    assert sorted(p.name for p in exports.iterdir()) == ["v000002", "v000003"]
    assert (paths[-1] / "tokenizer_config.json").read_text() == json.dumps({"model_max_length": 64})

    loaded = AutoModelForCausalLM.from_pretrained(paths[-1], dtype=torch.float32).eval()
    tokens = np.random.RandomState(0).randint(0, 97, size=(2, 12))
    ours = trainer.model.forward_logits(tokens, np.ones_like(tokens), np.tile(np.arange(12), (2, 1)))
    np.testing.assert_allclose(hf_logits(loaded, tokens), np.asarray(ours), atol=1e-5, rtol=0)
    assert not np.allclose(hf_logits(loaded, tokens), hf_logits(ref, tokens), atol=1e-3)  # trained

    with pytest.raises(ValueError, match="cannot publish version 7: the parameters are version 3"):
        trainer.publish(7)


def test_a_publish_snapshot_keeps_its_version_while_the_next_step_trains(model, tmp_path):
    trainer = _trainer(model, run_dir=str(tmp_path), export_keep=2)
    examples = [([5, 6, 7], [8, 9, 10, 11]), ([20, 21], [22, 23, 24])]
    trainer.sft_on_batch(examples)
    at_one = host_params(trainer)
    snapshot = trainer.snapshot_for_publish()
    trainer.sft_on_batch(examples)  # donates the arrays of version 1
    with ThreadPoolExecutor(1) as pool:
        path = pool.submit(snapshot.write).result()
    assert (snapshot.version, trainer.version) == (1, 2)
    assert path == tmp_path / "exports" / "v000001"
    assert_params_close(model_params(load_hf_model(path)[0]), at_one, atol=0)
    assert not np.allclose(host_params(trainer)["['embed'].value"], at_one["['embed'].value"])
    with pytest.raises(RuntimeError, match="only process 0 holds the snapshot's tensors"):
        dataclasses.replace(snapshot, tensors=None).write()
    with pytest.raises(ValueError, match="cannot publish version 1: the parameters are version 2"):
        trainer.snapshot_for_publish(1)


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="lr must be > 0"):
        TrainerConfig(lr=0.0)
    with pytest.raises(ConfigError, match="total_steps .* must exceed warmup_steps"):
        TrainerConfig(lr_schedule="cosine", warmup_steps=10, total_steps=5)
    with pytest.raises(ConfigError, match="grad_clip must be > 0 or null"):
        TrainerConfig(grad_clip=-1.0)
    with pytest.raises(ConfigError, match="overlong_window > 0 needs max_new_tokens"):
        TrainerConfig(advantage=AdvantageConfig(overlong_window=16))
    with pytest.raises(ConfigError, match="unknown config key loss.eps_clip"):
        from_dict(TrainerConfig, {"loss": {"eps_clip": 0.2}})
    with pytest.raises(ConfigError, match="ppo_n_minibatches must be >= 1"):
        from_dict(TrainerConfig, {"ppo_n_minibatches": 0})
    micro = {"token_budget": 4096, "row_buckets": [2048, 4096]}
    cfg = from_dict(TrainerConfig, {"lr": "1e-5", "mesh": {"fsdp": 2}, "micro_batch": micro})
    assert cfg.lr == 1e-5 and cfg.mesh.fsdp == 2 and cfg.micro_batch.row_buckets == (2048, 4096)
    with pytest.raises(ConfigError, match="model_path is required"):
        Trainer(TrainerConfig(), mesh=one_device_mesh())
    with pytest.raises(ConfigError, match="cpu_opt_level must be 0, 1, 2, 3 or null, got 4"):
        TrainerConfig(cpu_opt_level=4)


def test_the_cpu_optimisation_level_reaches_the_train_programs_on_a_cpu_mesh_only():
    mesh = one_device_mesh()
    assert compiler_options(TrainerConfig(), mesh) == {"xla_backend_optimization_level": 1}
    assert compiler_options(TrainerConfig(cpu_opt_level=None), mesh) is None
    assert compiler_options(TrainerConfig(cpu_opt_level=3), mesh) == {
        "xla_backend_optimization_level": 3}
    tpu = SimpleNamespace(devices=np.array([SimpleNamespace(platform="tpu")]))
    assert compiler_options(TrainerConfig(), tpu) is None  # accelerators keep XLA's options


def test_bad_batches_are_rejected_before_any_update(model):
    trainer = _trainer(model, ppo_n_minibatches=4)
    with pytest.raises(ValueError, match="groups is empty"):
        trainer.train_on_batch([])
    silent = Trajectory([1, 2], [3, 4], np.zeros(2), np.zeros(2), output_mask=[0, 0])
    with pytest.raises(ValueError, match="no trained token"):
        trainer.train_on_batch([TrajectoryGroup("g", [silent])])
    few = toy_groups(seed=1, n_groups=1, group_size=2)
    twice = [TrajectoryGroup("g", few[0].trajectories * 2)]
    for check in (trainer.check_batch, trainer.train_on_batch):  # the check runs no step
        with pytest.raises(ValueError, match="ppo_n_minibatches=4 is more than the 2 trajectories"):
            check(few)
        with pytest.raises(ValueError, match="the same Trajectory object appears twice"):
            check(twice)
        with pytest.raises(ValueError, match="groups is empty"):
            check([])
    for check in (trainer.check_sft, trainer.sft_on_batch):
        with pytest.raises(ValueError, match=r"examples\[1\] has an empty response"):
            check([([1], [2]), ([3], [])])
    with pytest.raises(ConfigError, match="run_dir is not set"):
        trainer.save({})
    assert trainer.version == 0
