"""pytest's hooks for FlashAttention's tests run by tools/fa_suite/run.py.

FA_CPU=1 (run.py --cpu): the device queries the test module makes at import are answered as an
H100/H200's (sm_90, 80 GB) and the cases are cut to what Triton's interpreter runs in minutes:
sequence lengths up to FA_MAX_SEQ (256; 0: any) and head dims in FA_DIMS ("32,59,64"; empty:
any). FA_PER_TEST=n, on any device: a sample of n cases of each test function, drawn with
FA_SEED (0), from those left."""

import os
import random
import types

import torch

if os.environ.get("FA_CPU") == "1":
    torch.cuda.get_device_capability = lambda *args, **kwargs: (9, 0)
    torch.cuda.get_device_properties = lambda *args, **kwargs: types.SimpleNamespace(total_memory=80 * 2**30)


def _too_large(params: dict) -> bool:
    if os.environ.get("FA_CPU") != "1":
        return False
    max_seq = int(os.environ.get("FA_MAX_SEQ", "256"))
    dims = os.environ.get("FA_DIMS", "32,59,64")
    lengths = [v for name, v in params.items() if name.startswith("seqlen") and isinstance(v, int)]
    if max_seq and any(n > max_seq for n in lengths):
        return True
    return bool(dims) and "d" in params and params["d"] not in {int(d) for d in dims.split(",")}


def pytest_collection_modifyitems(config, items):
    keep = [item for item in items if not _too_large(getattr(getattr(item, "callspec", None), "params", {}))]
    per_test = int(os.environ.get("FA_PER_TEST", "0"))
    if per_test:
        rng = random.Random(int(os.environ.get("FA_SEED", "0")))
        by_function = {}
        for item in keep:
            by_function.setdefault(item.originalname, []).append(item)
        chosen = {id(item) for group in by_function.values() for item in rng.sample(group, min(per_test, len(group)))}
        keep = [item for item in keep if id(item) in chosen]
    kept = {id(item) for item in keep}
    config.hook.pytest_deselected(items=[item for item in items if id(item) not in kept])
    items[:] = keep
