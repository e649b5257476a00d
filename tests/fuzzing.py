"""What the fuzzers (tests/test_fuzz*.py) share: their profile, picked by the device or FUZZ_PROFILE, with
FUZZ_EXAMPLES examples a shard where set; hypothesis's settings for one shard (a fixed seed, no example
database, shrinking only where the profile allows it: on the GPU each shrinking step compiles again); and
the tolerance the paged and varlen fuzzers judge by. Imported by those modules after their
``pytest.importorskip("hypothesis")``."""

from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import seed as fixed_seed

from tests.conftest import DEVICE

# the paged and varlen fuzzers' tolerance of an output and a log-sum-exp, by the query's dtype: float32 as
# the paged feature tests; 16-bit, the probabilities rounded to the dtype for P V (bfloat16's unit 8x
# float16's). FP8 caches: the keys' and values' real values are the reference's inputs; the kernels widen
# them to float16 and round the probabilities to it, so a 16-bit query's tolerance holds.
TOLERANCE = {torch.float32: 2e-4, torch.float16: 1e-2, torch.bfloat16: 4e-2}


def profile(cpu: dict, gpu: dict) -> dict:
    """The profile this run takes (keys: examples, shards, max_len, shrink)."""
    chosen = dict({"cpu": cpu, "gpu": gpu}[os.environ.get("FUZZ_PROFILE", "gpu" if DEVICE == "cuda" else "cpu")])
    if "FUZZ_EXAMPLES" in os.environ:  # a longer (or shorter) run of the same profile
        chosen["examples"] = int(os.environ["FUZZ_EXAMPLES"])
    return chosen


def shard_settings(seed: int, chosen: dict):
    """hypothesis's seed and settings for one shard of ``chosen``'s examples, as one decorator."""
    phases = [Phase.explicit, Phase.reuse, Phase.generate, *([Phase.shrink] if chosen["shrink"] else [])]
    configured = settings(max_examples=chosen["examples"], deadline=None, database=None, phases=phases,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

    def decorate(test):
        return fixed_seed(seed)(configured(test))

    return decorate
