"""Test setup: 8 virtual CPU devices for sharding tests, offline Hugging Face."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
# Tests fork this process (subprocess with preexec_fn: the sandbox, signal set-ups) after other
# tests ran gRPC in it: with fork support gRPC restarts its poller in the child, whose epoll
# descriptor close_fds then closes, and the child aborts before its exec (grpc/grpc#43055).
# Nothing here uses gRPC in a forked child.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
# The persistent compilation cache, as `areal-jax` uses it, shared by every test process (and
# the servers and trainers tests launch): identical programs compile once per machine.
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR",
    os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                 "areal-jax", "xla-tests"),
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
