"""A trainer's check of the groups servers send back (``areal_jax.protocol.group_check``)."""

import math

import pytest

from areal_jax.protocol.group_check import group_problem
from areal_jax.protocol.v1 import rollout_pb2 as pb

PROMPT = [5, 6, 7]


def _group(**fields) -> pb.TrajectoryGroup:
    trajectory = {"output_ids": [1, 2, 3], "behav_logprobs": [-0.1, -2.0, 0.0],
                  "versions": [3, 4, 4], "reward": 1.0,
                  "finish_reason": pb.FINISH_REASON_STOP, **fields}
    return pb.TrajectoryGroup(request_id="r", prompt_ids=PROMPT,
                              trajectories=[pb.Trajectory(output_ids=[9], behav_logprobs=[-1.0],
                                                          versions=[4],
                                                          finish_reason=pb.FINISH_REASON_LENGTH),
                                            pb.Trajectory(**trajectory)])


def _problem(group, vocab_size=10, newest_version=4, prompt=PROMPT, **sampling):
    request = pb.RolloutRequest(request_id="r", prompt_ids=prompt, group_size=2,
                                sampling_params=pb.SamplingParams(max_new_tokens=8, **sampling))
    return group_problem(request, group, vocab_size=vocab_size, newest_version=newest_version)


def test_a_well_formed_group_passes():
    assert _problem(_group()) is None
    # tokens a workflow inserted (mask 0) carry no version and no log-prob to check
    assert _problem(_group(output_mask=[1, 0, 1], versions=[4, -1, 4],
                           behav_logprobs=[-1.0, math.nan, -0.5])) is None
    assert _problem(_group(output_ids=[], behav_logprobs=[], versions=[])) is None
    assert _problem(_group(behav_logprobs=[-0.1, -2.0, 5e-4])) is None  # float error above 0
    assert _problem(_group(), prompt=[]) is None  # a request by text: no prompt to compare


@pytest.mark.parametrize("fields, expected", [
    ({"output_ids": [1, 10, 3]}, "trajectories[1].output_ids: 10 is not a token id of a "
                                 "vocabulary of 10"),
    ({"output_ids": [1, -3, 3]}, "trajectories[1].output_ids: -3 is not a token id of a "
                                 "vocabulary of 10"),
    ({"behav_logprobs": [-0.1, math.nan, 0.0]},
     "trajectories[1].behav_logprobs: nan is not a log-probability"),
    ({"behav_logprobs": [-0.1, 0.5, 0.0]},
     "trajectories[1].behav_logprobs: 0.5 is not a log-probability"),
    ({"behav_logprobs": [-0.1, -2.0]}, "trajectories[1].behav_logprobs: 2 entries for 3 "
                                       "output_ids"),
    ({"versions": [3, 4]}, "trajectories[1].versions: 2 entries for 3 output_ids"),
    ({"output_mask": [1, 1]}, "trajectories[1].output_mask: 2 entries for 3 output_ids"),
    ({"output_mask": [1, 2, 1]}, "trajectories[1].output_mask: values other than 0 and 1"),
    ({"versions": [3, 5, 4]}, "trajectories[1].versions: 3 to 5, outside the published 0 to 4"),
    ({"versions": [-1, 4, 4]}, "trajectories[1].versions: -1 to 4, outside the published 0 to 4"),
    ({"reward": math.inf}, "trajectories[1].reward: inf is not a finite value within ±1e+09"),
    ({"reward": -1e39}, "trajectories[1].reward: -1e+39 is not a finite value within ±1e+09"),
    ({"finish_reason": 17}, "trajectories[1].finish_reason: 17 is not a finished state"),
    ({"finish_reason": pb.FINISH_REASON_UNSPECIFIED},
     "trajectories[1].finish_reason: 0 is not a finished state"),
])
def test_what_training_cannot_use_is_named(fields, expected):
    assert _problem(_group(**fields)) == expected


def test_the_log_prob_slack_grows_as_the_temperature_falls():
    # float32 rounding of logits / T puts a log-prob above 0 by about max|logit| / T x 6e-8
    rounded = _group(behav_logprobs=[-0.1, 0.004, 0.0])
    assert _problem(rounded, temperature=1e-3) is None
    assert _problem(rounded, temperature=1.0) == (
        "trajectories[1].behav_logprobs: 0.004 is not a log-probability")
    assert _problem(rounded) is not None  # unset: 1
    assert _problem(rounded, temperature=0.0) is not None  # greedy: log_softmax(logits)
    assert _problem(rounded, greedy=True, temperature=1e-3) is not None


def test_a_group_must_answer_its_request():
    assert _problem(_group(), prompt=[5, 6, 8]) == "prompt_ids: not the request's prompt"
    empty = pb.TrajectoryGroup(request_id="r", prompt_ids=PROMPT)
    assert _problem(empty) == "trajectories: 0 for the request's group_size 2"
    # One short of its group_size (a batch of such groups could not be split into the
    # configured minibatches and stopped the run with a traceback), or one too many.
    short = _group()
    del short.trajectories[0]
    assert _problem(short) == "trajectories: 1 for the request's group_size 2"
    long = _group()
    long.trajectories.append(long.trajectories[0])
    assert _problem(long) == "trajectories: 3 for the request's group_size 2"
