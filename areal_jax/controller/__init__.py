"""The trainer-side controller: staleness gate, rollout-server pool, the asynchronous RL loop."""
