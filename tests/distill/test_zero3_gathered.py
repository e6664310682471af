"""`zero3_gathered` waits for the engine's in-flight parameter prefetches before it gathers: on two H200s the
long-context stage's final save under ZeRO-3 failed with DeepSpeed's "Cannot partition a param in flight" when
it gathered right after the last step. The real failure needs two GPUs; here the order of the calls is checked
with stand-ins for the engine and for DeepSpeed's gather."""
from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch.nn as nn

from hybridize.distill.loop import deepspeed_engine, zero3_gathered
from tests.distill.test_scale import HAS_DS

pytestmark = pytest.mark.skipif(not HAS_DS, reason="deepspeed is not installed (pip install deepspeed)")


class _Engine:
    def __init__(self, calls):
        self.calls = calls

    def empty_partition_cache(self):
        self.calls.append("settle")


def _sharded(calls, monkeypatch):
    import deepspeed

    @contextmanager
    def gathered(params, modifier_rank=None):
        calls.append(("gather", len(params)))
        yield

    monkeypatch.setattr(deepspeed.zero, "GatheredParameters", gathered)
    model = nn.Linear(3, 2)
    for p in model.parameters():
        p.ds_id = 0   # what DeepSpeed marks its ZeRO-3 parameters with
    return model


def test_in_flight_prefetches_are_settled_before_the_gather(monkeypatch):
    calls = []
    model = _sharded(calls, monkeypatch)
    with zero3_gathered(model, _Engine(calls)):
        calls.append("inside")
    assert calls == ["settle", ("gather", 2), "inside"]


def test_without_an_engine_or_shards_nothing_extra_happens(monkeypatch):
    calls = []
    model = _sharded(calls, monkeypatch)
    with zero3_gathered(model):
        pass
    assert calls == [("gather", 2)]
    calls.clear()
    with zero3_gathered(nn.Linear(3, 2), _Engine(calls)):   # no ZeRO-3 shards: a no-op
        pass
    assert calls == []


def test_the_engine_is_found_behind_an_accelerator_or_a_trainer():
    engine = _Engine([])
    assert deepspeed_engine(SimpleNamespace(deepspeed_engine_wrapped=SimpleNamespace(engine=engine))) is engine
    assert deepspeed_engine(SimpleNamespace(model_wrapped=engine)) is engine
    assert deepspeed_engine(SimpleNamespace(model_wrapped=nn.Linear(2, 2))) is None   # a trainer without DeepSpeed
    assert deepspeed_engine(SimpleNamespace(deepspeed_engine_wrapped=None)) is None
